"""Training curves as a PNG: loss and samples/s per step, one line per run.

Drawn with matplotlib's Agg backend (no display needed), for `swarm train --plot`, the demo and
the benchmarks that print curves. matplotlib is an optional dependency: `pip install 'swarm-trainer[plot]'`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure


# what to do when matplotlib is missing (swarm.config.roles says the same when --plot is given)
MATPLOTLIB_MISSING = "drawing plots needs matplotlib: pip install 'swarm-trainer[plot]'"


class PlotError(RuntimeError):
    """The plot could not be drawn or written (e.g. an unwritable path, or no matplotlib)."""


@dataclass
class RunCurves:
    """One run's curves: the loss of each step and when each step ended (seconds since the start)."""

    label: str
    losses: Sequence[float]
    step_seconds: Sequence[float]
    samples_per_step: float

    def samples_per_second(self) -> list[float]:
        """Throughput of each step: its samples over its own duration (NaN where a step took no time)."""
        rates, previous = [], 0.0
        for ended in self.step_seconds:
            duration = ended - previous
            rates.append(self.samples_per_step / duration if duration > 0 else math.nan)
            previous = ended
        return rates


def curves_from_summary(summary: object, label: str = "swarm") -> RunCurves:
    """The curves of a TrainingSummary (or its JSON dict): losses, step times, samples per step."""
    get = summary.get if isinstance(summary, dict) else lambda name: getattr(summary, name)
    steps = get("steps") or 1
    return RunCurves(label, list(get("losses")), list(get("step_seconds")), get("samples") / steps)


def draw_training(runs: Sequence[RunCurves], title: str = "") -> Figure:
    """A figure of two panels sharing the step axis: loss (top) and samples/s (bottom), one line per run.

    Raises PlotError if matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise PlotError(MATPLOTLIB_MISSING) from None

    matplotlib.use("Agg")  # files only: no display on servers and in CI
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # a bare Figure, not pyplot's: nothing global to close, safe from any thread
    figure = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    loss_axes, speed_axes = figure.subplots(2, 1, sharex=True)
    for run in runs:
        loss_axes.plot(range(1, len(run.losses) + 1), run.losses, label=run.label, linewidth=1.2)
        speed_axes.plot(range(1, len(run.step_seconds) + 1), run.samples_per_second(), label=run.label, linewidth=1.2)
    loss_axes.set_ylabel("loss")
    speed_axes.set_ylabel("samples/s")
    speed_axes.set_xlabel("step")
    speed_axes.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
    for axes in (loss_axes, speed_axes):
        axes.grid(alpha=0.3)
    if len(runs) > 1:
        loss_axes.legend()
    if title:
        loss_axes.set_title(title)
    return figure


def plot_training(runs: Sequence[RunCurves], path: str | os.PathLike, title: str = "") -> Path:
    """Draws `runs` (see draw_training) into PNG `path`, making its folder if needed; returns the path.

    Raises PlotError if the file cannot be written or matplotlib is not installed.
    """
    figure = draw_training(runs, title)
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(target, format="png")
    except OSError as e:
        raise PlotError(f"cannot write the plot to {target}: {e.strerror or e}") from None
    return target
