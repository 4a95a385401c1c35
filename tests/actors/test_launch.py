"""The model actors' Ray classes (raysd.actors.launch) host the workers of raysd.actors.model_actors:
every method of those is one of theirs, and a job's actors build themselves as the coordinator
would have built them."""

from __future__ import annotations

import inspect
import pickle

from raysd.actors import launch, model_actors
from raysd.actors.launch import draft_build, target_build
from raysd.jobs import GenerateConfig
from raysd.jobs.replica import replica_parts


def _methods(cls) -> dict[str, list[str]]:
    """Public methods and their parameters (less the one Ray adds once it has made the class an actor's)."""
    return {name: [p for p in inspect.signature(f).parameters if p != "_ray_trace_ctx"]
            for name, f in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def test_the_hosts_have_every_method_of_the_actors_with_their_parameters():
    for host, worker in ((launch.TargetActor, model_actors.TargetWorker), (launch.DraftActor, model_actors.DraftWorker)):
        assert _methods(host) == _methods(worker), host.__name__
    # Ray shows the hosts' names (ray::TargetActor); the chaos tests and the soak look processes up by them
    assert (launch.TargetActor.__name__, launch.DraftActor.__name__) == ("TargetActor", "DraftActor")


def test_a_jobs_actors_build_themselves_from_what_its_coordinator_gets():
    """A replica starts its actors ahead: job_target_actor and job_draft_actor build them in their
    own processes (again on a restart) from the job's config, through `replica_parts`, on which the
    replica then makes its coordinator. So `replica_parts` must give the same arguments in every
    process: equal pickles."""
    for draft, stop in (("none", False), ("ngram", True), ("smollm2-135m-instruct-draft", False)):
        cfg = GenerateConfig(input="in.jsonl", output="out", draft=draft, stop=("\n",) if stop else ()).resolve_actor_cpus(2)
        target_factory, drafter, ccfg, tokenizer_factory = replica_parts(cfg, stop)
        again = replica_parts(cfg, stop)
        assert pickle.dumps(target_build(target_factory, drafter, ccfg, tokenizer_factory)) == pickle.dumps(target_build(*again))
        assert pickle.dumps(draft_build(drafter, ccfg)) == pickle.dumps(draft_build(again[1], again[2]))
        assert (tokenizer_factory is not None) == stop
        assert cfg.shape == "colocated"  # on this machine's CPUs every drafter runs in the target's actor
        assert drafter.shape_for(ccfg.target_resources.num_gpus, ccfg.draft_resources.num_gpus) == "colocated"


def test_model_work_runs_in_a_thread_that_ends_with_it():
    """`in_passing_thread`: the value or the exception of the call, from a thread other than the
    caller's that is gone once it returns (its OpenMP pool with it)."""
    import threading

    import pytest

    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x + 1

    assert launch.in_passing_thread(work, 41) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ZeroDivisionError):
        launch.in_passing_thread(lambda: 1 / 0)
