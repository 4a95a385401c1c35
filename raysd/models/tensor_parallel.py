"""A tensor-parallel target: each of N ranks holds 1/N of every decoder layer's weights.

The split is Megatron-LM's (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter
Language Models Using Model Parallelism", section 3): in each transformer layer the first linear
of a pair is split by its output columns and the second by its input rows, so the pair needs one
all-reduce (a sum) and nothing in between.

- attention: q_proj, k_proj, v_proj keep the rows of this rank's query heads and key/value heads
  (column-parallel, Qwen2's qkv biases sliced alike); every head attends on its own, so each rank
  runs whole heads over its 1/N of the KV cache. o_proj keeps the input columns of those heads
  (row-parallel) and its output is all-reduced.
- MLP: gate_proj and up_proj keep this rank's 1/N of the intermediate columns (the SiLU gate is
  elementwise, so it needs no exchange); down_proj keeps those input columns and is all-reduced.

Embeddings, norms and the output head stay whole on every rank: a vocabulary-parallel head would
save its memory at the cost of an all-gather of the logits every step. Every rank therefore ends
a forward with the same logits (an all-reduce hands every rank the same sum), and runs the same
rejection test on the same draws: the ranks keep the same tokens without exchanging them.

For the static runner's families (llama, qwen2, mistral: raysd.models.static_runner). raysd
shards them itself rather than through transformers' `tp_plan` (`from_pretrained(tp_plan=
"auto")`): that path loads DTensor weights in a torchrun-launched group, which neither raysd's
packed CPU kernels (raysd.models.linear, oneDNN reorders of plain tensors) nor its other loading
paths (the GGUF cache, distilled drafts, models built in memory) go through.

Shard in the model factory, before any runner is built: the packed kernels copy each nn.Linear's
weight on the first forward, and the row-parallel wrapper keeps a plain nn.Linear inside it
(without the bias, which is added once after the all-reduce) that they pack like any other.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
from torch import nn

from raysd.models.names import TensorParallel

TP_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})  # as raysd.models.static_runner.STATIC_MODEL_TYPES


def check_tensor_parallel(config, world_size: int) -> None:
    """One-line ValueError unless a model of this (Hugging Face) config splits over `world_size`
    ranks: a supported family whose heads, key/value heads and MLP columns divide by it. Reads the
    config only, so a caller checks before loading any weights (AutoConfig.from_pretrained)."""
    if world_size < 1:
        raise ValueError(f"target tensor parallel must be >= 1, got {world_size}")
    if world_size == 1:
        return
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_MODEL_TYPES:
        raise ValueError(f"tensor parallel supports {sorted(TP_MODEL_TYPES)} models, not {model_type!r}")
    heads = config.num_attention_heads
    sizes = {"attention heads": heads, "key/value heads": getattr(config, "num_key_value_heads", None) or heads,
             "intermediate size": config.intermediate_size}
    for what, n in sizes.items():
        if n % world_size:
            raise ValueError(f"tensor parallel {world_size} does not divide the model's {what} ({n})")


class RowParallelLinear(nn.Module):
    """A row-parallel linear (Megatron-LM section 3): this rank's input columns of the weight, then
    one all-reduce (sum) of the partial outputs over `group`, then the bias, added once.
    `linear` is a plain nn.Linear without bias, so raysd.models.linear packs it like any other."""

    def __init__(self, linear: nn.Linear, bias: nn.Parameter | None, group=None):
        super().__init__()
        self.linear = linear
        self.bias = bias
        self.group = group  # None: the default group (one per process: raysd's rank actors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., K/N) -> (..., N_out)
        y = self.linear(x)  # (..., N_out): this rank's partial sum
        dist.all_reduce(y, group=self.group)  # (..., N_out): the full product, the same on every rank
        return y if self.bias is None else y + self.bias


def _rows(weight: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    n = weight.shape[0] // parts
    return weight[part * n : (part + 1) * n].clone()  # a copy: the full tensor is freed with the module's old parameter


def _column_parallel(linear: nn.Linear, rank: int, world_size: int) -> None:
    """Keep this rank's output rows (and bias entries) of `linear`, in place."""
    with torch.no_grad():
        linear.weight = nn.Parameter(_rows(linear.weight, rank, world_size), requires_grad=False)  # [N/n, K]
        if linear.bias is not None:
            linear.bias = nn.Parameter(_rows(linear.bias, rank, world_size), requires_grad=False)  # [N/n]
    linear.out_features = linear.weight.shape[0]


def _row_parallel(linear: nn.Linear, rank: int, world_size: int, group) -> RowParallelLinear:
    """This rank's input columns of `linear`, wrapped to all-reduce its output."""
    with torch.no_grad():
        weight = _rows(linear.weight.t(), rank, world_size).t().contiguous()  # [N, K/n]
        inner = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        inner.weight = nn.Parameter(weight, requires_grad=False)
    bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
    return RowParallelLinear(inner, bias, group)


def shard_model(model: nn.Module, rank: int, world_size: int, group=None) -> nn.Module:
    """Keep rank `rank`'s 1/world_size of every decoder layer of a llama/qwen2/mistral causal LM, in
    place (see the module's docstring); returns the model. world_size 1 leaves it whole. Collectives
    run at forward time on `group` (None: the default group, set up with `init_group`), so every
    rank must run the same forwards in the same order."""
    parallel = TensorParallel(rank, world_size)
    check_tensor_parallel(model.config, world_size)
    if world_size == 1:
        return model
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # Rows are head-major ([heads * head_dim, hidden]), so a contiguous 1/N of them is 1/N of the
        # heads; rank r's query heads are exactly those of its key/value heads (both split in order,
        # groups of num_key_value_groups), so num_key_value_groups, head_dim and the attention's
        # reshapes (-1 heads) hold unchanged. The KV cache sizes itself from the keys it is given.
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            _column_parallel(proj, rank, world_size)
        attn.o_proj = _row_parallel(attn.o_proj, rank, world_size, group)
        mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size, group)
        for name in ("num_heads", "num_key_value_heads"):  # per-rank counts, where a version keeps them
            if isinstance(getattr(attn, name, None), int):
                setattr(attn, name, getattr(attn, name) // world_size)
        if isinstance(getattr(mlp, "intermediate_size", None), int):
            mlp.intermediate_size //= world_size
    model._raysd_tensor_parallel = parallel  # not in the config: the config stays the whole model's
    return model


def model_tensor_parallel(model) -> TensorParallel:
    """The model's place in its tensor-parallel group (TensorParallel(0, 1) for a whole model)."""
    return getattr(model, "_raysd_tensor_parallel", TensorParallel())


def default_backend(device: str | torch.device = "cpu") -> str:
    """NCCL between GPUs, gloo on the CPU."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def free_address(host: str | None = None) -> tuple[str, int]:
    """(address, port) this machine can listen on for a group's rendezvous: the port is free now
    (the OS picks it), and is only taken by rank 0 once every rank joins."""
    host = host or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def init_group(rank: int, world_size: int, master_addr: str, master_port: int, backend: str | None = None,
               timeout_s: float = 1800.0):
    """Join (this process's default) torch.distributed group: rank `rank` of `world_size`, meeting at
    tcp://master_addr:master_port (rank 0 listens there). No torchrun and no environment variables:
    raysd picks the address and port itself. `backend`: None picks by the device (`default_backend`
    of cuda when CUDA is available). Returns the group (the default one)."""
    import datetime

    TensorParallel(rank, world_size)
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    backend = backend or default_backend("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.group.WORLD
