"""A replica keeps its micro-batches full across Ray Data blocks, and the job says where
its time goes (seconds per stage, engine occupancy) in the summary and the progress line."""

from __future__ import annotations

import json

import pytest

from raysd.core.sampling import SamplingParams
from raysd.jobs import GenerateConfig, generate
from raysd.engine.verdict import LoopStats
from raysd.jobs.pipeline import STAGE_SECONDS, breakdown_text, time_breakdown
from raysd.jobs.runner import progress_text
from tests.jobs.conftest import token_prompts

STAGES = [name for name, _ in STAGE_SECONDS]


def test_breakdown_is_a_view_of_the_replicas_loop_stats():
    """The summary's time_breakdown reads the replicas' summed LoopStats (and the read and write
    tasks' seconds): a field's name is its entry's, `_s` dropped."""
    loop = LoopStats(start_s=4.0, tokenize_s=0.25, queue_wait_s=3.0, draft_s=1.0, verify_s=9.0, detokenize_s=0.2,
                     engine_loop_s=9.5, engine_idle_s=0.1, active_rows=90, slot_steps=100, steps=25, drafted_steps=5)
    totals = {"read_s": 0.5, "write_s": 0.3, "loop": loop}
    assert STAGES == ["start", "read", "tokenize", "queue_wait", "draft", "verify", "detokenize", "write"]
    got = time_breakdown(totals)
    assert got == {"start": 4.0, "read": 0.5, "tokenize": 0.25, "queue_wait": 3.0, "draft": 1.0, "verify": 9.0, "detokenize": 0.2,
                   "write": 0.3, "engine_loop": 9.5, "engine_idle": 0.1, "occupancy": 0.9, "drafted_steps": 0.2}
    assert time_breakdown({})["occupancy"] is None and time_breakdown({})["drafted_steps"] is None
    assert breakdown_text(totals) == ("; occupancy 0.90; s: start 4.0 read 0.5 tokenize 0.2 queue_wait 3.0 draft 1.0 verify 9.0 "
                                      "detokenize 0.2 write 0.3")
    assert breakdown_text({"rows_generated": 3}) == ""  # no engine step yet: the line as before
    line = progress_text({"rows_generated": 8, "rows_written": 4, "tokens": 100, **totals}, 20.0)
    assert line.startswith("raysd generate: 8 rows generated, 4 written, 0 already there; 5.0 tok/s, acceptance n/a; "
                           "occupancy 0.90; s: start 4.0 read 0.5"), line


@pytest.mark.slow
def test_replica_keeps_its_batch_full_across_blocks(tmp_path, model_dirs, local_ray):
    """Blocks of 4 rows mixing short and long rows: a replica that ran each block to its end would
    leave its 4 slots half empty while each block's long rows finish (occupancy about 0.5). The
    stream admits the next blocks' rows into freed slots. The tokens are still the engine's."""
    from tests.jobs.test_generate import reference

    target, _ = model_dirs
    n = 24
    prompts = token_prompts(n, seed=12)
    budgets = [2 if i % 2 else 40 for i in range(n)]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": b}) + "\n" for p, b in zip(prompts, budgets)))
    cfg = GenerateConfig(input=str(inp), output=str(tmp_path / "out"), target=target, draft="ngram", max_new_tokens=8,
                         batch_size=4, rows_per_file=8, quiet=True)
    summary = generate(cfg)
    assert summary.rows == n and summary.rows_failed == 0
    run = summary.latest_run
    tb = run.time_breakdown
    print("occupancy", run.occupancy, tb)
    assert set(tb) == {*STAGES, "wall", "engine_loop", "engine_idle", "occupancy", "drafted_steps"} and tb["occupancy"] == run.occupancy
    # The wall as consecutive phases: they add up to the run's wall, nothing left out.
    phases = tb["wall"]
    assert list(phases) == ["check", "ray_start", "pipeline_start", "generating", "pipeline_end", "shutdown", "summary"]
    assert sum(phases.values()) == pytest.approx(run.wall_s, abs=0.01) and phases["generating"] > 0
    assert tb["engine_loop"] >= tb["verify"]  # the loop waits for every step it runs
    assert run.occupancy > 0.6
    assert tb["verify"] > 0 and tb["draft"] > 0 and tb["read"] > 0 and tb["write"] > 0 and tb["queue_wait"] > 0
    written = json.loads((tmp_path / "out" / "_summary.json").read_text())
    assert written["latest_run"]["time_breakdown"] == tb and written["latest_run"]["occupancy"] == run.occupancy

    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out").to_pylist()
    expected = reference(target, "ngram", prompts, [SamplingParams(max_new_tokens=b) for b in budgets])
    got = {r["id"]: r for r in rows}
    assert sorted(got) == list(range(n))
    assert [got[i]["generated_token_ids"] for i in range(n)] == expected
    assert all(r["latency_s"] > 0 for r in rows)  # each row's own time, from submission to its result


