"""Shared fixtures: tiny random-weight models of the real architectures, built offline."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 96
EOS = 2

@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """scripts/test.sh runs the `alone` tests under `--dist loadgroup`: a test module is one group, as
    under loadfile (its tests share its Ray or cluster), unless its tests name a group of their own.
    The tests that start Rays or clusters of their own mid-test are the group "own-rays": they run one
    after another, since with two of them at once on 2 cores a raylet missed Ray's fixed 30 s to register."""
    for item in items:
        if item.get_closest_marker("alone") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


# Hypothesis profiles. "ci" is derandomised: the examples are a fixed function of each test, so a
# CI run cannot pass or fail by chance (and --hypothesis-seed has no effect there). It is chosen
# whenever the CI environment variable is set to any value (`.ci/run` runs with CI=true) or
# Hypothesis detects a CI by itself. Elsewhere "dev" draws fresh random examples each run, and
# `--hypothesis-profile=explore` draws many more; `--hypothesis-seed=S` replays a run.
# Tests that pin max_examples keep their count under ci and dev.
_default = settings.get_profile("default")
settings.register_profile("ci", _default, max_examples=100, derandomize=True, deadline=None, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", _default, deadline=None, print_blob=True)
settings.register_profile("explore", _default, max_examples=5000, deadline=None, print_blob=True)
_ci = "CI" in os.environ or getattr(settings, "get_current_profile_name", lambda: None)() == "ci"
settings.load_profile("ci" if _ci else "dev")  # --hypothesis-profile, if given, is loaded after this


def tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2, vocab: int = VOCAB):
    """A small random model whose logits are spread enough that fp32 argmax has no near-ties."""
    torch.manual_seed(seed)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
        model = LlamaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
        model = Qwen2ForCausalLM(cfg)
    elif arch == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, n_positions=512,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
        model = GPT2LMHeadModel(cfg)
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model.eval()


def tiny_eagle(target_seed: int = 0, seed: int = 0, vocab: int = VOCAB):
    """An untrained EAGLE feature draft for tiny_model("llama", target_seed): weak, but real."""
    from raysd.models.eagle_draft import EagleDraft

    return EagleDraft.from_target(tiny_model("llama", target_seed, vocab=vocab), init_layer=-1, seed=seed)


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny models are all per-op overhead; extra threads only oversubscribe the 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fresh_cache_dir(path):
    """`path` made a raysd cache directory (RAYSD_CACHE_DIR) with no step-cost profiles, whose
    GGUF conversions are the machine's own: its `gguf` is a link to the cache in force now. A test
    that points RAYSD_CACHE_DIR at it measures its profiles afresh, but the embedded model is not
    converted again (seconds of CPU) in every test process and model actor that loads it."""
    from raysd.models.gguf_cache import cache_root

    machine = cache_root() / "gguf"
    machine.mkdir(parents=True, exist_ok=True)
    (path / "gguf").symlink_to(machine.resolve(), target_is_directory=True)
    return path


@pytest.fixture(scope="session")
def shared_ray(tmp_path_factory):
    """One local Ray for the whole session, started by the first module that asks for it and
    shared by every later one (a Ray start and shutdown cost seconds per module). A module that
    needs a Ray of its own (a multi-node cluster, other settings) shuts this one down; the next
    module that asks starts it again. Replicas with a draft model cache step costs in
    RAYSD_CACHE_DIR: a fresh directory (`fresh_cache_dir`), set before Ray starts so that its
    workers inherit it."""
    import ray

    from raysd.actors.local import start_local_ray

    def ensure() -> None:
        if not ray.is_initialized():
            os.environ.setdefault("RAYSD_CACHE_DIR", str(fresh_cache_dir(tmp_path_factory.mktemp("raysd-cache"))))
            # address="local" (start_local_ray): a fresh Ray even when /tmp/ray records a stale
            # `ray start` head, which a plain ray.init(num_cpus=...) would try to join (and fail).
            start_local_ray(num_cpus=6, log_to_driver=False, configure_logging=False)

    yield ensure
    if ray.is_initialized():
        ray.shutdown()


def own_ray(**init_kwargs) -> None:
    """A local Ray of the caller's own settings (start_local_ray's arguments): the session's
    shared one, if up, is shut down first (the next module that asks for it starts it again)."""
    import ray

    from raysd.actors.local import start_local_ray

    if ray.is_initialized():
        ray.shutdown()
    start_local_ray(log_to_driver=False, configure_logging=False, **init_kwargs)


@pytest.fixture(scope="module")
def local_ray(shared_ray):
    """The session's local Ray (`shared_ray`), running for the module that asks for it."""
    shared_ray()
    yield


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default target (fp32), loaded once per test session."""
    from raysd.models.loading import ModelSpec, load_model, load_tokenizer

    return load_model(ModelSpec()), load_tokenizer("smollm2-135m-instruct")
