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


def count_syncs(target, draft, V: int, K: int, batch: int, requests, device) -> dict:
    """Host synchronisations per engine step (CUDA only): torch warns on each synchronising CUDA
    call under set_sync_debug_mode("warn"); counted over a short greedy generation."""
    from raysd.core.speculation import SpeculationConfig
    from raysd.engine.drafters import DraftModelDrafter, NoDrafter
    from raysd.engine.engine import EngineConfig, SpecEngine

    if device.type != "cuda":
        return {}
    out = {}
    for name, make in (("ar", lambda: NoDrafter(V, device)), ("raysd", lambda: DraftModelDrafter(draft, V, cuda_graphs=False))):
        k = 0 if name == "ar" else K
        engine = SpecEngine(target, make(), EngineConfig(SpeculationConfig(k), max_batch_size=batch, cuda_graphs=False))
        engine.generate(requests(1))  # admission and prefill syncs not counted below
        engine.timings.steps = 0
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.generate(requests(16))
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = sum("synchroniz" in str(w.message) for w in caught)
        out[name] = {"syncs": syncs, "steps": engine.timings.steps, "syncs_per_step_incl_prefill": syncs / max(engine.timings.steps, 1)}
    return out
