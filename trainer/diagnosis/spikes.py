"""Loss spikes (`training.spike_threshold`): a step whose loss stands far above the steps before it.

The detector judges the mean loss over the ranks of every step (the NaN guard gathers each rank's local loss with its
flags, in the collective it makes anyway, and hands them over when it reads its flags: at log steps, and before a
checkpoint is saved so that the window a checkpoint records is complete). A step is a spike when its loss is above the
mean of the last `spike_window` steps' plus `spike_threshold` standard deviations of them, judged once the window is
full; a spike and a non-finite step (the guard's business) stay out of the window, so a run of spikes is not taken
for the new normal. The losses are identical on every rank, and so is every decision.

What a spike does is the loop's (`training.spike_policy`): it is logged with its step and the documents of its batch
(`trainer.data.documents`), and with `rollback` the run goes back to the newest checkpoint at or before it and skips
`spike_skip` batches around it (`training.skip_batches`, `trainer.data.batches.data_step`). The window is part of the
loop's state in each checkpoint (`state`, `restore`), so a resumed run judges as the run it continues would have.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    mean: float  # of the window before it
    std: float

    def line(self, threshold: float) -> str:
        return (f"loss spike at step {self.step}: loss {self.loss:.4f} against {self.mean:.4f} ± {self.std:.4f} over "
                f"the steps before it (above {threshold:g} standard deviations)")


class SpikeDetector:
    """The last `window` losses that were neither spikes nor non-finite, and the rule that judges the next one."""

    def __init__(self, threshold: float, window: int) -> None:
        self.threshold = threshold
        self.losses: deque[float] = deque(maxlen=window)

    def observe(self, step: int, loss: float) -> Spike | None:
        """Judge `step`'s mean loss; the spike, or None (the loss then joins the window, when finite)."""
        if not math.isfinite(loss):
            return None
        if len(self.losses) == self.losses.maxlen:
            mean = math.fsum(self.losses) / len(self.losses)
            std = math.sqrt(math.fsum((x - mean) ** 2 for x in self.losses) / (len(self.losses) - 1))
            if loss > mean + self.threshold * std:
                return Spike(step, loss, mean, std)
        self.losses.append(loss)
        return None

    def state(self) -> list[float]:
        return list(self.losses)

    def restore(self, losses: list[float]) -> None:
        self.losses.clear()
        self.losses.extend(losses)
