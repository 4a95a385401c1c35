"""Training the EAGLE feature draft (raysd.models.eagle_draft) on the target's own features.

Row t of a sequence holds the target's pre-norm hidden state f_t and the next token x_{t+1}; the draft
predicts x_{t+2}, whose target distribution p_{t+1} is the target's final norm and head applied to f_{t+1}
(computed here over the draft's head tokens and renormalised there: with an FR-Spec head the best draft
restricted to the head is p conditioned on the head).

Training-time test (EAGLE-3): step 1 feeds the target's features; step k >= 2 feeds, at row t, the
draft's own hidden state from step k-1 at row t-1, exactly what the drafter feeds at inference. Its
attention sees step 1's keys up to row t-k+1 (positions whose features were real) and the keys of
steps 2..k on its own chain (rows t-k+2..t), as a drafter's cache holds them during one proposal.
Loss per step: forward KL(target || draft) (or TV); step k weighs 0.8^(k-1). Optionally EAGLE-1's smooth-L1
between the draft's hidden state at row t and the target's f_{t+1} (both through the final norm).
"""

from __future__ import annotations

import itertools
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from raysd.distill.schedule import Schedule, length_batches, min_across_workers
from raysd.distill.eagle_data import FeatureExample


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 200
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 10
    batch_tokens: int = 4096  # rows (padded) per optimizer step and worker
    max_context: int = 0  # > 0: drop rows more than this many before the first continuation row
    ttt_steps: int = 3  # draft steps per row; steps 2.. see the draft's own features
    step_decay: float = 0.8  # weight of step k: decay^(k-1)
    loss: str = "fkl"  # fkl | tv
    feature_weight: float = 0.0  # EAGLE-1's smooth-L1 on features
    prompt_weight: float = 0.3  # loss weight of rows that predict a prompt token (continuation rows weigh 1)
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    threads: int = 0
    max_seconds: float = 0.0  # > 0: fewer steps when `steps` would not fit in this time (distill.schedule)
    # "bfloat16": the forward and backward under torch.autocast (matmuls in bf16, losses and optimizer state in
    # float32): more rows per second on a CPU with AVX512-BF16 or a GPU; "none": float32 throughout
    autocast: str = "none"

    def __post_init__(self) -> None:
        if self.autocast not in ("none", "bfloat16"):
            raise ValueError(f"autocast must be none or bfloat16, got {self.autocast!r}")
        if self.loss not in ("fkl", "tv"):
            raise ValueError(f"loss must be fkl or tv, got {self.loss!r}")
        if self.steps < 0 or self.batch_tokens < 1 or self.lr <= 0 or self.ttt_steps < 1 or self.max_seconds < 0:
            raise ValueError("need steps >= 0, batch_tokens >= 1, lr > 0, ttt_steps >= 1 and max_seconds >= 0")


def _start(ex: FeatureExample, max_context: int) -> int:
    first = max(0, ex.prompt_len - 2)  # the first row predicting a continuation token (x_{t+2}, t + 2 >= prompt_len)
    return max(0, first - max_context) if max_context > 0 else 0


def collate(examples: Sequence[FeatureExample], prompt_weight: float, max_context: int = 0) -> dict:
    """Right-padded rows: features [B, R, H], tokens [B, R] (x_{t+1}), target features [B, R, H] (f_{t+1}),
    weights [B, R] (0 on padding and on each sequence's last row), next tokens [B, R] (x_{t+2})."""
    H = examples[0].features.shape[-1]
    spans = []
    for ex in examples:
        s = _start(ex, max_context)
        spans.append((s, ex.features.shape[0]))  # rows s..n-2
    R = max(e - s for s, e in spans)
    B = len(examples)
    feats = torch.zeros(B, R, H, dtype=torch.bfloat16)
    tfeats = torch.zeros(B, R, H, dtype=torch.bfloat16)
    toks = torch.zeros(B, R, dtype=torch.int64)
    nxt = torch.full((B, R), -1, dtype=torch.int64)
    w = torch.zeros(B, R)
    for b, (ex, (s, e)) in enumerate(zip(examples, spans)):
        n = e - s
        ids = torch.tensor(ex.input_ids, dtype=torch.int64)
        feats[b, :n] = ex.features[s:e]
        toks[b, :n] = ids[s + 1:e + 1]
        if n > 1:
            tfeats[b, :n - 1] = ex.features[s + 1:e]
            nxt[b, :n - 1] = ids[s + 2:e + 1]
            t = torch.arange(s, e - 1)
            w[b, :n - 1] = torch.where(t + 2 >= ex.prompt_len, 1.0, prompt_weight)
    return {"features": feats, "tokens": toks, "target_features": tfeats, "weights": w, "next_tokens": nxt}


