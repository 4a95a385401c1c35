"""Distillation training: the draft learns the target's next-token distributions.

Losses (DistillSpec, Zhou et al. 2024, compares both), between the target's distribution and
the draft's: forward KL, sum_x target(x) log(target(x) / draft(x)), and total variation,
1/2 sum_x |target(x) - draft(x)| (whose complement 1 - TV is the acceptance rate the rejection
test achieves). The target's distribution is kept as its top-k log-probabilities per position;
with an FR-Spec head, the draft's lives on the head tokens only.

The same loop runs in-process (`backend="local"`) or in Ray Train workers
(TorchTrainer; CPU workers, or GPUs with use_gpu). Workers split the examples by rank
and average gradients through DistributedDataParallel.
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
from raysd.distill.data import TeacherExample
from raysd.models.layer_draft import head_logits, head_token_ids

LOSSES = ("fkl", "tv")


@dataclass(frozen=True)
class TrainConfig:
    loss: str = "fkl"
    steps: int = 200
    lr: float = 5e-4
    weight_decay: float = 0.0
    warmup_steps: int = 10
    batch_tokens: int = 4096  # padded tokens per optimizer step (per worker)
    max_context: int = 0  # > 0: keep at most this many tokens before the first trained position
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    threads: int = 0  # torch threads per worker; 0 leaves torch's default
    max_seconds: float = 0.0  # > 0: fewer steps when `steps` would not fit in this time (distill.schedule)

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.steps < 0 or self.batch_tokens < 1 or self.lr <= 0 or self.max_seconds < 0:
            raise ValueError("need steps >= 0, batch_tokens >= 1, lr > 0 and max_seconds >= 0")


def distill_loss(logits: torch.Tensor, head_index: torch.Tensor, teacher_logprobs: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-position loss between the teacher's (the target's) distribution and the draft's.

    Args:
        logits: [N, H] draft logits over its head tokens (H = V for a full head).
        head_index: [N, k] where the teacher's top-k tokens sit in the head; -1 if outside it.
        teacher_logprobs: [N, k] the teacher's log-probabilities of those tokens.
    Returns:
        [N] forward KL(teacher || draft) or total variation TV(teacher, draft), the teacher's
        distribution restricted to its top-k tokens that the head scores, renormalised.
        With k = V and a full head this is exactly the target's distribution; with an
        FR-Spec head the draft learns the teacher's conditioned on the head tokens, which is
        the draft distribution on the head that maximises sum_x min(teacher(x), draft(x)).
    """
    draft_logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, head_index.clamp(min=0))  # [N, k]
    valid = head_index >= 0
    teacher = teacher_logprobs.float().masked_fill(~valid, float("-inf"))
    teacher = teacher - torch.logsumexp(teacher, dim=1, keepdim=True).clamp(min=-1e4)  # renormalise over the head's top-k
    teacher_probs = teacher.exp().nan_to_num(0.0) * valid
    if loss == "fkl":
        return (teacher_probs * (teacher.masked_fill(~valid, 0.0) - draft_logprobs)).sum(dim=1)
    if loss == "tv":
        draft_probs = draft_logprobs.exp() * valid
        return 0.5 * ((teacher_probs - draft_probs).abs().sum(dim=1) + (1 - draft_probs.sum(dim=1)).clamp(min=0))
    raise ValueError(f"unknown loss {loss!r}")


class DistillModule(nn.Module):
    """The draft plus the loss, as one module so that DDP sees a single forward."""

    def __init__(self, draft: nn.Module):
        super().__init__()
        self.draft = draft

    def forward(self, input_ids, attention_mask, sel_b, sel_t, head_index, teacher_logprobs, teacher_top1, loss: str):
        hidden = self.draft.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        logits = head_logits(self.draft, hidden[sel_b, sel_t])  # [N, H]
        per_pos = distill_loss(logits, head_index, teacher_logprobs, loss)
        ids = head_token_ids(self.draft)
        pred = logits.argmax(dim=-1)
        pred = ids[pred] if ids is not None else pred
        agree = (pred == teacher_top1).float()
        return per_pos.mean(), agree.mean()


