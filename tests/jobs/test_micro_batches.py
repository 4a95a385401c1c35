"""A replica's settings are decided before its actors start and never change (raysd.jobs.replica.
replica_parts): its shape sets its micro-batches (one in a colocated replica, two in a split one),
and its EOS ids are the ones the target's actor reads from the loaded model. The tokens through
the replica are the single-process engine's either way."""

from __future__ import annotations

import pytest

from raysd.core.sampling import SamplingParams
from raysd.jobs.config import GenerateConfig
from raysd.jobs.replica import GenerationReplica, replica_parts, with_eos_ids
from tests.conftest import EOS
from tests.jobs.conftest import token_prompts
from tests.jobs.test_generate import reference

pytestmark = pytest.mark.slow

BATCH = 8


@pytest.mark.parametrize("shape, micro_batches", [("colocated", 1), ("split", 2)])
def test_the_shape_decides_the_micro_batches_before_the_actors_start(shape, micro_batches, tmp_path, model_dirs, local_ray):
    target, draft = model_dirs
    prompts = token_prompts(10, seed=4)
    cfg = GenerateConfig(input=str(tmp_path), output=str(tmp_path / "out"), target=target, draft=draft,
                         max_new_tokens=6, batch_size=BATCH, quiet=True, replica_shape=shape)
    planned = replica_parts(with_eos_ids(cfg), stop_strings=False)[2]
    replica = GenerationReplica(cfg)
    try:
        c = replica.coordinator
        assert c.shape == shape and (c.draft is None) == (shape == "colocated")
        assert c.config == planned  # what was decided before the start, unchanged
        assert (c.config.num_micro_batches, c.config.micro_batch_size) == (micro_batches, BATCH // micro_batches)
        # the EOS ids read from the target's files are the ones its actor read from the loaded model
        assert c.config.speculation.eos_token_ids == c.target_info.eos_token_ids == (EOS,)
        outputs, stats, _ = replica.generate([{"id": i, "prompt": p} for i, p in enumerate(prompts)])
        tokens = [o["generated_token_ids"] for [o] in outputs]  # one sample each
    finally:
        replica.shutdown()
    assert tokens == reference(target, draft, prompts, [SamplingParams(max_new_tokens=6)] * len(prompts))
    assert stats.steps > 0 and stats.slot_steps == stats.steps * BATCH
