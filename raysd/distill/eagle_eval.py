"""Offline acceptance of an EAGLE draft (and, for comparison, of any token-level draft) along the
target's own continuations of held-out prompts.

For every chain start n in a continuation (the target has just produced x_{n+1} from its feature f_n),
the draft drafts K steps exactly as a drafter does: step 1 from the target's feature f_n, steps 2..K from
its OWN previous hidden state, with the target's continuation as the tokens (the path on which every
earlier draft was accepted). At each step the expected acceptance of the rejection test is
1 - TV(target_probs, draft_probs) = sum_x min(target_probs, draft_probs) under the row's sampling parameters: at
temperature 0 both are one-hot (argmax agreement), at temperature 1 the full softmaxes (the draft's is
0 outside an FR-Spec head).

Per task it reports the acceptance at each draft step, alpha as the engine estimates it (overlap sum
over tested positions, a position tested only while every earlier draft of its chain was accepted), and
the expected number of accepted drafts per step with K drafts.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from raysd.distill.eagle_data import FeatureExample
from raysd.models.eagle_draft import final_norm
from raysd.distill.eagle_train import ttt_mask


def _overlap(target_row_logits: torch.Tensor, draft_row_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """sum_x min(target_probs, draft_probs) at `temperature` (0: whether the argmaxes agree)."""
    if temperature == 0:
        return (target_row_logits.argmax(-1) == draft_row_logits.argmax(-1)).float()
    target_probs = torch.softmax(target_row_logits.float() / temperature, dim=-1)
    draft_probs = torch.softmax(draft_row_logits.float() / temperature, dim=-1)
    return torch.minimum(target_probs, draft_probs).sum(-1)


@torch.no_grad()
def target_logits(target, ex: FeatureExample, rows: slice) -> torch.Tensor:
    """The target's logits at positions `rows` (from the recorded features; row m predicts x_{m+1})."""
    f = ex.features[rows].float().unsqueeze(0)
    return target.get_output_embeddings()(final_norm(target)(f))[0].float()


@torch.no_grad()
def eagle_chain_overlaps(draft, target, ex: FeatureExample, k: int, temperature: float) -> torch.Tensor:
    """[chains, k] expected acceptance of draft step j of the chain starting at n = P-1, P, ...; NaN past the end."""
    from transformers import DynamicCache

    R = ex.features.shape[0]  # rows 0..n-2
    P = ex.prompt_len
    first = P - 1
    chains = R - 1 - first  # chain start n needs f_{n+1}: n <= R - 2
    out = torch.full((max(chains, 0), k), float("nan"))
    if chains <= 0:
        return out
    feats = ex.features.float().unsqueeze(0)
    ids = torch.tensor(ex.input_ids, dtype=torch.int64)
    toks = ids[1:R + 1].unsqueeze(0)
    pos = torch.arange(R).unsqueeze(0)
    target_out = target_logits(target, ex, slice(first + 1, R))  # predicting x_{first+2} .. x_{R}
    cache = DynamicCache()
    h = None
    for j in range(1, k + 1):
        inp = feats if j == 1 else torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
        h = draft.hidden(inp, toks, position_ids=pos, past_key_values=cache, attention_mask=ttt_mask(R, j))
        # step j of chain n sits at row t = n + j - 1 and predicts x_{t+2}, target logits row t + 1
        rows = torch.arange(first + j - 1, R - 1)
        if rows.numel() == 0:
            break
        draft_out = draft.head(draft.norm(h[0, rows])).float()
        ov = _overlap(target_out[rows - first], draft_out, temperature)
        out[rows - (j - 1) - first, j - 1] = ov
    return out


@torch.no_grad()
def token_draft_chain_overlaps(draft, target, ex: FeatureExample, k: int, temperature: float) -> torch.Tensor:
    """The same table for a token-level draft (a causal LM): its prediction at a position does not depend
    on the chain, so step j of chain n is its prediction at position n + j (teacher-forced)."""
    R = ex.features.shape[0]
    P = ex.prompt_len
    first = P - 1
    chains = R - 1 - first
    out = torch.full((max(chains, 0), k), float("nan"))
    if chains <= 0:
        return out
    ids = torch.tensor([ex.input_ids[:R]])
    draft_out = draft(ids).logits[0].float()  # position m predicts x_{m+1}
    target_out = target_logits(target, ex, slice(first + 1, R))  # positions first+1 .. R-1
    ov = _overlap(target_out, draft_out[first + 1:R], temperature)  # position m = first + 1 + i
    for j in range(1, k + 1):
        # chain n, step j: position m = n + j, i = m - first - 1 = (n - first) + j - 1
        i = torch.arange(j - 1, ov.numel())
        out[i - (j - 1), j - 1] = ov[i]
    return out


