"""A tensor-parallel target (raysd.models.tensor_parallel) is exact: on 2 gloo ranks the sharded
tiny Llama, Qwen2 and Mistral give the whole model's logits (float32, to summation order), the
single-process engine's greedy tokens with a draft model, n-gram and suffix drafters, and its
sampled tokens under the same seeds (so the joint law of two tokens is the target's); SmolLM2-135M
on 3 ranks gives its greedy tokens; a split that does not divide fails in one line."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, MistralForCausalLM, Qwen2Config

from raysd.core.sampling import SamplingParams
from raysd.core.speculation import SpeculationConfig
from raysd.engine.drafters import DraftModelDrafter, NgramDrafter
from raysd.engine.engine import EngineConfig, SpecEngine
from raysd.engine.requests import Request
from raysd.engine.suffix import SuffixDrafter
from raysd.models.runner import make_runner
from raysd.models.tensor_parallel import RowParallelLinear, check_tensor_parallel, shard_model
from tests.conftest import EOS, VOCAB, tiny_model
from tests.engine.test_distribution_e2e import V as JOINT_V
from tests.engine.test_distribution_e2e import assert_first_two_tokens_follow_target, copyable_prompt
from tests.engine.test_equivalence import prompts
from tests.models.tp_helpers import run_ranks

ARCHS = ("llama", "qwen2", "mistral")
MAX_NEW = 16
JOINT_N = 3000  # requests sampled for the joint law (64 cells of ~47 expected counts)


def model_of(arch: str, seed: int = 0, layers: int = 2, vocab: int = VOCAB):
    """tiny_model's architectures, and a Mistral of the same shape (tiny_model has none)."""
    if arch != "mistral":
        return tiny_model(arch, seed, layers, vocab)
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    model = MistralForCausalLM(cfg)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = EOS, 0
    return model.eval()


def _engine_tokens(target, drafter, reqs, k: int = 4, batch: int = 4) -> list[list[int]]:
    speculation = SpeculationConfig(num_speculative_tokens=k, eos_token_ids=(EOS,))
    engine = SpecEngine(target, drafter, EngineConfig(speculation, max_batch_size=batch))
    return [r.token_ids for r in engine.generate(reqs)]


def scenarios(rank: int, world_size: int) -> dict:
    """Everything the exactness tests compare, for every architecture: run whole (world_size 1, in
    the test process) and on every rank of a group (run_ranks: rank 0's comes back)."""
    ps = prompts()
    greedy = [Request(i, p, SamplingParams(max_new_tokens=MAX_NEW)) for i, p in enumerate(ps)]
    sampled = [Request(i, p, SamplingParams(temperature=0.9, top_k=40, seed=100 + i, max_new_tokens=MAX_NEW))
               for i, p in enumerate(ps)]
    ids = torch.tensor([p[:5] for p in ps if len(p) >= 5])  # [B, 5]
    out = {}
    for arch in ARCHS:
        target = shard_model(model_of(arch), rank, world_size)
        r = {}
        with torch.inference_mode():
            r["logits"] = target(ids).logits  # [B, 5, V]: the stock Hugging Face forward
            for kernels in ("packed", "stock"):  # the packed CPU kernels pack the row-parallel inner linears too
                runner = make_runner(target, "static", linear_kernels=kernels)
                runner.add_rows(len(ids))
                n = torch.full((len(ids),), ids.shape[1], dtype=torch.int64)
                r[f"runner_{kernels}"] = runner.forward(ids, torch.ones_like(ids, dtype=torch.bool), n)  # [B, 5, V]
        draft = model_of(arch, seed=1, layers=1)
        r["draft_model"] = _engine_tokens(target, DraftModelDrafter(draft, VOCAB), greedy)
        r["ngram"] = _engine_tokens(target, NgramDrafter(VOCAB), greedy)
        r["suffix"] = _engine_tokens(target, SuffixDrafter(VOCAB), greedy, batch=2)
        r["sampled"] = _engine_tokens(target, DraftModelDrafter(draft, VOCAB), sampled)
        r["wrapped"] = sum(isinstance(m, RowParallelLinear) for m in target.modules())
        out[arch] = r
    return out


