"""The GPU scenario's parts (bench.scenarios.gpu): model shapes and builders, the step timer, one
runner forward timed, host synchronisations counted. Ported from bench/gpu_bench.py."""

from __future__ import annotations

import copy
import os
import statistics
import time
import warnings

import torch

SHAPES = {
    # Llama-3-8B: 8.0B parameters, 16 GB in bf16.
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    # Llama-3.2-1B: 1.24B parameters (tied embeddings), 2.5 GB in bf16.
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True),
    # --quick: tiny, for a CPU smoke run.
    "tiny-target": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, vocab_size=2048, tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=2048, tie_word_embeddings=True),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def build_random_llama(shape: str, dtype: str = "bfloat16", device: str = "cuda", seed: int = 0):
    """A random-weight LlamaForCausalLM of a real shape, built directly on `device` in `dtype`.
    Weights ~ N(0, 0.02) (norms 1): never zeros, which can time faster than real data."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if device == "cuda" and not torch.cuda.is_available():
        device = "cpu"
    cfg = LlamaConfig(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SHAPES[shape])
    old = torch.get_default_dtype()
    torch.set_default_dtype(DTYPES[dtype])
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.to(DTYPES[dtype]).eval()


def load_smollm2(dtype: str, device: str):
    """SmolLM2-135M-Instruct (RAYSD_SMOLLM2_GGUF, or the embedded default), dequantised in fp32,
    then cast (a GGUF loaded straight "in bf16" may keep packed weights and compute in fp32)."""
    from raysd.models.loading import DEFAULT_MODEL, ModelSpec, load_model

    name = os.environ.get("RAYSD_SMOLLM2_GGUF") or DEFAULT_MODEL
    return load_model(ModelSpec(name=name, dtype="float32", device=device)).to(DTYPES[dtype])


def truncated(model, layers: int):
    """A real-weights draft: the model's first `layers` decoder layers, its final norm and its
    head (a layer-skip self-draft; shares no storage with `model`)."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:layers]
    draft.config.num_hidden_layers = layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:layers]
    return draft.eval()


def load_named(name: str, dtype: str, device: str):
    """Any model raysd.models.loading knows (HF id, path, GGUF, a distilled draft)."""
    from raysd.models.loading import ModelSpec, load_model

    return load_model(ModelSpec(name=name, dtype=dtype, device=device))


def truncated_smollm2(layers: int, dtype: str, device: str):
    """Picklable factory body for the Ray draft actor (--pair smollm2)."""
    return truncated(load_smollm2(dtype, device), layers)


def ceilings(device: torch.device, reps: int = 10) -> dict:
    """The device's two ceilings, measured (METHOD.md): a bf16 8192^3 matrix product on random data
    (TFLOP/s) and a 1 GiB device-to-device copy (bytes read + written per second). CUDA only."""
    if device.type != "cuda":
        return {}
    n, x = 8192, torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    a = torch.randint(0, 256, (2**30,), device=device, dtype=torch.uint8)
    b = torch.empty_like(a)
    out = {}
    for name, work, call in (("bf16_tflops", 2 * n**3, lambda: x @ x), ("copy_tb_s", 2 * a.numel(), lambda: b.copy_(a))):
        for _ in range(3):
            call()
        timer = StepTimer(device)
        for _ in range(reps):
            with timer:
                call()
        out[name] = work / statistics.median(timer.samples) / 1e12
    return out


def floor_step_s(config, weight_bytes: int, element_size: int, batch: int, context: int, bandwidth_b_s: float) -> float:
    """The memory-bandwidth floor of one decode step: every weight read once, plus each row's keys and
    values over `context` tokens, at the measured copy bandwidth (bytes read + written: a read-only
    stream runs at about that rate)."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * kv_heads * head_dim * element_size * context * batch
    return (weight_bytes + kv) / bandwidth_b_s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Seconds of one region: CUDA events on a GPU (the region's span on the GPU's timeline, host
    launch gaps included), perf_counter after a synchronize elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.samples: list[float] = []

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self._end.record()
            self._end.synchronize()
            self.samples.append(self._start.elapsed_time(self._end) / 1e3)
        else:
            self.samples.append(time.perf_counter() - self._t0)

    @property
    def spread(self) -> float | None:
        """(p90 - p10) / median: the noise of this measurement."""
        if len(self.samples) < 3:
            return None
        qs = statistics.quantiles(self.samples, n=10)
        return (qs[-1] - qs[0]) / statistics.median(self.samples)


def time_forward(model, batch: int, context: int, width: int, reps: int, warmup: int, vocab: int, seed: int = 0,
                 runner_kind: str = "dynamic") -> dict:
    """Median seconds of one runner forward appending `width` tokens to each of `batch` rows holding
    `context` cached tokens, logits at all `width`. runner_kind: "static" (StaticRunner, the engine's
    default for Llama-family models), "dynamic" (HF DynamicCache), "graph" (the static step as a CUDA graph),
    "compiled-graph" (the static step through torch.compile, captured as a CUDA graph; the compile is the warm-up's)."""
    from raysd.models.dynamic_runner import DynamicRunner
    from raysd.models.static_runner import CudaGraphStep, StaticRunner

    runner = (DynamicRunner(model) if runner_kind == "dynamic"
              else StaticRunner(model, max_cache_len=context + 2 * width + 8, compile=runner_kind == "compiled-graph"))
    device = runner.device
    g = torch.Generator().manual_seed(seed)
    runner.add_rows(batch)
    prompt = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(batch, dtype=torch.int64, device=device))
    chunk = torch.randint(3, vocab, (batch, width), generator=g).to(device)
    valid = torch.ones_like(chunk, dtype=torch.bool)
    num = torch.full((batch,), width, dtype=torch.int64, device=device)
    back = torch.full((batch,), context, dtype=torch.int64, device=device)
    if runner_kind in ("graph", "compiled-graph"):
        step = CudaGraphStep(runner, width, width)
        call = lambda: step(chunk, valid, num)  # noqa: E731
    elif runner_kind == "static":
        call = lambda: runner.forward(chunk, valid, num, max_logits=width)  # noqa: E731
    else:
        call = lambda: runner.forward(chunk, valid, num)  # noqa: E731
    timer = StepTimer(device)
    for i in range(warmup + reps):
        if i == warmup:
            timer.samples.clear()
        with timer:
            call()
        runner.rollback(back, context)  # untimed: back to `context` tokens
    runner = step = call = None  # the closures above hold it: release the cache before emptying CUDA's
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"median_s": statistics.median(timer.samples), "spread": timer.spread, "reps": reps, "runner": runner_kind}


