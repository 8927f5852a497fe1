"""The README stays short, its links resolve, and its lab recipe runs as written.

The recipe test takes the commands of the README's lab recipe (the ```bash block after the
`<!-- recipe: lab -->` marker), changes only what a machine without GPUs or a LAN must (listed in
LAB_SUBSTITUTIONS, each required to match), and runs them with bash on 127.0.0.1: a bootstrap node,
one peer per "GPU" and a trainer, as real processes, until the trainer has trained its steps.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swarm.process.lifeline import LAUNCHER_PID_ENV

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250
SMALL_CORPUS = str(Path(__import__("argparse").__file__))  # as in conftest: present on every machine
# measured on 2 cores shared with other swarms' tests: 3 to 4 minutes (a minute of it the peers' imports). A stage
# left empty by peers started together waits for the balance rule to fill it, within a rebalance period (60 s)
RECIPE_TIMEOUT_S = 420
STEPS = 3

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def recipe(name: str) -> str:
    """The commands of the README's recipe `name`: the bash block right after `<!-- recipe: NAME -->`."""
    match = re.search(rf"<!-- recipe: {re.escape(name)} -->\n```bash\n(.*?)\n```", README.read_text(), re.S)
    assert match, f"README.md has no ```bash block right after <!-- recipe: {name} -->"
    return match.group(1)


def relative_links(path: Path) -> list[tuple[str, str]]:
    """The markdown links in `path` that point into the repository: (file, anchor); file "" for the same page."""
    links = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # a URL
        file, _, anchor = target.partition("#")
        links.append((file, anchor))
    return links


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of markdown file `path`."""
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), re.M):
        found.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    return found


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; keep it to {MAX_README_LINES}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_to_files(path):
    broken = []
    for file, anchor in relative_links(path):
        target = (path.parent / file) if file else path
        if not target.exists():
            broken.append(f"{file}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{file}#{anchor}: no such section")
    assert not broken, f"{path.relative_to(ROOT)} has broken links: {broken}"


def test_readme_links_the_docs():
    linked = {(README.parent / file).resolve() for file, _ in relative_links(README) if file}
    assert DOCS and not [d for d in DOCS if d.resolve() not in linked], "every docs/*.md is linked from the README"


def command_help(*command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "swarm", *command, "--help"], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def test_docs_name_every_command_and_setting():
    """The README's command table lists every `swarm` command, and docs/operating.md names each one's settings."""
    commands = re.findall(r"^ {4}([a-z]+) ", command_help(), re.M)
    assert "peer" in commands and "train" in commands, commands
    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    assert not [c for c in commands if f"| `swarm {c}` |" not in table], "the README's Commands table misses some"
    operating = (ROOT / "docs" / "operating.md").read_text()
    for command in commands:
        usage = command_help(command).split("\n\n", 1)[0]
        flags = set(re.findall(r"\[(--[a-z][a-z0-9-]*)", usage)) - {"--config"}
        missing = sorted(f for f in flags if not re.search(rf"`{f}[` =]", operating))
        assert not missing, f"docs/operating.md does not name these settings of swarm {command}: {missing}"


def test_quick_start_installs_and_tests_as_ci_does():
    """The quick start's install and test commands are the ones CI runs (.ci/run), in the same order."""
    ci = (ROOT / ".ci" / "run").read_text()
    lines = re.findall(r"^pip install .+$", ci, re.M)
    installs = [" ".join(word for word in line.split() if word != "--quiet") for line in lines]
    assert installs and re.search(r"^python -m pytest$", ci, re.M), ".ci/run no longer installs and tests as expected"
    install = f"python3 -m venv .venv && . .venv/bin/activate && {' && '.join(installs)} && swarm demo"
    text = README.read_text()
    assert f"```bash\n{install}\n```" in text, f"the README's quick start should install as CI does: {install}"
    assert "```bash\n. .venv/bin/activate && python -m pytest\n```" in text


# --- the lab recipe ----------------------------------------------------------------------------------


