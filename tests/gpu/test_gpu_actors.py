"""The Ray pipeline on one GPU: draft and target actors with
num_gpus=0.5 each share the device; models in bf16 (and fp32 for the exact check).

* One micro-batch as wide as the engine's batch makes the same batches, in the same
  order, with the same kernels as the in-process engine on the same GPU: the tokens must
  be identical, bit for bit (cuBLAS is deterministic for a given shape and GPU).
* Two micro-batches make other batch shapes: fp32 tokens equal HF's exactly; bf16 tokens
  equal HF bf16 greedy up to the first near-tie (gpu_helpers).
* Seeded sampling through the actors equals the engine's.

Skipped without CUDA (see conftest); RAYSD_GPU_TESTS_ON_CPU=1 dry-runs them on the CPU
with num_gpus=0.
"""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")

import tests.conftest as conftest  # noqa: E402
import tests.gpu.gpu_helpers as gpu_helpers  # noqa: E402
from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator  # noqa: E402
from raysd.core.sampling import SamplingParams  # noqa: E402
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter  # noqa: E402
from raysd.engine.engine import EngineConfig, SpecEngine  # noqa: E402
from raysd.engine.requests import Request  # noqa: E402
from tests.conftest import EOS, VOCAB, own_ray  # noqa: E402
from tests.gpu.gpu_helpers import DEVICE, check_greedy_close, hf_greedy, tiny_factory, tiny_on_device  # noqa: E402

ray.cloudpickle.register_pickle_by_value(conftest)
ray.cloudpickle.register_pickle_by_value(gpu_helpers)

GPU_SHARE = 0.5 if DEVICE.type == "cuda" else 0.0
RES = ActorResources(num_cpus=1, num_gpus=GPU_SHARE)
K, MAX_NEW = 4, 16


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    # 8 CPUs where there is a GPU: Ray starts at most num_cpus worker processes at once, and with fewer the
    # last test's step-graph proxy can wait past its 60 s for a worker
    own_ray(num_cpus=8 if DEVICE.type == "cuda" else 4, num_gpus=1 if DEVICE.type == "cuda" else 0)
    yield
    ray.shutdown()


def prompts(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 11, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]


def requests(ps, **params):
    return [Request(i, p, SamplingParams(**{"seed": i, "max_new_tokens": MAX_NEW, **params})) for i, p in enumerate(ps)]


def coordinator(dtype, micro_batch_size, num_micro_batches, shape="split"):
    """Both models on the one GPU: in one actor (colocated) or an actor each sharing it (split)."""
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    cfg = CoordinatorConfig(speculation, micro_batch_size=micro_batch_size, num_micro_batches=num_micro_batches, draft_resources=RES, target_resources=RES)
    draft = DrafterSpec(tiny_factory("llama", 1, layers=1, dtype=dtype), shape=shape)
    return SpecCoordinator(tiny_factory("llama", 0, dtype=dtype), draft, cfg)


def engine_tokens(dtype, batch, reqs):
    target = tiny_on_device("llama", 0, dtype=dtype)
    draft = tiny_on_device("llama", 1, layers=1, dtype=dtype)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    engine = SpecEngine(target, DraftModelDrafter(draft, VOCAB), EngineConfig(speculation, max_batch_size=batch))
    return [r.token_ids for r in engine.generate(reqs)]


@pytest.mark.parametrize("shape", ["colocated", "split"])
def test_actors_are_on_the_gpu(shape):
    """Both models on the GPU: one process for both (colocated, the default when they share one
    GPU), or an actor each (split)."""
    with coordinator(torch.bfloat16, 4, 2 if shape == "split" else 1, shape) as c:
        assert c.shape == shape
        assert c.target_info.device.startswith(DEVICE.type) and c.draft_info.device.startswith(DEVICE.type)
        assert (c.target_info.pid == c.draft_info.pid) == (shape == "colocated")


