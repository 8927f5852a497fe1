"""A swarm across network namespaces, one of its peers behind a NAT router, trained through end to end.

    python scripts/nat_check.py [--steps 3] [--no-train] [--timeout 110] [--workdir DIR]

Builds the lab of `harness.netns_lab` (a public LAN, and a private LAN behind a masquerading router that
drops new inbound connections), then runs there:

- `swarm dht` on the public LAN (the relay of the swarm),
- `swarm peer` for stage 0 on the public LAN,
- `swarm peer` for stage 1 on the private LAN, behind the NAT: nobody can dial it,
- `swarm train --client-mode` on the public LAN,

and checks that the public peer is told it is reachable, that the peer behind NAT is told it is not
and which port to open, that it serves through a relay on the bootstrap node and answers a call from
the public LAN through it, and (unless --no-train) that the trainer trains: stage 1 has no other peer
than the one behind NAT, so every step went through it.

Some relays cut a relayed connection after its first ~128 KiB (seen in about half of the starts of
hivemind 1.1.12's libp2p daemon): the trainer's first calls then fail, and it trains once the peer
behind NAT has dialled it directly (see swarm/peer/direct_links.py); "direct_links" in the report
says whether it did.

Prints one JSON object: `ok`, or `skipped` with the reason where namespaces cannot be made here (not
root, no `ip netns`, no iptables; exit status 0), or `failures` (exit status 1).
Needs root; touches nothing of the host's network outside its own namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.netns_lab import LabUnavailable, NatLab
from swarm.launch.local_swarm import LocalSwarm

PORT = 4100  # every namespace has its own ports: the same numbers everywhere keep the logs readable
SMALL_CORPUS = str(Path(argparse.__file__))
MODEL = ["--model", "gpt-tiny", "--num-stages", "2", "--seed", "7"]


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def wait_for(condition, deadline: float, what: str, processes: dict | None = None) -> None:
    """Polls `condition` until it holds; raises TimeoutError naming `what`, or the process that died."""
    while not condition():
        for name, process in (processes or {}).items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with status {process.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def reachability_line(log: str) -> str:
    match = re.search(r"Reachability: (.*)", log)
    return match.group(1) if match else ""


def peer_id_of(log: str) -> str:
    match = re.search(r"peer id (\w+)", log)
    return match.group(1) if match else ""


async def fetch_peer_info(initial_peers: list[str], peer_id: str) -> dict:
    """A peer's counters over `/swarm/info`, from a new client (run inside a namespace by --peer-info)."""
    from hivemind.p2p import P2P, PeerID

    from swarm.net.transport import get_peer_info

    p2p = await P2P.create(initial_peers=initial_peers, dht_mode="client", no_listen=True)
    try:
        started = time.monotonic()
        info = await get_peer_info(p2p, PeerID.from_base58(peer_id), timeout=20.0)
        return {
            "stage": info.stage,
            "step": info.step,
            "requests_served": info.requests_served,
            "seconds": round(time.monotonic() - started, 2),
        }
    finally:
        await p2p.shutdown()


def run_check(steps: int, deadline: float, workdir: Path, train: bool = True) -> dict:
    lab = NatLab(tag=str(os.getpid()))
    report: dict = {"ok": False, "workdir": str(workdir), "failures": []}
    try:
        lab.build()
    except LabUnavailable as e:
        return {"ok": False, "skipped": str(e)}
    started = time.monotonic()
    try:
        with LocalSwarm(workdir) as swarm:
            _run_swarm(swarm, lab, steps, deadline, report, train)
    except (TimeoutError, RuntimeError) as e:
        report["failures"].append(str(e))
    finally:
        lab.destroy()
    report["seconds"] = round(time.monotonic() - started, 1)
    report["ok"] = not report["failures"]
    if report["failures"]:
        report["logs"] = {p.stem: read(p)[-2500:] for p in sorted(workdir.glob("*.log"))}
    return report