def test_generation_blocks_hold_a_whole_batch_whatever_the_input_blocks(local_ray):
    """Input blocks of 4-5 rows, batch size 8: the generation stage gets blocks of exactly 8 rows
    (the last one excepted), in input order. Ray's best-effort default leaves a short block per
    input block, and a replica fed short blocks ran with empty slots."""
    import ray

    from raysd.jobs.pipeline import batch_blocks
    from raysd.jobs.runner import _data_context

    sizes, order = [], []
    with _data_context(quiet=True):  # the job's settings: blocks in input order
        ds = batch_blocks(ray.data.range(37, override_num_blocks=8), 8)  # blocks of 4-5 rows in
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):  # one batch per block
            sizes.append(batch.num_rows)
            order.extend(batch.column("id").to_pylist())
    assert sizes == [8, 8, 8, 8, 5], sizes
    assert order == list(range(37))


@pytest.mark.slow
def test_removing_a_replicas_placement_group_ends_its_model_actors_for_good(local_ray):
    """The job's end removes its replicas' placement groups (release_job). A group's removal kills
    its actors, but a model actor (max_restarts) would restart into a group that is gone and stay
    RESTARTING, and a replica still tearing its step graph down waits on it, spinning a core until
    the session ends. So the actors are killed for good first: dead, not restarting."""
    import time

    from ray._private.state import actors

    from raysd.actors import ActorResources, CoordinatorConfig, DrafterSpec, SpecCoordinator
    from raysd.core.speculation import SpeculationConfig
    from raysd.jobs.pipeline import remove_placement_groups
    from tests.actors.actor_helpers import factory, random_prompts, requests
    from tests.conftest import EOS
    from tests.reliability.chaos import wait_until

    cpu = ActorResources(num_cpus=1, num_gpus=0)
    cfg = CoordinatorConfig(SpeculationConfig(num_speculative_tokens=2, eos_token_ids=(EOS,)), micro_batch_size=2,
                            draft_resources=cpu, target_resources=cpu)
    coordinator = SpecCoordinator(factory("llama", 0), DrafterSpec(factory("llama", 1), shape="split"), cfg)  # two actors
    try:
        coordinator.generate(requests(random_prompts(2, seed=1), max_new_tokens=3))  # its step graph runs
        ids = [coordinator.target._actor_id.hex(), coordinator.draft._actor_id.hex()]
        assert [actors(i)["State"] for i in ids] == ["ALIVE", "ALIVE"]
        remove_placement_groups([coordinator.placement_group.id.hex()])
        wait_until(lambda: all(actors(i)["State"] == "DEAD" for i in ids), "the model actors' death", timeout=30)
        time.sleep(1.0)
        assert [actors(i)["State"] for i in ids] == ["DEAD", "DEAD"]  # dead, not restarting
    finally:
        coordinator.shutdown()
