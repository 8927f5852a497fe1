"""Loss and samples/s plots: drawn from a run's curves, written as PNG by `swarm train --plot`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL_CORPUS

from swarm.ops.plots import PlotError, RunCurves, curves_from_summary, draw_training, plot_training

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    """A PNG that matplotlib reads back as the 800x600 figure, with something drawn on it."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    pixels = imread(path)
    assert pixels.shape[:2] == (600, 800)
    assert pixels.std() > 0.05  # not a blank canvas


def test_two_panels_loss_and_samples_per_second(tmp_path):
    run = RunCurves("swarm", losses=[5.5, 4.0, 3.0, 2.5], step_seconds=[2.0, 3.0, 3.5, 4.5], samples_per_step=32)
    assert run.samples_per_second() == [16.0, 32.0, 64.0, 32.0]  # each step's samples over its own duration
    figure = draw_training([run], "title")
    loss_axes, speed_axes = figure.axes
    assert list(loss_axes.lines[0].get_ydata()) == run.losses
    assert list(speed_axes.lines[0].get_ydata()) == run.samples_per_second()
    assert list(speed_axes.lines[0].get_xdata()) == [1, 2, 3, 4]
    assert (loss_axes.get_ylabel(), speed_axes.get_ylabel(), speed_axes.get_xlabel()) == ("loss", "samples/s", "step")
    two = draw_training([run, RunCurves("fp16", [6.0, 5.0], [1.0, 2.0], 32)])
    assert [len(axes.lines) for axes in two.axes] == [2, 2] and two.axes[0].get_legend() is not None

    path = plot_training([run], tmp_path / "deeper" / "loss.png")
    assert path == tmp_path / "deeper" / "loss.png"
    assert_png(path)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(PlotError, match="cannot write the plot to"):
        plot_training([run], tmp_path / "a-file" / "loss.png")


def swarm_train(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "swarm", "train", *args], capture_output=True, text=True, timeout=timeout
    )


def test_a_plot_path_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "a-file").write_text("")
    for path, reason in ((tmp_path / "a-file" / "loss.png", "cannot write into"), (tmp_path / "loss.jpg", ".png")):
        result = swarm_train("--plot", str(path), "--steps", "1")
        assert result.returncode == 2 and reason in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


WITHOUT_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "  # as if it were not installed


def test_without_matplotlib_a_plot_is_refused_before_training_naming_the_extra_to_install(tmp_path):
    code = WITHOUT_MATPLOTLIB + "from swarm.cli import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "train", "--plot", str(tmp_path / "loss.png"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "swarm train: error: --plot: drawing plots needs matplotlib: pip install 'swarm-trainer[plot]'"
    )
    code = WITHOUT_MATPLOTLIB + (
        "from swarm.ops.plots import PlotError, RunCurves, plot_training\n"
        "try:\n"
        f"    plot_training([RunCurves('swarm', [1.0], [1.0], 8)], {str(tmp_path / 'loss.png')!r})\n"
        "except PlotError as e:\n"
        "    print(e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "drawing plots needs matplotlib: pip install 'swarm-trainer[plot]'"


def wait_for_line(path: Path, text: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and text in path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}:\n{path.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.timeout(200)
def test_swarm_train_draws_its_plot_and_keeps_its_summary_when_it_cannot(local_swarm, tmp_path):
    model = ["--model", "gpt-tiny", "--num-stages", "1", "--seed", "5"]
    local_swarm.start_bootstrap()
    local_swarm.start_peer("peer0", 0, [*model, "--target-batch-size", "16", "--lr", "3e-3"])
    flags = [*model, "--data", SMALL_CORPUS, "--microbatch-size", "8", "--no-progress", "--compression", "none"]

    plot, summary_file = tmp_path / "plots" / "loss.png", tmp_path / "summary.json"
    trainer = local_swarm.start_trainer(
        "trainer", [*flags, "--steps", "5", "--plot", str(plot), "--summary-file", str(summary_file)]
    )
    assert trainer.wait(90) == 0, local_swarm.log_path("trainer").read_text()[-3000:]
    assert f"loss plot: {plot}" in local_swarm.log_path("trainer").read_text()
    assert_png(plot)
    summary = json.loads(summary_file.read_text())
    assert len(summary["losses"]) == len(summary["step_seconds"]) == 5
    curves = curves_from_summary(summary)
    assert curves.samples_per_step == 16 and all(rate > 0 for rate in curves.samples_per_second())

    # the plot's folder turns into a file while training: the run ends with one error line, its summary kept
    blocked, second_summary = tmp_path / "later" / "loss.png", tmp_path / "second.json"
    trainer = local_swarm.start_trainer(
        "trainer2", [*flags, "--steps", "3", "--plot", str(blocked), "--summary-file", str(second_summary)]
    )
    wait_for_line(local_swarm.log_path("trainer2"), "Found all 1 stages")
    blocked.parent.write_text("")
    assert trainer.wait(90) == 1
    log = local_swarm.log_path("trainer2").read_text()
    assert "Trained, but drew no plot: cannot write the plot to" in log and "Traceback" not in log, log[-3000:]
    assert json.loads(second_summary.read_text())["steps"] == 3