def head_position_map(draft, vocab_size: int) -> torch.Tensor:
    """[V] position of each token in the draft's head, -1 for tokens it does not score."""
    ids = head_token_ids(draft)
    if ids is None:
        return torch.arange(vocab_size, dtype=torch.int64)
    m = torch.full((vocab_size,), -1, dtype=torch.int64)
    m[ids.cpu()] = torch.arange(ids.numel(), dtype=torch.int64)
    return m


def collate(examples: Sequence[TeacherExample], head_map: torch.Tensor, max_context: int = 0) -> dict:
    """Right-padded inputs (each sequence without its last token) and the trained positions."""
    rows, sel_b, sel_t, hidx, tlp, top1 = [], [], [], [], [], []
    for b, ex in enumerate(examples):
        start = ex.prompt_len - 1  # the position whose output predicts the first continuation token
        cut = max(0, start - max_context) if max_context > 0 else 0
        seq = ex.input_ids[cut:-1] if len(ex.input_ids) > ex.prompt_len else ex.input_ids[cut:]
        T = ex.topk_ids.shape[0]
        rows.append(seq)
        sel_b.append(torch.full((T,), b, dtype=torch.int64))
        sel_t.append(torch.arange(start - cut, start - cut + T, dtype=torch.int64))
        hidx.append(head_map[ex.topk_ids.long()])
        tlp.append(ex.topk_logprobs.float())
        top1.append(ex.topk_ids[:, 0].long())
    L = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.int64)
    mask = torch.zeros(len(rows), L, dtype=torch.int64)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r, dtype=torch.int64)
        mask[b, : len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "sel_b": torch.cat(sel_b), "sel_t": torch.cat(sel_t),
            "head_index": torch.cat(hidx), "teacher_logprobs": torch.cat(tlp), "teacher_top1": torch.cat(top1)}


def make_batches(examples: Sequence[TeacherExample], batch_tokens: int, rng: random.Random, max_context: int = 0) -> list[list[int]]:
    """Batches of example indices (`length_batches`), each example as long as `collate` feeds it."""
    cut = lambda ex: max(0, ex.prompt_len - 1 - max_context) if max_context > 0 else 0  # noqa: E731
    return length_batches([len(ex.input_ids) - cut(ex) for ex in examples], batch_tokens, rng)


