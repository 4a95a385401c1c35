"""The Ray Data actors that only move rows import no torch: the id stage's actor and a replica's
actor unpickle their classes from raysd.jobs.pipeline, and a job's config is checked from names
alone (raysd.models.names, raysd.core.speculation). torch and transformers take seconds to
import, paid before the actor's constructor runs."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import raysd.jobs
import raysd.jobs.pipeline
from raysd.jobs import GenerateConfig
for draft in ("ngram", "none", "smollm2-135m-instruct-draft", "smollm2-135m-instruct-eagle"):
    cfg = GenerateConfig(input="in.jsonl", output="out", draft=draft, acceptance="relaxed:0.5").resolve_actor_cpus(2)
    assert cfg.draft_is_model == (draft not in ("ngram", "none")), draft
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(",".join(heavy) or "light")
"""


def test_pipeline_module_and_config_check_import_no_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "light", out.stdout


REPLICA = """
import pickle, sys
import raysd.actors, raysd.actors.coordinator, raysd.engine.adaptive, raysd.jobs.replica
from raysd.actors.launch import draft_build, target_build
from raysd.jobs import GenerateConfig
from raysd.jobs.replica import replica_parts
for draft in ("none", "suffix", "smollm2-135m-instruct-draft", "smollm2-135m-instruct-eagle"):
    cfg = GenerateConfig(input="in.jsonl", output="out", draft=draft).resolve_actor_cpus(2)
    target_factory, drafter, ccfg, tokenizer_factory = replica_parts(cfg, True)
    pickle.dumps((target_build(target_factory, drafter, ccfg, tokenizer_factory), draft_build(drafter, ccfg)))
received = pickle.loads(sys.stdin.buffer.read())
assert received[0].finished and received[0].logprobs is not None, received[0]
print(",".join(m for m in ("torch", "transformers") if m in sys.modules) or "light")
"""


def test_a_replica_process_imports_no_torch():
    """A replica's process runs the coordinator loop: it builds its actors' configs, starts them,
    and reads what they send back (raysd.actors.wire, raysd.engine.verdict: plain records), so
    it imports neither torch nor transformers (seconds of CPU at every job's start) unless the
    target's tokenizer needs them (transformers' tokenizers import torch). The records here are what model actors in process send for a step that finishes a row with its
    log-probabilities."""
    import dataclasses
    import functools
    import pickle

    from raysd.actors.model_actors import DrafterSpec, DraftWorker, StepCall, TargetWorker
    from raysd.core.params import SamplingParams
    from raysd.core.speculation import SpeculationConfig
    from raysd.engine.requests import Admission, Request
    from tests.conftest import VOCAB, tiny_model

    draft = DraftWorker(DrafterSpec(functools.partial(tiny_model, "llama", 1, 1)), VOCAB)
    target = TargetWorker(functools.partial(tiny_model, "llama", 0))
    spec = SpeculationConfig(num_speculative_tokens=2)
    call = StepCall(0, Admission.of(spec, VOCAB, [512]).spec, None,
                    ((0, Request(0, [5, 6, 7], SamplingParams(max_new_tokens=1, logprobs=True))),))
    verdict, timings = target.step(dataclasses.replace(call, verdict=None), draft.propose(call))
    blob = pickle.dumps((verdict, timings, target.info(), draft.info()))
    out = subprocess.run([sys.executable, "-c", REPLICA], input=blob, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert out.stdout.decode().strip() == "light", out.stdout


DRIVER = """
import sys
import raysd.actors.local, raysd.jobs.runner, raysd.jobs.pipeline
print(",".join(m for m in ("torch", "transformers") if m in sys.modules) or "light")
"""


def test_a_jobs_driver_imports_no_torch():
    """A job's driver starts Ray (raysd.actors.local) and runs Ray Data: no model, no torch. The
    package raysd.actors loads its coordinator only when one of its names is used, so starting
    Ray does not import torch and transformers first (a second of CPU before Ray starts)."""
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "light", out.stdout


CHECK_JOB = """
import json, sys
from raysd.jobs import GenerateConfig
from raysd.jobs.runner import check_job
for draft in ("none", "smollm2-135m-instruct-draft", "smollm2-135m-instruct-eagle"):
    check_job(GenerateConfig(input=sys.argv[1], output=sys.argv[2] + "/" + draft.split("-")[-1], draft=draft))
print(",".join(m for m in ("torch", "transformers") if m in sys.modules) or "light")
"""


def test_a_jobs_check_imports_no_torch(tmp_path):
    """The driver checks a job (its input, its output, its models by name, its drafts' own config
    files) before Ray starts, with no model and no torch (raysd.models.draft_files reads the
    drafts' configs)."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "hello"}\n')
    out = subprocess.run([sys.executable, "-c", CHECK_JOB, str(tmp_path / "in.jsonl"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "light", out.stdout


def test_names_agree_with_the_loaders():
    from raysd.models import eagle_draft, layer_draft, loading, names

    assert tuple(layer_draft.TORCH_DTYPES) == names.DTYPE_NAMES
    assert eagle_draft.CONFIG_FILE == names.EAGLE_CONFIG_FILE and layer_draft.CONFIG_FILE == names.DRAFT_CONFIG_FILE
    assert loading.draft_kind is names.draft_kind
    assert [names.draft_kind(n) for n in ("none", "ngram", loading.DEFAULT_DRAFT, loading.DEFAULT_EAGLE, "some/model")] == \
        ["none", "ngram", "layers", "eagle", "model"]


START_AHEAD = """
import functools, pickle, sys
from raysd.actors.launch import DraftActor, TargetActor, start_model_actors
from raysd.jobs import GenerateConfig
from raysd.jobs.replica import actor_resources, job_draft_actor, job_target_actor
for draft in ("none", "smollm2-135m-instruct-draft"):
    cfg = GenerateConfig(input="in.jsonl", output="out", draft=draft).resolve_actor_cpus(2)
    resources = actor_resources(cfg)
    pickle.dumps((TargetActor, DraftActor, functools.partial(job_target_actor, cfg, True), functools.partial(job_draft_actor, cfg)))
print(",".join(m for m in ("torch", "transformers") if m in sys.modules) or "light")
"""


def test_a_replica_starts_its_model_actors_before_it_imports_torch():
    """What a replica needs to start its model actors (raysd.actors.launch: the placement group,
    the actors' Ray classes, their resources and how each builds itself from the job's config)
    imports no torch, so the actors import theirs and load their models while the replica imports
    its own, off the path to the first token."""
    out = subprocess.run([sys.executable, "-c", START_AHEAD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "light", out.stdout
