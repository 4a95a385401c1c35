"""What both draft trainers share: batches of examples of similar lengths, and the optimizer-step
schedule (linear warm-up, cosine decay to 10% of the learning rate, and a run length that can be
bounded in seconds as well as in steps)."""

from __future__ import annotations

import math
import random
import time
from typing import Callable, Sequence


def length_batches(lengths: Sequence[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Indices into `lengths` in batches of similar lengths, each at most `batch_tokens` padded tokens
    (its longest length times its size; a longer example is a batch alone), the batches in random
    order. Sorting by length keeps the padding small; `rng` breaks ties and shuffles."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], rng.random()))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = max(cur_max, lengths[i])
        if cur and n * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, n = [], lengths[i]
        cur.append(i)
        cur_max = n
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


class Schedule:
    """`total` optimizer steps and the learning-rate factor at each.

    With `max_seconds` > 0 the run takes `steps`, or fewer when they would not fit in `max_seconds`. The
    length is planned after 2 `probe` steps from the pace of the last `probe` (the first ones carry one-time
    costs: a CUDA context, kernel selection, the allocator's warm-up), then planned again after 4, 8, 16, ...
    `probe` steps from the pace since the previous plan: on a GPU the steps just after the first ones can still
    run well below the later pace, and a run planned on them alone would stop long before its time
    (docs/history/notes.md). The cosine spans the planned run
    (a later plan moves its end a little): a time-bounded run still ends at the low learning rate."""

    def __init__(self, steps: int, warmup_steps: int, max_seconds: float = 0.0, probe: int = 10, clock=time.perf_counter,
                 agree: Callable[[int], int] = lambda total: total):
        """`agree` turns this process's planned length into the one all training workers take (each plans
        at the same step counts: `min_across_workers` under torch.distributed, so no worker waits in a
        collective for a step another never runs)."""
        if steps < 0 or warmup_steps < 0 or max_seconds < 0 or probe < 1:
            raise ValueError("need steps, warmup_steps and max_seconds >= 0 and probe >= 1")
        self.total, self.warmup_steps, self.max_seconds, self.probe = steps, warmup_steps, max_seconds, probe
        self.asked = steps
        self.clock, self.agree = clock, agree
        self.start = self._mark = clock()
        self._marked = 0  # steps done at `_mark`

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.total - self.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    def after_step(self, done: int) -> None:
        """Called with the number of steps done; plans the run's length after 2, 4, 8, ... `probe` steps."""
        if not self.max_seconds or done % self.probe or (done // self.probe) & (done // self.probe - 1):
            return  # only at `probe` times a power of two
        now = self.clock()
        if done > self.probe:
            per_step = (now - self._mark) / (done - self._marked)
            left = self.max_seconds - (now - self.start)
            self.total = self.agree(max(done, min(self.asked, done + int(left / per_step))))
        self._mark, self._marked = now, done


def min_across_workers(total: int) -> int:
    """The smallest of the workers' planned lengths (torch.distributed's all-reduce; this process's own
    when it trains alone)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return total
    t = torch.tensor([total], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