def count_syncs(target, draft, V: int, k: int, batch: int, requests, device, graphs: bool = False) -> dict:
    """Host synchronisations per engine step (CUDA only): torch warns on each synchronising CUDA call
    under set_sync_debug_mode("warn"), counted inside each step (admission, prefill and the capture
    before the first step left out), over a short greedy generation. `graphs`: the engine's CUDA graphs
    (uncompiled), whose programs must add none."""
    from raysd.core.speculation import SpeculationConfig
    from raysd.engine.drafters import DraftModelDrafter, NoDrafter
    from raysd.engine.engine import EngineConfig, SpecEngine

    if device.type != "cuda":
        return {}
    out = {}
    for name, make in (("ar", lambda: NoDrafter(V, device)),
                       ("raysd", lambda: DraftModelDrafter(draft, V, cuda_graphs=graphs, compile=False))):
        speculation = SpeculationConfig(0 if name == "ar" else k)
        engine = SpecEngine(target, make(), EngineConfig(speculation, max_batch_size=batch, cuda_graphs=graphs, compile=False))
        engine.generate(requests(1))  # first calls (and, with graphs, the captures) not counted below
        per_step, step = [], engine.step

        def counted_step(step=step, per_step=per_step):
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    verdict = step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            per_step.append(sum("synchroniz" in str(w.message) for w in caught))
            return verdict

        engine.step = counted_step
        engine.generate(requests(16))
        out[name] = {"steps": len(per_step), "syncs_per_step": sum(per_step) / max(len(per_step), 1),
                     "max_syncs_in_a_step": max(per_step, default=0)}
    return out


KERNEL_KINDS = (  # substrings of a CUDA kernel's name, the first match naming its kind
    ("attention", ("fmha", "flash", "attention", "attn", "efficient")),
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "sm90_xmma", "sm80_xmma", "splitk", "matmul", "mm_")),
    ("copy", ("copy", "scatter", "gather", "index", "cat", "fill", "memset", "memcpy")),
    ("softmax/norm", ("softmax", "norm", "reduce")),
)


def kernel_times(model, batch: int, context: int, width: int, vocab: int, reps: int = 5) -> dict:
    """Where one forward's GPU time goes (CUDA only): `width` tokens per row appended to `batch` rows of
    `context` cached tokens through the static runner, eagerly (the kernels a graph replays; launch gaps
    aside), profiled over `reps` forwards. Returns milliseconds per forward by kind (KERNEL_KINDS, else
    "other"), the ten longest kernels, and the bytes the runner counts such a forward reading."""
    from torch.profiler import ProfilerActivity, profile

    from raysd.models.static_runner import StaticRunner

    if not torch.cuda.is_available():
        return {}
    runner = StaticRunner(model, max_cache_len=context + 2 * width + 8)
    device = runner.device
    g = torch.Generator().manual_seed(0)
    runner.add_rows(batch)
    prompt = torch.randint(3, vocab, (batch, context), generator=g).to(device)
    runner.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), torch.ones(batch, dtype=torch.int64, device=device))
    chunk = torch.randint(3, vocab, (batch, width), generator=g).to(device)
    valid, num = torch.ones_like(chunk, dtype=torch.bool), torch.full((batch,), width, dtype=torch.int64, device=device)
    back = torch.full((batch,), context, dtype=torch.int64, device=device)
    for _ in range(2):  # warm-up
        runner.forward(chunk, valid, num, max_logits=width)
        runner.rollback(back, context)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.forward(chunk, valid, num, max_logits=width)
            runner.rollback(back, context)
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if not us or e.key.startswith("ProfilerStep"):
            continue
        name = e.key.lower()
        kind = next((k for k, subs in KERNEL_KINDS if any(s in name for s in subs)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e3 / reps
        kernels.append((us / 1e3 / reps, e.key[:90]))
    attended = runner._attended(context + width)
    return {"ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])), "ms_total": sum(by_kind.values()),
            "top": [{"ms": round(ms, 4), "kernel": k} for ms, k in sorted(kernels, reverse=True)[:10]],
            "bytes_per_forward": runner.bytes_per_forward(batch, attended), "attended": attended}
