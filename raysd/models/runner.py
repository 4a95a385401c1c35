"""Which runner holds a model's KV cache: one interface, two implementations.

`StaticRunner` (preallocated slots, rollback = moving a row's length) is the default
for the architectures it supports (Llama, Qwen2, Mistral, SmolLM2); `DynamicRunner` (Hugging
Face DynamicCache, left-padded rows) runs every other causal LM. Both take the same calls:
`forward`, `rollback`, `select`, `add_rows`, `add_prefilled`, and keep the same promise:
each row's logits are those of an unpadded batch-of-one forward over its history. After
`add_prefilled`, `prefill_calls` lists the new rows (0-based among them) that each of its
forwards ran, in order, right-aligned: what a feature tap needs to tell the rows apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Union

from raysd.models.dynamic_runner import DynamicRunner
from raysd.models.names import check_runner_kind
from raysd.models.static_runner import StaticRunner, supports_static

if TYPE_CHECKING:  # annotations only: a process that only coordinates never imports the modeling stack
    from transformers import PreTrainedModel

RunnerKind = Literal["auto", "static", "dynamic"]
# Whether `compile=None` compiles under graphs it turned on (tests/gpu turn it off: compiling every
# test's models would take their minutes; they compile where they say so).
AUTO_COMPILE = True
Runner = Union[DynamicRunner, StaticRunner]


def make_runner(model: PreTrainedModel, kind: str = "auto", vocab_size: int | None = None,
                linear_kernels: str = "auto", cuda_graphs: bool | None = False, compile: bool | None = False) -> Runner:
    """"auto": the static runner where the architecture supports it, else the dynamic one;
    "static" refuses an unsupported model with a clear error instead of falling back.
    `linear_kernels`: raysd.models.linear ("auto": prepacked on a CPU in float32 where measured faster; "stock");
    `cuda_graphs`: the static runner's steps replayed as CUDA graphs (raysd.models.cuda_graphs); None: on
    for the static runner on a CUDA device;
    `compile`: its steps' forwards through torch.compile (with `cuda_graphs`, the graphs capture the compiled
    kernels); None: with the CUDA graphs."""
    check_runner_kind(kind)
    static = kind == "static" or (kind == "auto" and supports_static(model))
    if cuda_graphs is None:  # not a tensor-parallel shard: its all-reduces are not captured
        cuda_graphs = (static and next(model.parameters()).device.type == "cuda"
                       and getattr(model, "_raysd_tensor_parallel", None) is None)
    if compile is None:
        compile = cuda_graphs and AUTO_COMPILE
    if static:
        return StaticRunner(model, vocab_size=vocab_size, linear_kernels=linear_kernels, cuda_graphs=cuda_graphs,
                            compile=compile)
    if cuda_graphs or compile:
        raise ValueError(f"cuda_graphs and compile need the static runner (Llama-family models), not the dynamic one for "
                         f"{model.config.model_type!r}")
    return DynamicRunner(model, vocab_size=vocab_size, linear_kernels=linear_kernels)