def ttt_mask(R: int, k: int, device=None) -> torch.Tensor:
    """Boolean [1, 1, R, k*R] mask of step k's queries over the keys of steps 1..k (True = attend)."""
    t = torch.arange(R, device=device).view(R, 1)
    s = torch.arange(R, device=device).view(1, R)
    blocks = [s <= t - (k - 1)]
    blocks += [s == t - (k - j) for j in range(2, k + 1)]
    return torch.cat(blocks, dim=1)[None, None]


class EagleLoss(nn.Module):
    """The draft plus its training-time-test loss, as one module (one forward for DDP)."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, features, tokens, target_features, weights, next_tokens, cfg: dict):
        from transformers import DynamicCache

        d = self.draft
        B, R, _ = features.shape
        # the teacher in float32 even under autocast: its distribution is the label
        with torch.no_grad(), torch.autocast(features.device.type, enabled=False):
            target_logits = d.head_logits(target_features.float())  # [B, R, N] the target's logits on the head tokens
            target_logprobs = torch.log_softmax(target_logits, dim=-1)
            target_probs = target_logprobs.exp()
            target_top1 = target_logits.argmax(-1)
        pos = torch.arange(R, device=features.device).unsqueeze(0).expand(B, R)
        cache = DynamicCache()
        feats = features.float()
        total = features.new_zeros((), dtype=torch.float32)
        metrics = {}
        h = None  # the draft's hidden states of the last step
        for k in range(1, cfg["ttt_steps"] + 1):
            if k > 1:
                feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], dim=1)
            mask = ttt_mask(R, k, features.device).expand(B, 1, R, k * R)
            h = d.hidden(feats, tokens, position_ids=pos, past_key_values=cache, attention_mask=mask)
            draft_logprobs = torch.log_softmax(d.head_logits(h).float(), dim=-1)
            if cfg["loss"] == "fkl":
                per = (target_probs * (target_logprobs - draft_logprobs)).sum(-1)
            else:
                per = 0.5 * (target_probs - draft_logprobs.exp()).abs().sum(-1)
            w = weights.clone()
            if k > 1:
                w[:, :k - 1] = 0.0  # rows whose chain would start before the sequence
            kw = w.sum().clamp(min=1e-6)
            step_loss = (per * w).sum() / kw
            if cfg["feature_weight"]:
                fl = nn.functional.smooth_l1_loss(d.norm(h), d.norm(target_features.float()), reduction="none").mean(-1)
                step_loss = step_loss + cfg["feature_weight"] * (fl * w).sum() / kw
            total = total + cfg["step_decay"] ** (k - 1) * step_loss
            with torch.no_grad():
                agree = ((draft_logprobs.argmax(-1) == target_top1).float() * w).sum() / kw
                # 1 - TV on the head: the acceptance rate at temperature 1 (within the head)
                acc = ((torch.minimum(target_probs, draft_logprobs.exp()).sum(-1)) * w).sum() / kw
            metrics[f"top1_step{k}"] = agree
            metrics[f"accept_step{k}"] = acc
        return total, metrics


def make_batches(examples: Sequence[FeatureExample], batch_tokens: int, rng: random.Random, max_context: int = 0) -> list[list[int]]:
    """Batches of example indices (`length_batches`), each example as many rows as `collate` feeds."""
    return length_batches([ex.features.shape[0] - _start(ex, max_context) for ex in examples], batch_tokens, rng)


def train_eagle(draft, examples: Sequence[FeatureExample], cfg: EagleTrainConfig, *, device="cpu",
                wrap: Callable[[nn.Module], nn.Module] | None = None,
                report: Callable[[dict], None] | None = None) -> list[dict]:
    """Train the draft's own tensors in place; returns the logged metrics."""
    if not examples:
        raise ValueError("no training examples")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    module = EagleLoss(draft).to(device)
    if wrap is not None:
        module = wrap(module)
    params = [p for p in draft.own_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    plan = Schedule(cfg.steps, cfg.warmup_steps, cfg.max_seconds, agree=min_across_workers)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, plan.lr_factor)
    module.train()
    lcfg = {"ttt_steps": cfg.ttt_steps, "loss": cfg.loss, "feature_weight": cfg.feature_weight, "step_decay": cfg.step_decay}
    history, batches, start = [], [], time.perf_counter()
    acc: dict[str, float] = {}
    n_acc = rows = 0
    for step in itertools.count():
        if step == plan.total:
            break
        if not batches:
            batches = make_batches(examples, cfg.batch_tokens, rng, cfg.max_context)
        batch = collate([examples[i] for i in batches.pop()], cfg.prompt_weight, cfg.max_context)
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.autocast == "bfloat16"):
            loss, metrics = module(**batch, cfg=lcfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        for k, v in {"loss": loss, **metrics}.items():
            acc[k] = acc.get(k, 0.0) + float(v.detach() if torch.is_tensor(v) else v)
        n_acc += 1
        rows += int((batch["weights"] > 0).sum())
        plan.after_step(step + 1)
        if (step + 1) % cfg.log_every == 0 or step + 1 == plan.total:
            elapsed = time.perf_counter() - start
            m = {"step": step + 1, "total_steps": plan.total, **{k: v / n_acc for k, v in acc.items()}, "lr": sched.get_last_lr()[0],
                 "trained_rows": rows, "elapsed_s": elapsed, "eta_s": elapsed / (step + 1) * (plan.total - step - 1)}
            history.append(m)
            if report:
                report(m)
            acc, n_acc = {}, 0
    module.eval()
    draft.eval()
    return history


@torch.no_grad()
def evaluate_eagle_loss(draft, examples: Sequence[FeatureExample], cfg: EagleTrainConfig) -> dict:
    """Loss and per-step agreement of the draft on `examples` (teacher-forced, training-time-test chains)."""
    module = EagleLoss(draft).eval()
    device = next(draft.parameters()).device
    lcfg = {"ttt_steps": cfg.ttt_steps, "loss": cfg.loss, "feature_weight": cfg.feature_weight, "step_decay": cfg.step_decay}
    tot: dict[str, float] = {}
    n = 0.0
    for idx in make_batches(examples, cfg.batch_tokens, random.Random(0), cfg.max_context):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], cfg.prompt_weight, cfg.max_context).items()}
        loss, metrics = module(**batch, cfg=lcfg)
        w = float(batch["weights"].sum())
        for k, v in {"loss": loss, **metrics}.items():
            tot[k] = tot.get(k, 0.0) + float(v) * w
        n += w
    return {k: v / max(n, 1e-9) for k, v in tot.items()}


