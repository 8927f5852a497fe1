"""A peer's measured speed: the moving average of its backward timings that it announces.

Peers announce it, trainers route by it and the balance rule moves peers by it, so the runtime
(`swarm.peer.runtime`) and the simulator (`scripts/simulate.py`) keep it the same way, here.
"""

from __future__ import annotations

NEWEST_WEIGHT = 0.1  # weight of the newest timing: one slow batch moves the announced speed a little


class ThroughputAverage:
    """Seconds per sample of backward work (which includes the recomputed forward), averaged over batches.

    `reset` starts it afresh from one timing (the batch a peer times when it starts on a stage);
    `add` folds in each batch it runs after, with weight `weight` for the newest.
    """

    def __init__(self, weight: float = NEWEST_WEIGHT) -> None:
        self.weight = weight
        self.seconds_per_sample: float | None = None  # None until the first timing

    def reset(self, seconds_per_sample: float) -> None:
        """Forgets the average: one fresh timing stands for the peer's speed."""
        self.seconds_per_sample = seconds_per_sample

    def add(self, seconds_per_sample: float) -> None:
        """Folds in one batch's timing (the first one taken as it is)."""
        if self.seconds_per_sample is None:
            self.seconds_per_sample = seconds_per_sample
        else:
            self.seconds_per_sample += self.weight * (seconds_per_sample - self.seconds_per_sample)

    @property
    def samples_per_second(self) -> float:
        """The speed announced: samples per second of backward work, 0 before the first timing."""
        return 1.0 / self.seconds_per_sample if self.seconds_per_sample else 0.0