def free_ports(count: int) -> int:
    """A port P such that P..P+count-1 are free on 127.0.0.1 (the recipe numbers peer ports base + N).

    Drawn below the kernel's ephemeral range: a port it hands out on its own (to the libp2p daemons of tests
    running beside this one, say) could be taken between this check and the recipe's listening on it."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, ephemeral_low - count))
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + count):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"found no {count} free consecutive ports")


def lab_substitutions(dht_port: int, peer_port: int) -> list[tuple[str, str]]:
    """What a test without GPUs or a LAN changes in the lab recipe, and nothing else."""
    return [
        ("HEAD=10.0.0.1", "HEAD=127.0.0.1"),  # one machine: the head is this one
        ("/ip4/0.0.0.0/", "/ip4/127.0.0.1/"),  # listen on loopback only (the reachability check then skips)
        ("--device cuda:$N", "--device cpu"),  # no GPU
        ("tcp/31337", f"tcp/{dht_port}"),  # free ports instead of the recipe's fixed ones
        ("31338 + N", f"{peer_port} + N"),
        ("SWARM_MODEL=gpt-small", "SWARM_MODEL=gpt-tiny"),  # a model that trains on 2 CPU cores in seconds
        # 2 stages of 2 peers: stage-mates average, and four peers started together leave a stage empty only
        # one time in eight (the balance rule fills it within a rebalance period)
        ("SWARM_NUM_STAGES=4", "SWARM_NUM_STAGES=2"),
        ("SWARM_TARGET_BATCH_SIZE=512", "SWARM_TARGET_BATCH_SIZE=16"),
        ("--steps 10000", f"--steps {STEPS}"),
        ("--data my_corpus/", f"--data {SMALL_CORPUS}"),
    ]


def substitute(text: str, substitutions: list[tuple[str, str]]) -> str:
    for old, new in substitutions:
        assert old in text, f"the README's lab recipe no longer says {old!r}: update LAB_SUBSTITUTIONS"
        text = text.replace(old, new)
    return text


def group_members(pgid: int) -> dict[int, int]:
    """The live processes of process group `pgid`: pid -> parent pid (read from /proc)."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            state, ppid, pgrp = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                members[int(entry.name)] = int(ppid)
    return members


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def stop_group(pgid: int, timeout: float = 30.0) -> None:
    """Stops what the recipe started (process group `pgid`, made for it): SIGTERM to each role's main
    process, which stops its own DHT child and daemons in order, then SIGKILL to whatever is left."""
    members = group_members(pgid)
    for pid, ppid in members.items():
        if ppid not in members:  # a role's main process (its parent was the recipe's shell)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.3)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.timeout(RECIPE_TIMEOUT_S + 120)
def test_lab_recipe_runs_as_written(tmp_path):
    dht_port, peer_port = free_ports(1), free_ports(4)
    script = substitute(recipe("lab"), lab_substitutions(dht_port, peer_port))
    (tmp_path / "recipe.sh").write_text("set -e\n" + script + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_")}  # only the recipe's settings
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # the `swarm` of this Python
    env[LAUNCHER_PID_ENV] = str(os.getpid())  # every role leaves if this test process dies
    env["PYTHONUNBUFFERED"] = "1"
    output = tmp_path / "recipe.out"
    with open(output, "wb") as out:
        shell = subprocess.Popen(
            ["bash", str(tmp_path / "recipe.sh")],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group of its own, holding every process the recipe starts
        )
    try:
        try:
            returncode = shell.wait(RECIPE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            returncode = None
        text = output.read_text(errors="replace")
        logs = "".join(
            f"\n--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for log in sorted(tmp_path.glob("*.log"))
        )
        assert returncode is not None, f"the recipe ran past {RECIPE_TIMEOUT_S}s:\n{text[-3000:]}{logs}"
        assert returncode == 0, f"the recipe failed ({returncode}):\n{text[-3000:]}{logs}"
        assert re.search(rf"^Trained {STEPS} steps \(", text, re.M), f"the trainer did not finish:\n{text[-3000:]}"
        assert f"export SWARM_INITIAL_PEERS=/ip4/127.0.0.1/tcp/{dht_port}/p2p/" in text
        members = group_members(shell.pid)
        roles = [pid for pid, ppid in members.items() if ppid not in members]  # not their DHT children
        peers = [pid for pid in roles if "peer --device cpu" in command_line(pid)]
        assert len(peers) == 4, f"one peer per GPU of the recipe, all alive at the end; found {len(peers)}:{logs}"
    finally:
        stop_group(shell.pid)
        shell.wait(5)