# ---------------------------------------------------------------------------- Ray Train


def _ray_train_loop(config: dict) -> None:
    import ray
    import ray.train
    import ray.train.torch

    from raysd.models.eagle_draft import save_eagle

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    draft = ray.get(config["draft_ref"])
    examples = [FeatureExample.from_dict(d) for d in ray.get(config["examples_ref"])][rank::world]
    cfg = EagleTrainConfig(**config["train"])
    history = train_eagle(
        draft, examples, cfg, device=ray.train.torch.get_device(),
        wrap=lambda m: ray.train.torch.prepare_model(m, parallel_strategy="ddp" if world > 1 else None),
        report=lambda m: ray.train.report({**m, "rank": rank}),
    )
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            save_eagle(draft.cpu(), tmp, config["target_name"], config["architecture"], dtype="float32",
                       training={"history": history})
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": cfg.steps, "done": 1, "rank": rank}, checkpoint=checkpoint)


def train_eagle_with_ray(draft, examples: Sequence[FeatureExample], cfg: EagleTrainConfig, *, target_name: str,
                         architecture: str, num_workers: int = 1, use_gpu: bool = False, cpus_per_worker: float = 1,
                         storage_path: str | None = None, log: Callable[[str], None] | None = None):
    """Ray Train's TorchTrainer; returns the trained draft (rank 0's weights) and the metrics."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raysd.actors.local import start_local_ray
    from raysd.models.eagle_draft import WEIGHTS_FILE, read_eagle_config

    if not ray.is_initialized():
        start_local_ray()
    draft_ref = ray.put(draft.cpu())
    examples_ref = ray.put([ex.to_dict() for ex in examples])
    storage = storage_path or tempfile.mkdtemp(prefix="raysd-eagle-")
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"draft_ref": draft_ref, "examples_ref": examples_ref, "train": asdict(cfg),
                           "target_name": target_name, "architecture": architecture},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": cpus_per_worker}),
        run_config=RunConfig(storage_path=storage, name=f"eagle-{int(time.time())}"),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"Ray Train finished without a checkpoint: {result.error}")
    from safetensors.torch import load_file

    with result.checkpoint.as_directory() as ckpt:
        history = read_eagle_config(ckpt).training.get("history", [])
        tensors = load_file(f"{ckpt}/{WEIGHTS_FILE}")
    tensors.pop("raysd.head_token_ids", None)
    draft.load_state_dict(tensors, strict=False)
    return draft.eval(), history
