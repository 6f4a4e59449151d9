"""Model FLOPs utilisation (MFU): the share of a GPU's peak arithmetic that the training really used.

    MFU = flops of one step / (duration of one step x peak FLOP/s of one GPU)

* ``flops`` is what a rank reports in ``Progress.flops`` (``report_step(step, flops=...)``): the model
  FLOPs of ONE training step on that rank, forward and backward, counted the MFU way (for a dense
  transformer about 6 x parameters x tokens of the rank's step; activation recomputation is not
  counted, so MFU stays comparable across memory settings). Not a rate: the agent measures the time.
* The step duration is measured by the agent between two reports whose step advanced: (t2 - t1) /
  (step2 - step1). Reports of the same step by the other local ranks, or repeated ones, are ignored,
  so it does not matter whether every rank reports or only one, nor how often.
* The peak is that of ONE GPU (a rank drives one GPU), dense, in the precision the model trains in,
  e.g. 989e12 for an H100 SXM in BF16. The result is then the rank's MFU, which is also the node's
  and the job's when the ranks are balanced. A value above 1 means the reported FLOPs or the
  configured peak are wrong: it is published as it is, not clipped.

Everything here is pure arithmetic on the numbers given (no clock of its own), so that it can be
tested exactly; :class:`MfuMeter` only keeps the last point where the step advanced.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


def mfu(flops: float, step_s: float, peak_flops: float) -> float | None:
    """``flops / (step_s * peak_flops)``; ``None`` unless all three are positive finite numbers."""
    if not (_positive(flops) and _positive(step_s) and _positive(peak_flops)):
        return None
    return flops / (step_s * peak_flops)


@dataclass(frozen=True)
class StepMark:
    step: int
    at_s: float  # when the step was reported (seconds; any clock, the same for every mark)


def step_seconds(previous: StepMark | None, current: StepMark) -> float | None:
    """The mean duration of the steps between two marks; ``None`` when the step did not advance (a
    repeat, another local rank's report of the same step, a restart from an older checkpoint) or the
    clock did not move forward."""
    if previous is None or current.step <= previous.step:
        return None
    elapsed = current.at_s - previous.at_s
    if not _positive(elapsed):
        return None
    return elapsed / (current.step - previous.step)


class MfuMeter:
    """MFU from a stream of progress reports (several ranks of a node may report concurrently)."""

    def __init__(self, peak_flops: float = 0.0) -> None:
        self.peak_flops = peak_flops  # of one GPU; 0: unknown, no MFU
        self._mark: StepMark | None = None
        self._lock = threading.Lock()

    def observe(self, step: int, at_s: float, flops: float | None) -> float | None:
        """Feeds one report; returns the MFU of the steps since the previous advance, or ``None``
        (first report, no advance, no ``flops``, no peak)."""
        current = StepMark(step, at_s)
        with self._lock:
            previous = self._mark
            if previous is not None and step == previous.step:
                return None  # the same step again (another local rank): keep the first report's time
            if previous is not None and step < previous.step:
                self._mark = current  # the job restarted from an older step: measure from here
                return None
            self._mark = current
        if flops is None:
            return None
        duration = step_seconds(previous, current)
        if duration is None:
            return None
        return mfu(flops, duration, self.peak_flops)