def _run_swarm(swarm: LocalSwarm, lab: NatLab, steps: int, deadline: float, report: dict, train: bool) -> None:
    failures = report["failures"]
    address_file = swarm.workdir / "bootstrap.addr"
    host = ["--host-maddrs", f"/ip4/0.0.0.0/tcp/{PORT}"]
    processes = {
        "bootstrap": swarm.spawn(
            "bootstrap", "dht", [*host, "--address-file", str(address_file)], prefix=lab.exec_prefix("boot")
        )
    }
    wait_for(address_file.exists, deadline, "the bootstrap node", processes)
    # only the LAN address: the node's 127.0.0.1 one means another machine from the other namespaces
    initial = [a for a in address_file.read_text().split() if f"/ip4/{lab.bootstrap_ip}/" in a]
    peer = ["peer", [*MODEL, "--initial-peers", *initial, *host, "--rebalance-period", "0", "--target-batch-size", "8"]]
    processes["public_peer"] = swarm.spawn(
        "public_peer", peer[0], [*peer[1], "--stage", "0"], prefix=lab.exec_prefix("pub")
    )
    processes["nat_peer"] = swarm.spawn("nat_peer", peer[0], [*peer[1], "--stage", "1"], prefix=lab.exec_prefix("priv"))
    logs = {name: swarm.log_path(name) for name in ("public_peer", "nat_peer", "trainer")}
    for name in ("public_peer", "nat_peer"):
        wait_for(
            lambda name=name: reachability_line(read(logs[name])), deadline, f"{name}'s reachability report", processes
        )
    public, behind = reachability_line(read(logs["public_peer"])), reachability_line(read(logs["nat_peer"]))
    report["public_peer_says"], report["nat_peer_says"] = public, behind
    if not public.startswith(f"reachable directly at /ip4/{lab.public_ip}/tcp/{PORT}"):
        failures.append(f"the public peer was not told it is reachable: {public!r}")
    if not behind.startswith("NOT reachable") or f"open TCP port {PORT}" not in behind:
        failures.append(f"the peer behind NAT was not told it is unreachable and which port to open: {behind!r}")
    relay = re.search(r"serving through relay (\S+)", behind)
    report["relay"] = relay.group(1) if relay else None
    if relay is None or f"/ip4/{lab.bootstrap_ip}/" not in relay.group(1):
        failures.append(f"the peer behind NAT serves through no relay on the bootstrap node: {behind!r}")

    wait_for(lambda: peer_id_of(read(logs["nat_peer"])), deadline, "the peer behind NAT to serve", processes)
    # from the public LAN: a new client that can reach the peer behind NAT only through the relay
    report["nat_peer_info"] = nat_peer_info(swarm, lab, logs, initial, deadline, failures)
    if (report["nat_peer_info"] or {}).get("stage") != 1:
        failures.append(f"the peer behind NAT did not answer through the relay: {report['nat_peer_info']}")
    if not train:
        return

    summary_file = swarm.workdir / "summary.json"
    trainer_flags = [
        *MODEL, "--initial-peers", *initial, "--client-mode", "--host-maddrs", "/ip4/0.0.0.0/tcp/0",
        "--steps", str(steps), "--microbatch-size", "4", "--max-in-flight", "2",
        "--data", SMALL_CORPUS, "--max-corpus-mb", "1", "--compression", "none",
        "--no-progress", "--summary-file", str(summary_file),
    ]  # fmt: skip
    trainer_started = time.monotonic()
    trainer = swarm.spawn("trainer", "train", trainer_flags, prefix=lab.exec_prefix("pub"))
    wait_for(lambda: trainer.poll() is not None, deadline, "the trainer to finish")
    report["trainer_seconds"] = round(time.monotonic() - trainer_started, 1)
    summary = json.loads(read(summary_file) or "{}")
    report["trainer"] = {key: summary.get(key) for key in ("steps", "samples", "first_loss", "last_loss", "retries")}
    report["direct_links"] = read(logs["nat_peer"]).count("Opened a direct connection to trainer")
    if trainer.returncode != 0 or summary.get("steps") != steps:
        failures.append(
            f"the trainer did not train {steps} steps (exit status {trainer.returncode}): {report['trainer']}"
        )
    counters = nat_peer_info(swarm, lab, logs, initial, deadline, failures) or {}
    report["nat_peer_info_after_training"] = counters
    # every microbatch of every step went through stage 1, and it has no other peer
    microbatches = steps * 8 // 4
    if counters.get("stage") != 1 or counters.get("requests_served", 0) < microbatches:
        failures.append(f"the peer behind NAT did not serve stage 1's calls: {counters}")


def nat_peer_info(
    swarm: LocalSwarm, lab: NatLab, logs: dict, initial: list[str], deadline: float, failures: list[str]
) -> dict | None:
    """The counters of the peer behind NAT, asked from the public LAN (so through the relay)."""
    query = [*lab.exec_prefix("pub"), sys.executable, __file__, "--peer-info", peer_id_of(read(logs["nat_peer"]))]
    try:
        done = subprocess.run(
            [*query, "--initial-peers", *initial],
            capture_output=True,
            text=True,
            timeout=max(1.0, min(40.0, deadline - time.monotonic())),
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        failures.append(f"could not read the counters of the peer behind NAT: {e}")
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps the trainer trains")
    parser.add_argument(
        "--train",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train through the peer behind NAT (--no-train: reachability, relay and a small call only)",
    )
    parser.add_argument("--timeout", type=float, default=110.0, help="seconds the whole check may take")
    parser.add_argument("--workdir", help="directory for the processes' logs (default: a temporary one)")
    parser.add_argument("--peer-info", metavar="PEER_ID", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_info:  # run inside a namespace by the check itself
        print(json.dumps(asyncio.run(fetch_peer_info(args.initial_peers, args.peer_info))), flush=True)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="swarm-nat-"))
    report = run_check(args.steps, time.monotonic() + args.timeout, workdir, args.train)
    print(json.dumps(report))
    return 1 if report.get("failures") else 0


if __name__ == "__main__":
    sys.exit(main())
