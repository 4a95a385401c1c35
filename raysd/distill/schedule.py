"""The optimizer-step schedule both draft trainers share: linear warm-up, cosine decay to 10% of the
learning rate, and a run length that can be bounded in seconds as well as in steps."""

from __future__ import annotations

import math
import time


class Schedule:
    """`total` optimizer steps and the learning-rate factor at each.

    With `max_seconds` > 0 the run takes `steps`, or fewer when they would not fit in `max_seconds` at the
    pace of steps `probe` + 1 .. 2 `probe` (the first ones carry one-time costs: a CUDA context, kernel
    selection, the allocator's warm-up; on a GPU they ran 4x slower than the rest). The cosine then spans the
    shortened run: a time-bounded run still ends at the low learning rate."""

    def __init__(self, steps: int, warmup_steps: int, max_seconds: float = 0.0, probe: int = 10, clock=time.perf_counter):
        if steps < 0 or warmup_steps < 0 or max_seconds < 0 or probe < 1:
            raise ValueError("need steps, warmup_steps and max_seconds >= 0 and probe >= 1")
        self.total, self.warmup_steps, self.max_seconds, self.probe = steps, warmup_steps, max_seconds, probe
        self.clock = clock
        self.start = self._mark = clock()

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        frac = (step - self.warmup_steps) / max(1, self.total - self.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))

    def after_step(self, done: int) -> None:
        """Called with the number of steps done; fixes the run's length once 2 `probe` steps are done."""
        if not self.max_seconds:
            return
        if done == self.probe:
            self._mark = self.clock()
        elif done == 2 * self.probe:
            now = self.clock()
            per_step = (now - self._mark) / self.probe
            left = self.max_seconds - (now - self.start)
            self.total = max(done, min(self.total, done + int(left / per_step)))