@pytest.fixture(scope="module")
def whole_and_sharded():
    return scenarios(0, 1), run_ranks(scenarios, 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_logits_are_the_whole_models(whole_and_sharded, arch):
    whole, sharded = (x[arch] for x in whole_and_sharded)
    assert whole["wrapped"] == 0 and sharded["wrapped"] == 2 * 2  # o_proj and down_proj of both layers
    for key in ("logits", "runner_packed", "runner_stock"):
        torch.testing.assert_close(sharded[key], whole[key], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole["runner_packed"], whole["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter", ["draft_model", "ngram", "suffix"])
def test_sharded_target_greedy_tokens_are_identical(whole_and_sharded, arch, drafter):
    whole, sharded = (x[arch] for x in whole_and_sharded)
    assert sharded[drafter] == whole[drafter]
    assert all(len(t) for t in whole[drafter])


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_target_samples_the_same_tokens_under_the_same_seeds(whole_and_sharded, arch):
    whole, sharded = (x[arch] for x in whole_and_sharded)
    assert sharded["sampled"] == whole["sampled"]
    assert whole["sampled"] != whole["draft_model"]  # really sampled, not greedy


def joint_law(rank: int, world_size: int) -> list[list[int]]:
    """The distribution test's setup (tests/engine/test_distribution_e2e.py) on a sharded target."""
    target = shard_model(tiny_model("llama", seed=11, vocab=JOINT_V), rank, world_size)
    draft = tiny_model("llama", seed=12, layers=1, vocab=JOINT_V)
    prompt = copyable_prompt(target)
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=2, ignore_eos=True)
    engine = SpecEngine(target, DraftModelDrafter(draft, JOINT_V), EngineConfig(SpeculationConfig(4), max_batch_size=1000))
    reqs = [Request(i, prompt, SamplingParams(**{**base.__dict__, "seed": 10_000 + i})) for i in range(JOINT_N)]
    return [r.token_ids for r in engine.generate(reqs)]


def test_joint_law_of_two_tokens_at_tp2():
    """Draws are keyed by (seed, tokens generated): the same seeds give TP = 2 exactly TP = 1's
    tokens (the strong form), and so the target's joint law of the first two tokens."""
    sharded = run_ranks(joint_law, 2)
    assert sharded == joint_law(0, 1)
    target = tiny_model("llama", seed=11, vocab=JOINT_V)
    base = SamplingParams(temperature=0.9, top_k=6, top_p=0.95, max_new_tokens=2, ignore_eos=True)

    class R:  # what assert_first_two_tokens_follow_target reads of a result
        def __init__(self, token_ids):
            self.token_ids = token_ids

    assert_first_two_tokens_follow_target([R(t) for t in sharded], target, copyable_prompt(target), base, length=2)


def test_a_split_that_does_not_divide_fails_in_one_line():
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    check_tensor_parallel(llama, 1)
    check_tensor_parallel(llama, 2)
    with pytest.raises(ValueError, match=r"^tensor parallel 3 does not divide the model's attention heads \(4\)$"):
        check_tensor_parallel(llama, 3)
    with pytest.raises(ValueError, match=r"key/value heads \(2\)$"):
        check_tensor_parallel(llama, 4)
    with pytest.raises(ValueError, match=r"intermediate size \(130\)$"):
        check_tensor_parallel(Qwen2Config(hidden_size=64, intermediate_size=130, num_attention_heads=4,
                                          num_key_value_heads=4), 4)
    with pytest.raises(ValueError, match=r"^tensor parallel supports .* not 'gpt2'$"):
        check_tensor_parallel(tiny_model("gpt2").config, 2)
    with pytest.raises(ValueError, match=">= 1"):
        check_tensor_parallel(llama, 0)
    with pytest.raises(ValueError, match="attention heads"):  # shard_model checks too, before touching a weight
        shard_model(tiny_model("llama"), 0, 3)
    # SmolLM2-135M (9 heads, 3 key/value heads, 1536 MLP columns) splits over 3, not 2
    smol = LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    check_tensor_parallel(smol, 3)
    with pytest.raises(ValueError, match=r"attention heads \(9\)"):
        check_tensor_parallel(smol, 2)


def smollm2_greedy(rank: int, world_size: int, threads: int = 1) -> list[list[int]]:
    from raysd.models.loading import ModelSpec, eos_token_ids, load_model, load_tokenizer
    from tests.engine.test_smollm2 import QUESTIONS

    torch.set_num_threads(threads)
    tok = load_tokenizer("smollm2-135m-instruct")
    model = shard_model(load_model(ModelSpec()), rank, world_size)
    ps = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS[:4]]
    ps = [p["input_ids"] if hasattr(p, "keys") else p for p in ps]
    speculation = SpeculationConfig(num_speculative_tokens=4, eos_token_ids=eos_token_ids(model))
    engine = SpecEngine(model, NgramDrafter(model.get_output_embeddings().weight.shape[0]),
                        EngineConfig(speculation, max_batch_size=4))
    return [r.token_ids for r in engine.generate([Request(i, p, SamplingParams(max_new_tokens=MAX_NEW))
                                                  for i, p in enumerate(ps)])]


@pytest.mark.slow
def test_smollm2_tp3_greedy_is_tp1s(smollm2):
    """The real model at TP = 3 (9 heads, 3 key/value heads: 3 and 1 per rank). `smollm2` loads it
    here first, so that the ranks read the converted weights rather than convert them at once."""
    sharded = run_ranks(smollm2_greedy, 3)
    assert sharded == smollm2_greedy(0, 1, threads=2)
    assert all(t for t in sharded)
