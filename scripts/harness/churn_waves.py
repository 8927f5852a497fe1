"""Preemption waves: which peers one wave takes, as a pure choice a chaos run can replay from its seed."""

from __future__ import annotations

import math
import random
from collections.abc import Iterable


def wave_size(live: int, share: float) -> int:
    """Peers a wave of `share` (in (0, 1]) takes out of `live`: the share rounded half up, so a wave of 0.5
    takes 5 of 9; at least one peer and at most all of them (none of none)."""
    if not 0 < share <= 1:
        raise ValueError(f"a wave's share must be in (0, 1], got {share}")
    if live <= 0:
        return 0
    # floor(x + 0.5) rather than round(): Python rounds 4.5 to 4, which would make half of 9 four
    return min(live, max(1, math.floor(share * live + 0.5)))


def wave_victims(live: Iterable[str], share: float, rng: random.Random) -> list[str]:
    """The peers (by name) a wave of `share` takes out of `live`, chosen by `rng`.

    The names are sorted first, so the same seed picks the same peers whatever order `live` came in.
    """
    names = sorted(live)
    return rng.sample(names, wave_size(len(names), share))
