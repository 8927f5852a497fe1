"""Roles forked from the preloaded forkserver behave as roles launched as programs: exit codes, logs,
sessions, waiting, stopping; and a placeholder for a module nobody uses is loaded when first used."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from swarm.launch.local_swarm import LocalSwarm
from swarm.launch.role_forkserver import own_hivemind_locks, start_forkserver

FLAGS = ["--model", "gpt-tiny", "--num-stages", "3"]


def process_group(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rsplit(")", 1)[1].split()[2])


@pytest.mark.timeout(120)
def test_a_forked_role_is_a_role_as_a_launched_one(tmp_path):
    with LocalSwarm(tmp_path, preloaded=True) as swarm:
        swarm.start_bootstrap()
        typo = swarm.start_trainer("trainer", [*FLAGS, "--stepz", "3"])
        assert typo.wait(60) == 2  # the flag typo, as the CLI answers it
        assert "unrecognized arguments: --stepz" in swarm.log_path("trainer").read_text()

        peer = swarm.start_peer("peer0", 0, FLAGS)
        deadline = time.monotonic() + 90
        while "Serving stage 0/3" not in (log := swarm.log_path("peer0").read_text(errors="replace")):
            assert peer.poll() is None and time.monotonic() < deadline, log[-3000:]
            time.sleep(0.1)
        assert process_group(peer.pid) == peer.pid  # a session of its own: stopping it takes its DHT and daemons
        with open(f"/proc/{peer.pid}/comm") as file:
            assert file.read().strip() == "swarm peer"  # as top and pgrep show it
        with pytest.raises(subprocess.TimeoutExpired):
            peer.wait(0.05)
        # nothing left to import: from its fork to its first milestone is parsing flags
        imports = float(log.split("(imports ", 1)[1].split("s", 1)[0])
        assert imports < 1.0, log[-2000:]
        assert swarm.stop("peer0") == 0
        assert "has left" in swarm.log_path("peer0").read_text(errors="replace")
        assert peer.returncode == 0 and peer.poll() == 0
        peer.send_signal(15)  # reaped already: nothing is signalled


def test_a_deferred_module_loads_when_first_used():
    code = (
        "import sys, swarm, hivemind; "
        "assert type(sys.modules['scipy.optimize']).__name__ == 'DeferredModule', 'imported at start'; "
        "import inspect; inspect.getmodule(inspect); "  # walks every module's __file__: must not load it
        "assert type(sys.modules['scipy.optimize']).__name__ == 'DeferredModule', 'loaded by inspect'; "
        "from hivemind.averaging.load_balancing import load_balance_peers; "
        "assert load_balance_peers(100, (1.0, 1.0)) == (50, 50); "
        "import scipy.optimize; assert callable(scipy.optimize.linprog); "
        "assert type(sys.modules['scipy.optimize']).__name__ == 'module'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def hold_hivemind_lock_and_wait(held) -> None:
    """A role killed inside hivemind's shared-buffer lock, as a DHT call makes its future."""
    from hivemind.utils.mpfuture import SharedBytes

    own_hivemind_locks()
    SharedBytes._lock.acquire()
    held.set()
    time.sleep(600)


def make_a_future(made) -> None:
    from hivemind.utils.mpfuture import MPFuture

    own_hivemind_locks()
    MPFuture()
    made.set()


@pytest.mark.timeout(120)
def test_a_role_killed_inside_a_hivemind_lock_leaves_the_other_roles_their_dht_calls():
    """hivemind's process-wide locks are multiprocessing locks made at import: forked from one forkserver, every
    role shared them until each took its own, and one role killed holding one blocked every other's DHT calls."""
    start_forkserver(dict(os.environ))
    context = multiprocessing.get_context("forkserver")
    held, made = context.Event(), context.Event()
    holder = context.Process(target=hold_hivemind_lock_and_wait, args=(held,))
    holder.start()
    try:
        assert held.wait(60), "the holder never took the lock"
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)
        other = context.Process(target=make_a_future, args=(made,))
        other.start()
        assert made.wait(30), "a role forked after the holder died could not make a DHT future"
        other.join(10)
    finally:
        if holder.is_alive():
            holder.kill()
