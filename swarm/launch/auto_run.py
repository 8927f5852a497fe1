"""`swarm peer --run-id auto --runs a.yaml,b.yaml`: a peer that serves whichever run of the swarm needs it most.

This process holds no stage. It reads the records of every run in `--runs`, picks a run and a stage with
the runs rule (`swarm.policy.run_choice`), and starts a peer process that serves it with the run's settings
and this peer's own (its logs go to a folder this process names). It then looks at the rule again on the
rebalancing timing (`swarm.policy.rebalance_timing`: a look every `--rebalance-period`, jittered, and a
second look to confirm), and where the rule moves it to another run, stops the peer (it leaves its stage as
on SIGTERM: the stage's other peers carry on) and starts one for the new run. Moves within a run are the
peer's own rebalancing. A peer that dies is started again; one refused for its settings is not.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import signal
import threading
import time
from pathlib import Path

from swarm.config import PeerConfig
from swarm.config.options import to_flags
from swarm.config.run_files import RunFile, read_run_files
from swarm.launch.local_swarm import LocalSwarm
from swarm.net.identity import load_identity
from swarm.policy.rebalance_timing import LOOK, MOVE, RebalanceTiming, Wait
from swarm.policy.run_choice import Choice, Placement, choose_placement
from swarm.records.run_states import peer_speed, placement_of, run_state
from swarm.records.stage_records import fetch_stage_records

logger = logging.getLogger(__name__)

CONFIG_ERROR = 2  # a peer's exit code for settings it was refused for: starting it again would not help
RESTART_PAUSE_S = 5.0
LEAVE_TIMEOUT_S = 60.0


class AutoRunPeer:
    """Runs one peer process at a time, for the run and stage the runs rule picks."""

    def __init__(self, config: PeerConfig, runs: list[RunFile], stop: threading.Event) -> None:
        self.config, self.runs, self.stop = config, {r.run_id: r for r in runs}, stop
        self.swarm = LocalSwarm(env={"OMP_NUM_THREADS": str(config.num_threads)})
        # the peer's identity is fixed across runs, so this process can find the peer's own records
        identity = config.identity_path or str(self.swarm.workdir / "identity.key")
        self.identity_path = identity
        self.peer_id = load_identity(identity).peer_id
        reader = dataclasses.replace(
            runs[0].config, identity_path=None, client_mode=True, check_reachability=False, use_auto_relay=False
        )
        from swarm.net.dht_node import start_dht

        self.dht = start_dht(reader)
        self.rng = random.Random()
        self.process = None
        self.name = ""  # the running peer's name in `self.swarm`
        self.placement: Placement | None = None
        self.started = 0
        self.timing: RebalanceTiming | None = None  # None with --rebalance-period 0
        self.wait_until, self.action = 0.0, LOOK
        self.target: Choice | None = None  # where the last look would move the peer

    def view(self) -> tuple[list, dict]:
        """Every run's state, and every run's records."""
        records = {
            run_id: fetch_stage_records(self.dht, run_id, run.config.num_stages) for run_id, run in self.runs.items()
        }
        return [run_state(self.runs[run_id], r) for run_id, r in records.items()], records

    def choose(self) -> tuple[Choice | None, Placement | None]:
        """What the rule says now, and where the peer serves (by its own record, else where it was started)."""
        try:
            states, records = self.view()
        except TimeoutError as e:
            logger.warning(f"Could not read the runs' records ({e}); looking again later")
            return None, self.placement
        current = None
        if self.process is not None and self.placement is not None:
            current = placement_of(self.peer_id, records) or self.placement
        return choose_placement(states, peer_speed(self.peer_id, states, records), current), current

    def start_peer(self, choice: Choice) -> None:
        run = self.runs[choice.placement.run_id]
        # each run's checkpoints in a folder of its own: two runs of one model and cut would share names
        folder = None if run.config.checkpoint_dir is None else str(Path(run.config.checkpoint_dir) / run.run_id)
        config = dataclasses.replace(
            run.config,
            stage=str(choice.placement.stage),
            identity_path=self.identity_path,
            runs=[],
            run_id=run.run_id,
            checkpoint_dir=folder,
        )
        self.started += 1
        self.name = name = f"peer-{run.run_id}-{self.started}"
        self.process = self.swarm.spawn(name, "peer", to_flags(config))
        self.placement = choice.placement
        logger.info(
            f"Serving run {run.run_id}, stage {choice.placement.stage}: {choice.reason}; the peer's log is "
            f"{self.swarm.log_path(name)}"
        )

    def stop_peer(self) -> int | None:
        """Stops the peer (it leaves its stage as on SIGTERM), killing what is left of it after LEAVE_TIMEOUT_S."""
        if self.process is None:
            return None
        self.process = None
        return self.swarm.stop(self.name, timeout=LEAVE_TIMEOUT_S)

    def run(self) -> int:
        """Until stopped: serve, look, move; returns the exit code."""
        try:
            return self._loop()
        finally:
            self.stop_peer()
            self.swarm.stop_all()
            self.dht.shutdown()

    def _loop(self) -> int:
        while not self.stop.is_set():
            if self.process is None or self.process.poll() is not None:
                code = self._serve_again()
                if code is not None:
                    return code
                continue
            if self.timing is None:  # --rebalance-period 0: the run first chosen is kept
                self.stop.wait(1.0)
            elif not self.stop.wait(max(0.0, min(1.0, self.wait_until - time.monotonic()))):
                if time.monotonic() >= self.wait_until:
                    self._next_timing_step()
        return 0

    def _serve_again(self) -> int | None:
        """Starts a peer where the rule says, the first time or after the last one exited; an exit code to
        return with if that cannot help (the peer was refused its settings)."""
        code = None if self.process is None else self.process.poll()
        if code == CONFIG_ERROR:
            logger.error(f"The peer for run {self.placement.run_id} was refused its settings; see its log")
            return CONFIG_ERROR
        if code is not None:
            logger.warning(f"The peer for run {self.placement.run_id} exited ({code}); starting one again")
            self.process = None
            if self.stop.wait(RESTART_PAUSE_S):
                return 0
        choice, _ = self.choose()
        if choice is None:  # the records could not be read: try again shortly
            self.stop.wait(RESTART_PAUSE_S)
            return None
        self._start_timed(choice, first_look=True)
        return None

    def _start_timed(self, choice: Choice, first_look: bool) -> None:
        self.start_peer(choice)
        if self.config.rebalance_period > 0:
            self.timing = RebalanceTiming(
                self.config.rebalance_period, self.config.announce_period, self.rng, first_look
            )
            self._wait(self.timing.start())

    def _wait(self, wait: Wait) -> None:
        self.wait_until, self.action = time.monotonic() + wait.seconds, wait.action

    def _next_timing_step(self) -> None:
        """The look, confirmation or move that is due (see `swarm.policy.rebalance_timing`)."""
        assert self.timing is not None
        if self.action == MOVE:
            assert self.target is not None and self.placement is not None
            logger.info(f"Leaving run {self.placement.run_id} for run {self.target.placement.run_id}")
            self.stop_peer()
            self._start_timed(self.target, first_look=False)
            return
        choice, current = self.choose()
        moves = choice is not None and current is not None and choice.placement.run_id != current.run_id
        if self.action == LOOK:
            self.target = choice if moves else None
            self._wait(self.timing.looked(moves))
        else:
            same = moves and self.target is not None and choice.placement.run_id == self.target.placement.run_id
            self.target = choice if same else None
            self._wait(self.timing.confirmed(same))


def run_auto_peer(config: PeerConfig) -> int:
    """`swarm peer --run-id auto`: serve the runs of `--runs` as the runs rule says, until SIGTERM or Ctrl-C."""
    runs = read_run_files(config)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logger.info(
        f"Choosing among runs {', '.join(r.run_id for r in runs)} ({', '.join(Path(r.path).name for r in runs)})"
    )
    return AutoRunPeer(config, runs, stop).run()