@pytest.mark.parametrize("shape", ["colocated", "split"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_micro_batch_is_bitwise_the_engine(dtype, shape):
    reqs = requests(prompts())
    with coordinator(dtype, 4, 1, shape) as c:
        out = c.generate(reqs)
    assert [r.token_ids for r in out.results] == engine_tokens(dtype, 4, reqs)


def test_two_micro_batches_fp32_equal_hf_exactly():
    reqs = requests(prompts(seed=1))
    target = tiny_on_device("llama", 0, dtype=torch.float32)
    with coordinator(torch.float32, 3, 2) as c:
        out = c.generate(reqs)
    assert [r.token_ids for r in out.results] == [hf_greedy(target, list(r.prompt_token_ids), MAX_NEW) for r in reqs]
    assert out.stats.steps > 0 and out.transfer.sparse_steps == out.transfer.steps


def test_two_micro_batches_bf16_equal_hf_up_to_near_ties():
    reqs = requests(prompts(seed=2))
    target = tiny_on_device("llama", 0, dtype=torch.bfloat16)
    with coordinator(torch.bfloat16, 3, 2) as c:
        out = c.generate(reqs)
    ps = [list(r.prompt_token_ids) for r in reqs]
    check_greedy_close(target, ps, [r.token_ids for r in out.results], [hf_greedy(target, p, MAX_NEW) for p in ps])
    print("overlap efficiency on one GPU:", out.stats.overlap_efficiency)


@pytest.mark.parametrize("shape", ["colocated", "split"])
def test_seeded_sampling_through_actors_equals_engine(shape):
    reqs = requests(prompts(8, seed=3), temperature=0.8, top_k=20, top_p=0.9)
    with coordinator(torch.bfloat16, 4, 1, shape) as c:
        out = c.generate(reqs)
    assert [r.token_ids for r in out.results] == engine_tokens(torch.bfloat16, 4, reqs)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU (the CPU refusal: tests/jobs/test_options.py)")
@pytest.mark.parametrize("shape", ["colocated", "split"])
def test_cuda_graphs_through_the_actors_equal_hf_greedy(shape):
    """CoordinatorConfig(cuda_graphs) and DrafterSpec(cuda_graphs), as `raysd generate --cuda-graphs`
    sets them: the target's and the draft's small forwards replayed as CUDA graphs inside the actors.
    fp32: tokens equal HF's greedy exactly (TF32 off: tests/gpu/conftest.py)."""
    reqs = requests(prompts(seed=4))
    target = tiny_on_device("llama", 0, dtype=torch.float32)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,))
    cfg = CoordinatorConfig(speculation, micro_batch_size=3, num_micro_batches=2 if shape == "split" else 1,
                            draft_resources=RES, target_resources=RES, cuda_graphs=True)
    draft = DrafterSpec(tiny_factory("llama", 1, layers=1, dtype=torch.float32), cuda_graphs=True, shape=shape)
    with SpecCoordinator(tiny_factory("llama", 0, dtype=torch.float32), draft, cfg) as c:
        out = c.generate(reqs)
    assert [r.token_ids for r in out.results] == [hf_greedy(target, list(r.prompt_token_ids), MAX_NEW) for r in reqs]


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs CUDA itself (CUDA graphs)")
@pytest.mark.parametrize("shape", ["colocated", "split"])
def test_a_replica_under_a_job_bound_captures_before_its_first_step(shape):
    """With CUDA graphs and a job's bound on a row's tokens (max_model_len), the actors capture every
    program as a micro-batch starts (StepCall.capture): over rows finishing and refilling under -k
    auto the target runs no forward eagerly, and fp32 greedy tokens equal HF's
    (tests/engine/test_graphed_steps.py runs the same with the CPU's stand-in capture)."""
    from raysd.core.speculation import AdaptiveConfig

    ps = prompts(16, seed=4)
    speculation = SpeculationConfig(num_speculative_tokens=K, eos_token_ids=(EOS,), adaptive=AdaptiveConfig(),
                                    max_model_len=max(len(p) for p in ps) + MAX_NEW)
    cfg = CoordinatorConfig(speculation, micro_batch_size=4, num_micro_batches=1 if shape == "colocated" else 2,
                            runner="static", cuda_graphs=True, draft_resources=RES, target_resources=RES)
    draft = DrafterSpec(tiny_factory("llama", 1, layers=1, dtype=torch.float32), runner="static", cuda_graphs=True,
                        shape=shape)
    with SpecCoordinator(tiny_factory("llama", 0, dtype=torch.float32), draft, cfg) as c:
        out = c.generate(requests(ps))
    target = tiny_on_device("llama", 0, dtype=torch.float32)
    assert [r.token_ids for r in out.results] == [hf_greedy(target, p, MAX_NEW) for p in ps]
    assert out.stats.graph_captures > 0 and out.stats.eager_forwards == 0, out.stats
