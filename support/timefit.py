"""train.py --max-seconds S: the run ends S seconds after it started, loading and evaluations
included. Every FIT_EVERY steps the schedule (warm-up, cosine, the selector's alpha) takes the
length that fits the time left, priced at this run's own step time. Why not the step count a probe
priced: one machine's steps ran 0.7 to 1.3 times their three-step probe, by kind (docs/cpu.md), and
a shared VM's speed drifts within a run. An early fit moves a cosine that has barely left its peak;
a late one moves it little, the step time by then known. A fitted run's checkpoint keeps its length
("total"), and --resume goes on at it.
"""

import collections
import contextlib
import math
import time

from support.distributed import agreed

FIT_EVERY = 25  # steps between fits
FIT_WINDOW = 200  # the step time: the mean of the last 200 (a window of 100 read 0.34-0.50 s in
# one native job whose steps averaged 0.40: the rows' lengths differ)
# an evaluation before one is timed: a held-out sequence's no-grad forward about a third of a
# training step (5-9 s measured for 48 sequences at 0.40-0.53 s a step)
EVAL_STEPS_PER_SEQUENCE = 1 / 3


def total_that_fits(step, seconds_left, t_step, t_eval, eval_interval) -> int:
    """The schedule's length whose steps still to run (t_step seconds each), with an evaluation
    every eval_interval steps and the final one (t_eval each), fit seconds_left:
        total = step + floor((seconds_left - t_eval) / (t_step + t_eval / eval_interval))
    and never under step: out of time, the run ends where it stands."""
    per_step = t_step + t_eval / eval_interval
    return step + max(0, math.floor((seconds_left - t_eval) / per_step))


class TimeFit:
    """due(step) after every step, total(step) when due: the fitted length, rank 0's on every rank
    (the ranks' clocks differ, their schedules must not). seconds None (no --max-seconds): never
    due, nothing timed."""

    def __init__(self, seconds, started, eval_interval, n_eval, device, distributed):
        self.seconds, self.started = seconds, started
        self.deadline = None if seconds is None else started + seconds
        self.eval_interval, self.n_eval = eval_interval, n_eval
        self.device, self.distributed = device, distributed
        self.clock = collections.deque(maxlen=FIT_WINDOW + 1)  # (step, seconds less evaluations)
        self.eval_s = []  # each evaluation's seconds

    def due(self, step) -> bool:
        if self.deadline is None:
            return False
        self.clock.append((step, time.time() - sum(self.eval_s)))
        return step % FIT_EVERY == 0

    @contextlib.contextmanager
    def evaluation(self):
        t = time.time()
        yield
        self.eval_s.append(time.time() - t)

    def total(self, step) -> int:
        (s0, c0), (s1, c1) = self.clock[0], self.clock[-1]
        t_step = (c1 - c0) / max(1, s1 - s0)
        t_eval = self.n_eval * t_step * EVAL_STEPS_PER_SEQUENCE
        t_eval = sum(self.eval_s) / len(self.eval_s) if self.eval_s else t_eval
        fits = total_that_fits(
            step, self.deadline - time.time(), t_step, t_eval, self.eval_interval
        )
        return agreed(fits, self.device, self.distributed)

    def summary(self, total) -> str:
        return (
            f"--max-seconds {self.seconds:g}: {total} steps fitted, the final evaluation "
            f"{time.time() - self.started:.0f} s in"
        )
