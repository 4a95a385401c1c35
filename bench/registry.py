"""The scenarios `python -m bench run NAME` knows: one entry each, here.

A scenario is a module under bench/scenarios/ with
    add_arguments(parser)   its options (the common ones, --quick --repeats --threads --out, are added for it)
    QUICK                   the option values --quick sets (a smoke run: seconds to a couple of minutes)
    run(args, log) -> bench.harness.Outcome
A preset is the same module under another name with other defaults (`defaults`, and `quick`
on top of the module's QUICK). To add a scenario: write its module, add one line below.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import ModuleType


@dataclass(frozen=True)
class Scenario:
    name: str
    module: str  # bench.scenarios.<module>
    summary: str
    defaults: dict = field(default_factory=dict)
    quick: dict = field(default_factory=dict)
    gpu: bool = False  # meant for a GPU (its --quick still runs on a CPU)

    def load(self) -> ModuleType:
        module = importlib.import_module(f"bench.scenarios.{self.module}")
        for attr in ("add_arguments", "QUICK", "run"):
            if not hasattr(module, attr):
                raise TypeError(f"scenario module {module.__name__} lacks {attr}")
        return module


SCENARIOS = {s.name: s for s in (
    Scenario("engine", "engine", "drafters (none, ngram, distilled draft, EAGLE), fixed K and auto, in the engine; "
                                 "against plain decoding and HF generate"),
    Scenario("adaptive", "engine", "auto K against every fixed K and plain decoding, batch 1 to 32",
             {"drafters": ["ngram"], "ks": [1, 2, 4, 8, "auto"], "batch_sizes": [1, 8, 32], "per_task": 6,
              "hf_batch_sizes": []}, {"ks": [1, 2, "auto"]}),
    Scenario("tree", "engine", "draft trees (fixed P, and chosen each step) against the chain, distilled draft",
             {"drafters": ["draft"], "ks": [4, "auto"], "auto_k_max": 4, "tree_budgets": [0, 4, 16], "batch_sizes": [1],
              "per_task": 2, "hf_batch_sizes": []}, {"tree_budgets": [0, 4], "batch_sizes": [1]}),
    Scenario("relaxed", "engine", "the relaxed acceptance dial (LOSSY) at T = 1: acceptance, alpha, tokens/s per LAMBDA",
             {"drafters": ["draft"], "ks": [4], "temperatures": [1.0], "batch_sizes": [12], "per_task": 2, "hf_batch_sizes": [],
              "acceptances": ["exact", "relaxed:0.1", "relaxed:0.25", "relaxed:0.5", "relaxed:0.75", "relaxed:1.0"]},
             {"acceptances": ["exact", "relaxed:0.5"], "batch_sizes": [6]}),
    Scenario("draft_assist", "engine", "three levels (n-gram -> draft -> target) against two (draft -> target)",
             {"drafters": ["draft", "draft+ngram"], "ks": [2, 4, "auto"], "temperatures": [0.0, 1.0], "batch_sizes": [6],
              "hf_batch_sizes": []}, {"ks": [4], "temperatures": [0.0], "batch_sizes": [3]}),
    Scenario("suffix", "engine", "the suffix drafter against plain decoding and n-gram lookup, on a dataset built "
                                 "from one template (--prompt-set repetitive) and on Spec-Bench (--prompt-set spec_bench)",
             {"drafters": ["ngram", "suffix"], "ks": ["auto"], "batch_sizes": [1, 8, 32], "prompt_set": "repetitive",
              "max_prompts": 200, "max_new_tokens": 64, "stop_at_eos": True, "hf_batch_sizes": [], "repeats": 1},
             {"max_prompts": 6, "batch_sizes": [2], "max_new_tokens": 8}),
    Scenario("beam", "beam", "speculative beam search (W = 4) against raysd's beam search without a drafter and HF "
                             "generate(num_beams=4), distilled draft and n-gram lookups"),
    Scenario("pipeline", "pipeline", "`raysd generate` (Ray Data) against the engine, and the actors alone"),
    Scenario("fast_step", "fast_step", "a target whose step takes milliseconds (as on a GPU): engine, actors and "
                                       "`raysd generate`, per-step overhead and fixed cost"),
    Scenario("verify_cost", "steps", "T(K+1)/T(1): one target pass over K + 1 tokens per row against one token"),
    Scenario("compile", "steps", "torch.compile of the static runner's step against the eager packed and stock kernels",
             {"sides": ["packed", "stock", "compiled"], "dtypes": ["float32"], "tokens": [1, 4], "reps": 15, "baseline": "side"}),
    Scenario("gpu", "gpu", "step costs, AR and speculative tokens/s, cost-model bounds (8B/1B shapes; --quick tiny on CPU)",
             gpu=True),
    Scenario("busy", "busy", "`raysd generate` (the quick start; a draft-model job) while busy processes hold every "
                             "core: every row written, no recovery"),
    Scenario("soak", "soak", "many rows through tiny random models via `raysd generate`: memory and throughput over time"),
    Scenario("draft_eval", "draft_eval", "offline acceptance of EAGLE and distilled drafts along held-out continuations"),
)}


def get(name: str) -> Scenario:
    try:
        return SCENARIOS[name]
    except KeyError:
        raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}") from None