def summarize(tables: Sequence[torch.Tensor], k: int) -> dict:
    """Per-step acceptance, the engine's alpha estimate and the expected accepted drafts per step for K = k."""
    t = torch.cat([x for x in tables if x.numel()], dim=0) if any(x.numel() for x in tables) else torch.zeros(0, k)
    per_step = [float(torch.nanmean(t[:, j])) if t.shape[0] else float("nan") for j in range(k)]
    full = t[~torch.isnan(t).any(dim=1)]
    if full.shape[0] == 0:
        return {"chains": 0, "alpha_by_step": per_step, "alpha": float("nan"), "mean_accepted": float("nan")}
    reach = torch.cumprod(torch.cat([torch.ones(full.shape[0], 1), full[:, :-1]], dim=1), dim=1)  # P(step j tested)
    alpha = float((reach * full).sum() / reach.sum())
    accepted = float(torch.cumprod(full, dim=1).sum(dim=1).mean())
    return {"chains": int(full.shape[0]), "alpha_by_step": per_step, "alpha": alpha, "mean_accepted": accepted}


def _timed_steps(fn, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


@torch.no_grad()
def step_cost(target, draft, context: Sequence[int], steps: int = 16, rounds: int = 7) -> dict:
    """Seconds of one target decode step and one EAGLE draft step at batch 1 after `context` (HF
    DynamicCache for both), interleaved rounds, fastest round kept; and their ratio c."""
    from transformers import DynamicCache

    from raysd.models.compat import cache_keyword
    from raysd.models.eagle_draft import crop_cache

    ids = torch.tensor([list(context)])
    L = ids.shape[1]
    tcache = DynamicCache()
    kw = cache_keyword(target)
    out = target(ids, **{kw: tcache}, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    dcache = DynamicCache()
    H = draft.config.hidden_size
    draft(torch.randn(1, L, H), ids, past_key_values=dcache)
    feat = torch.randn(1, 1, H)

    def target_step():
        target(tok, **{kw: tcache}, use_cache=True, position_ids=torch.tensor([[L]]))
        crop_cache(tcache, L)

    def draft_step():
        draft(feat, tok, past_key_values=dcache, position_ids=torch.tensor([[L]]))
        crop_cache(dcache, L)

    target_step(), draft_step()
    best_t = best_d = float("inf")
    for _ in range(rounds):
        best_t = min(best_t, _timed_steps(target_step, steps))
        best_d = min(best_d, _timed_steps(draft_step, steps))
    return {"target_step_s": best_t, "draft_step_s": best_d, "draft_step_cost": best_d / best_t, "context_tokens": L,
            "threads": torch.get_num_threads()}


def evaluate_offline(target, drafts: dict, examples: Sequence[FeatureExample], k: int = 4,
                     log: Callable[[str], None] | None = None) -> dict:
    """{draft name: {temperature: {task: summary}}} for the examples (each generated at its own temperature).
    `drafts`: name -> ("eagle" | "tokens", model)."""
    report: dict = {}
    for name, (kind, model) in drafts.items():
        fn = eagle_chain_overlaps if kind == "eagle" else token_draft_chain_overlaps
        tables: dict = {}
        for ex in examples:
            tables.setdefault(ex.temperature, {}).setdefault(ex.task, []).append(fn(model, target, ex, k, ex.temperature))
        report[name] = {}
        for temp, by_task in sorted(tables.items()):
            summ = {task: summarize(ts, k) for task, ts in sorted(by_task.items())}
            alphas = [s["alpha"] for s in summ.values()]
            summ["mean_over_tasks"] = {"alpha": sum(alphas) / len(alphas),
                                       "alpha_step1": sum(s["alpha_by_step"][0] for s in summ.values()) / len(alphas),
                                       "mean_accepted": sum(s["mean_accepted"] for s in summ.values()) / len(alphas)}
            report[name][f"T={temp:g}"] = summ
            if log:
                log(f"{name} T={temp:g}: " + ", ".join(f"{t} {s['alpha']:.3f}" for t, s in summ.items() if t != "mean_over_tasks")
                    + f"; mean {summ['mean_over_tasks']['alpha']:.3f}")
    return report


def format_offline(report: dict, k: int) -> str:
    lines = []
    for name, by_temp in report.items():
        for temp, summ in by_temp.items():
            lines.append(f"**{name}, {temp}** (K = {k})")
            lines.append("")
            lines.append("| task | chains | alpha step 1 | alpha by step | alpha (engine estimate) | mean accepted per step |")
            lines.append("| --- | --- | --- | --- | --- | --- |")
            for task, s in summ.items():
                if task == "mean_over_tasks":
                    continue
                lines.append(f"| {task} | {s['chains']} | {s['alpha_by_step'][0]:.3f} | "
                             f"{' / '.join(f'{a:.2f}' for a in s['alpha_by_step'])} | {s['alpha']:.3f} | {s['mean_accepted']:.2f} |")
            m = summ["mean_over_tasks"]
            lines.append(f"| **mean over tasks** | | {m['alpha_step1']:.3f} | | **{m['alpha']:.3f}** | {m['mean_accepted']:.2f} |")
            lines.append("")
    return "\n".join(lines)


def evaluate_eagle_heldout(target, draft, heldout_prompts, tokenizer, cfg, log=None, layers_draft=None,
                           code_heldout: int = 8, per_task: int = 0) -> dict:
    """Generate held-out continuations at each of cfg.temperatures (Spec-Bench held-out prompts and
    held-out standard-library files), then evaluate_offline; plus the draft step cost."""
    from raysd.distill.data import prompt_encoder
    from raysd.distill.eagle_data import code_prompts, generate_feature_data
    from raysd.models.loading import eos_token_ids

    prompts = list(heldout_prompts)
    if per_task:
        by: dict = {}
        for p in prompts:
            by.setdefault(p.task, []).append(p)
        prompts = [ps[int((i + 0.5) * len(ps) / min(per_task, len(ps)))] for ps in by.values() for i in range(min(per_task, len(ps)))]
    if code_heldout and tokenizer is not None:
        prompts += code_prompts(code_heldout, heldout=True)
    encode = prompt_encoder(tokenizer, cfg.chat_template)
    enc = [encode(p) for p in prompts]
    keep = [i for i, e in enumerate(enc) if len(e) <= cfg.max_prompt_tokens]
    enc, tasks = [enc[i] for i in keep], [prompts[i].task for i in keep]
    eos = eos_token_ids(target)
    pad = getattr(target.generation_config, "pad_token_id", None)
    examples = []
    for temp in cfg.temperatures:
        examples += generate_feature_data(target, enc, tasks, max_new_tokens=cfg.eval_max_new_tokens, temperature=temp,
                                          batch_size=cfg.gen_batch_size, eos_token_ids=eos,
                                          pad_token_id=pad if pad is not None else (eos[0] if eos else 0),
                                          seed=cfg.seed + 1000, log=log)
    drafts = {"eagle": ("eagle", draft)}
    if layers_draft is not None:
        drafts["layers"] = ("tokens", layers_draft)
    report = {"num_prompts": len(enc), "prompts_per_task": {t: tasks.count(t) for t in sorted(set(tasks))},
              "k": cfg.eval_k, "max_new_tokens": cfg.eval_max_new_tokens,
              "offline": evaluate_offline(target, drafts, examples, cfg.eval_k, log=log)}
    report["cost"] = step_cost(target, draft, enc[0][:256] if enc else [1, 2, 3])
    if log:
        log("offline acceptance:\n" + format_offline(report["offline"], cfg.eval_k))
        log(f"draft step {report['cost']['draft_step_s'] * 1e3:.2f} ms, target step {report['cost']['target_step_s'] * 1e3:.2f} ms, "
            f"c = {report['cost']['draft_step_cost']:.3f}")
    return report