def train_draft(
    draft: nn.Module,
    examples: Sequence[TeacherExample],
    cfg: TrainConfig,
    *,
    device: torch.device | str = "cpu",
    wrap: Callable[[nn.Module], nn.Module] | None = None,
    report: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Train `draft` (in place) on the examples; returns the logged metrics."""
    if not examples:
        raise ValueError("no training examples")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    V = draft.get_output_embeddings().weight.shape[0]
    head_map = head_position_map(draft, V)
    module = DistillModule(draft).to(device)
    if wrap is not None:
        module = wrap(module)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))

    plan = Schedule(cfg.steps, cfg.warmup_steps, cfg.max_seconds, agree=min_across_workers)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, plan.lr_factor)
    module.train()
    history, batches, start = [], [], time.perf_counter()
    acc_loss = acc_agree = 0.0
    n_acc = tokens = 0
    for step in itertools.count():
        if step == plan.total:
            break
        if not batches:
            batches = make_batches(examples, cfg.batch_tokens, rng, cfg.max_context)
        batch = collate([examples[i] for i in batches.pop()], head_map, cfg.max_context)
        batch = {k: v.to(device) for k, v in batch.items()}
        loss, agree = module(**batch, loss=cfg.loss)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        acc_loss += loss.item()
        acc_agree += agree.item()
        n_acc += 1
        tokens += int(batch["sel_b"].numel())
        plan.after_step(step + 1)
        if (step + 1) % cfg.log_every == 0 or step + 1 == plan.total:
            m = {"step": step + 1, "loss": acc_loss / n_acc, "top1_agreement": acc_agree / n_acc,
                 "lr": sched.get_last_lr()[0], "trained_positions": tokens, "elapsed_s": time.perf_counter() - start}
            history.append(m)
            if report:
                report(m)
            acc_loss = acc_agree = 0.0
            n_acc = 0
    module.eval()
    draft.eval()
    return history


@torch.no_grad()
def evaluate_loss(draft: nn.Module, examples: Sequence[TeacherExample], loss: str, batch_tokens: int = 4096) -> dict:
    """Mean loss and top-1 agreement with the teacher over `examples` (no training)."""
    V = draft.get_output_embeddings().weight.shape[0]
    head_map = head_position_map(draft, V)
    module = DistillModule(draft).eval()
    device = next(draft.parameters()).device
    tot_loss = tot_agree = 0.0
    n = 0
    for idx in make_batches(examples, batch_tokens, random.Random(0)):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in idx], head_map).items()}
        l, a = module(**batch, loss=loss)
        k = int(batch["sel_b"].numel())
        tot_loss, tot_agree, n = tot_loss + float(l) * k, tot_agree + float(a) * k, n + k
    return {"loss": tot_loss / n, "top1_agreement": tot_agree / n, "positions": n}


# ---------------------------------------------------------------------------- Ray Train


def _ray_train_loop(config: dict) -> None:
    """train_loop_per_worker: every worker trains its shard; rank 0 reports the draft as a checkpoint."""
    import ray
    import ray.train
    import ray.train.torch

    from raysd.models.layer_draft import save_draft

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    draft = ray.get(config["draft_ref"])
    examples = [TeacherExample.from_dict(d) for d in ray.get(config["examples_ref"])][rank::world]
    cfg = TrainConfig(**config["train"])
    device = ray.train.torch.get_device()
    history = train_draft(
        draft, examples, cfg, device=device,
        wrap=lambda m: ray.train.torch.prepare_model(m, parallel_strategy="ddp" if world > 1 else None),
        report=lambda m: ray.train.report({**m, "rank": rank}),
    )
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            save_draft(draft.cpu(), tmp, config["target_name"], dtype="float32", init_layers=config["init_layers"],
                       training={"history": history})
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": cfg.steps, "done": 1, "rank": rank}, checkpoint=checkpoint)


def train_with_ray(
    draft: nn.Module,
    examples: Sequence[TeacherExample],
    cfg: TrainConfig,
    *,
    target_name: str,
    init_layers: Sequence[int],
    num_workers: int = 1,
    use_gpu: bool = False,
    cpus_per_worker: float = 1,
    storage_path: str | None = None,
):
    """Train with Ray Train's TorchTrainer; returns the trained draft (rank 0's) and the metrics."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from raysd.actors.local import start_local_ray
    from raysd.models.layer_draft import load_own_weights, read_draft_config

    if not ray.is_initialized():
        start_local_ray()
    draft_ref = ray.put(draft.cpu())
    examples_ref = ray.put([ex.to_dict() for ex in examples])
    storage = storage_path or tempfile.mkdtemp(prefix="raysd-distill-")
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config={"draft_ref": draft_ref, "examples_ref": examples_ref, "train": asdict(cfg),
                           "target_name": target_name, "init_layers": list(init_layers)},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker=None if use_gpu else {"CPU": cpus_per_worker}),
        run_config=RunConfig(storage_path=storage, name=f"distill-{int(time.time())}"),
    )
    result = trainer.fit()
    if result.checkpoint is None:
        raise RuntimeError(f"Ray Train finished without a checkpoint: {result.error}")
    with result.checkpoint.as_directory() as ckpt:
        history = read_draft_config(ckpt).training.get("history", [])
        load_own_weights(draft, ckpt)
    return draft.eval(), history
