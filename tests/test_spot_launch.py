"""Spot launch (scripts/spot/): the launcher's command on AWS and GCP, read from a stand-in metadata
service on 127.0.0.1; a real peer started by the launcher that leaves on an AWS interruption notice
and comes back with the same peer id and its checkpoint; and the scripts, the systemd unit and the
image definition checked by whatever tools this machine has.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import wait_for_records

from swarm.cli import build_parser
from swarm.config import PeerConfig, load_config
from swarm.launch.local_swarm import reap
from swarm.net.identity import read_identity
from swarm.peer.checkpoint import checkpoint_path

REPO = Path(__file__).resolve().parent.parent
SPOT = REPO / "scripts" / "spot"
LAUNCHER = SPOT / "swarm-peer.sh"
UNIT = SPOT / "swarm-peer.service"
DOCKERFILE = SPOT / "Dockerfile"
SCRIPTS = sorted(SPOT.glob("*.sh"))
# settings the launcher reads itself; every other SWARM_ variable must be a `swarm peer` flag
LAUNCHER_SETTINGS = {"SWARM_CLOUD", "SWARM_PORT", "SWARM_PUBLIC_IP", "SWARM_BIN"}
BOOTSTRAP = [
    "/ip4/198.51.100.1/tcp/31337/p2p/QmXzHxsT6CqNTrUdbUtMyCNudyrzxZvQQPaVMC3g9ZEwGs",
    "/ip4/198.51.100.2/tcp/31337/p2p/QmXzHxsT6CqNTrUdbUtMyCNudyrzxZvQQPaVMC3g9ZEwGs",
]
AWS_TOKEN = "token-for-tests"


class MetadataService:
    """A stand-in for the AWS (IMDSv2) and GCP metadata services on 127.0.0.1, with their rules:
    AWS answers only with a session token got by PUT, GCP only to requests that say Metadata-Flavor.

    `aws` and `gcp` map paths (under latest/meta-data/ and computeMetadata/v1/) to values; None
    means that cloud's service is absent (404 for everything). Both may change while it runs.
    """

    def __init__(self, aws: dict[str, str] | None = None, gcp: dict[str, str] | None = None) -> None:
        self.aws, self.gcp = aws, gcp
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self) -> None:
                if service.aws is not None and self.path == "/latest/api/token":
                    if self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                        return self.reply(200, AWS_TOKEN)
                    return self.reply(400, "missing X-aws-ec2-metadata-token-ttl-seconds")
                self.reply(404, "")

            def do_GET(self) -> None:
                if service.aws is not None and self.path.startswith("/latest/meta-data/"):
                    if self.headers.get("X-aws-ec2-metadata-token") != AWS_TOKEN:
                        return self.reply(401, "")
                    value = service.aws.get(self.path[len("/latest/meta-data/") :])
                    return self.reply(404, "") if value is None else self.reply(200, value)
                if service.gcp is not None and self.path.startswith("/computeMetadata/v1/"):
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self.reply(403, "Missing Metadata-Flavor:Google header")
                    value = service.gcp.get(self.path[len("/computeMetadata/v1/") :])
                    return self.reply(404, "") if value is None else self.reply(200, value, google=True)
                self.reply(404, "")

            def reply(self, status: int, body: str, google: bool = False) -> None:
                data = body.encode()
                self.send_response(status)
                if google:
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> MetadataService:
        self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> int:
    """A port nothing listens on (connections are refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher_env(settings: dict[str, str], metadata: MetadataService | None = None) -> dict[str, str]:
    """This process's environment without its SWARM_ variables, plus `settings` and the metadata URLs."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("SWARM_")}
    base = metadata.url if metadata is not None else f"http://127.0.0.1:{closed_port()}"
    env.update(SWARM_AWS_METADATA_URL=base, SWARM_GCP_METADATA_URL=base)
    env.update(settings)
    return env


def run_launcher(settings: dict[str, str], *args: str, metadata: MetadataService | None = None, dry_run=True):
    command = ["bash", str(LAUNCHER), *(["--dry-run"] if dry_run else []), *args]
    return subprocess.run(
        command, env=launcher_env(settings, metadata), capture_output=True, text=True, timeout=60, cwd=REPO
    )


def parse_command(line: str) -> tuple[dict[str, str], list[str], PeerConfig]:
    """The variables and argv of a printed command, and the PeerConfig swarm itself makes of them."""
    tokens = shlex.split(line)
    env = {}
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    assert tokens[:2] == ["swarm", "peer"], line
    args = vars(build_parser().parse_args(tokens[1:]))
    assert args.pop("command") == "peer"
    args.pop("log_level")
    return env, tokens, load_config(PeerConfig, args, environ=env)


def dry_run(settings: dict[str, str], *args: str, metadata: MetadataService | None = None):
    result = run_launcher(settings, *args, metadata=metadata)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1, result.stdout
    return (*parse_command(lines[0]), result.stderr)


SETTINGS = {
    "SWARM_INITIAL_PEERS": ",".join(BOOTSTRAP),
    "SWARM_MODEL": "gpt-small",
    "SWARM_NUM_STAGES": "4",
    "SWARM_TARGET_BATCH_SIZE": "512",
}


def test_aws_command_from_instance_metadata():
    with MetadataService(aws={"public-ipv4": "203.0.113.7", "instance-id": "i-0abc"}) as metadata:
        env, argv, config, _ = dry_run({**SETTINGS, "SWARM_CLOUD": "aws"}, metadata=metadata)
    assert config.preemption_notice == "aws"
    assert config.checkpoint_dir == "/var/lib/swarm/checkpoints" and config.checkpoint_every == 100
    assert config.identity_path == "/var/lib/swarm/identity.key"
    assert config.initial_peers == BOOTSTRAP
    assert config.host_maddrs == ["/ip4/0.0.0.0/tcp/31338"]
    assert config.announce_maddrs == ["/ip4/203.0.113.7/tcp/31338"]  # asked with the session token
    assert config.device == ("cuda:0" if _has_gpu() else "cpu")
    # the other settings reach swarm as its own variables; the launcher's own do not
    assert (config.model, config.num_stages, config.target_batch_size) == ("gpt-small", 4, 512)
    assert "SWARM_MODEL" in env and not LAUNCHER_SETTINGS & set(env)
    # the peer polls its notice at the same service
    assert env["SWARM_AWS_METADATA_URL"] == metadata.url


def test_gcp_detected_and_its_external_ip_announced():
    gcp = {
        "instance/id": "4242",
        "instance/preempted": "FALSE",
        "instance/network-interfaces/0/access-configs/0/external-ip": "198.51.100.9",
    }
    with MetadataService(gcp=gcp) as metadata:  # SWARM_CLOUD unset: auto
        _, argv, config, _ = dry_run({**SETTINGS, "SWARM_PORT": "4001"}, "--stage", "2", metadata=metadata)
    assert config.preemption_notice == "gcp"
    assert config.host_maddrs == ["/ip4/0.0.0.0/tcp/4001"]
    assert config.announce_maddrs == ["/ip4/198.51.100.9/tcp/4001"]
    assert config.stage == "2" and argv[-2:] == ["--stage", "2"]  # extra arguments go to swarm peer


def test_aws_detected_and_settings_given_win_over_metadata(tmp_path):
    settings = {
        **SETTINGS,
        "SWARM_ANNOUNCE_MADDRS": "/dns4/peer.example.org/tcp/443",
        "SWARM_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "SWARM_CHECKPOINT_EVERY": "7",
        "SWARM_IDENTITY_PATH": str(tmp_path / "id.key"),
        "SWARM_DEVICE": "cuda:1",
        "SWARM_PREEMPTION_NOTICE": f"file:{tmp_path / 'leave'}",
    }
    with MetadataService(aws={"public-ipv4": "203.0.113.7"}) as metadata:
        env, _, config, _ = dry_run(settings, metadata=metadata)
    assert config.announce_maddrs == ["/dns4/peer.example.org/tcp/443"]
    assert config.checkpoint_dir == str(tmp_path / "ckpt") and config.checkpoint_every == 7
    assert config.identity_path == str(tmp_path / "id.key")
    assert config.device == "cuda:1"
    assert config.preemption_notice == f"file:{tmp_path / 'leave'}"
    assert "SWARM_CHECKPOINT_DIR" not in env  # folded into the flags: the command says it once


def test_no_public_ip_announces_nothing_and_says_so():
    with MetadataService(aws={}) as metadata:  # an instance in a private subnet
        _, argv, config, stderr = dry_run({**SETTINGS, "SWARM_CLOUD": "aws"}, metadata=metadata)
    assert config.announce_maddrs == [] and "--announce-maddrs" not in argv
    assert "no public IPv4" in stderr


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    return any(line.startswith("GPU") for line in listed.stdout.splitlines())


def test_device_is_the_gpu_nvidia_smi_lists(tmp_path):
    # no GPU on most test machines: a stand-in nvidia-smi that lists one, as the real one does
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    smi.chmod(0o755)
    settings = {**SETTINGS, "SWARM_CLOUD": "none", "SWARM_PUBLIC_IP": "192.0.2.1"}
    _, _, config, _ = dry_run({**settings, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert config.device == "cuda:0"
    assert config.preemption_notice == "none" and config.announce_maddrs == ["/ip4/192.0.2.1/tcp/31338"]


@pytest.mark.parametrize(
    ("settings", "code", "says"),
    [
        ({"SWARM_CLOUD": "aws", "SWARM_INITIAL_PEERS": ""}, 2, "SWARM_INITIAL_PEERS is not set"),
        ({"SWARM_CLOUD": "azure"}, 2, "SWARM_CLOUD must be aws, gcp, none or auto"),
        ({"SWARM_CLOUD": "none", "SWARM_PORT": "http"}, 2, "SWARM_PORT must be a TCP port"),
        ({"SWARM_CLOUD": "none", "SWARM_PORT": "70000"}, 2, "SWARM_PORT must be a TCP port"),
        ({}, 1, "no AWS or GCP metadata service answers"),  # auto, off any cloud
        ({"SWARM_CLOUD": "aws"}, 1, "the AWS metadata service"),
        ({"SWARM_CLOUD": "gcp"}, 1, "the GCP metadata service"),
    ],
)
def test_bad_setting_is_one_clear_line_and_nonzero_exit(settings, code, says):
    result = run_launcher({"SWARM_INITIAL_PEERS": BOOTSTRAP[0], **settings})  # no metadata service answers
    assert result.returncode == code, result
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("swarm-peer: error: "), result.stderr
    assert says in result.stderr


def test_pending_notice_means_no_start():
    aws = {"public-ipv4": "203.0.113.7", "spot/instance-action": '{"action": "terminate"}'}
    with MetadataService(aws=aws) as metadata:
        result = run_launcher({**SETTINGS, "SWARM_CLOUD": "aws"}, metadata=metadata)
    assert result.returncode == 75 and result.stdout == ""
    assert "preemption notice is pending" in result.stderr


def test_bad_peer_setting_stops_swarm_with_exit_2():
    # not a dry run: the launcher execs swarm, which refuses the value it reads from the environment;
    # exit 2 is what the unit does not restart on
    settings = {**SETTINGS, "SWARM_CLOUD": "none", "SWARM_NUM_STAGES": "0", "SWARM_BIN": _swarm_bin()}
    result = run_launcher(settings, dry_run=False)
    assert result.returncode == 2, result.stderr
    assert "swarm peer: error: --num-stages must be within" in result.stderr
    assert "Traceback" not in result.stderr


def _swarm_bin() -> str:
    return str(Path(sys.executable).with_name("swarm"))


def _start_launcher(settings: dict[str, str], metadata: MetadataService, log: Path) -> subprocess.Popen:
    with open(log, "ab") as output:
        return subprocess.Popen(
            ["bash", str(LAUNCHER)],
            env={**launcher_env(settings, metadata), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its DHT child and p2pd share the group: reaped together below
        )


def _wait_for(condition, timeout: float, what: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the peer exited ({process.returncode}) before {what}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout}s:\n{log.read_text()}"
        time.sleep(0.2)


RECORD_TTL = PeerConfig.__dataclass_fields__["record_ttl"].default


def _serving_as(peer_id: str, since: float = 0.0):
    """A check that stage 0 has a record of `peer_id` announced after wall-clock time `since`."""
    return lambda records: any(r.peer_id == peer_id and r.expiration > since + RECORD_TTL for r in records[0])


@pytest.mark.timeout(240)
def test_launched_peer_leaves_on_aws_notice_and_returns_with_its_id(local_swarm, tmp_path):
    initial_peers = local_swarm.start_bootstrap()
    port = closed_port()
    identity, checkpoints, log = tmp_path / "identity.key", tmp_path / "checkpoints", tmp_path / "peer.log"
    settings = {
        "SWARM_CLOUD": "aws",
        "SWARM_INITIAL_PEERS": ",".join(initial_peers),
        "SWARM_PORT": str(port),
        "SWARM_CHECKPOINT_DIR": str(checkpoints),
        "SWARM_IDENTITY_PATH": str(identity),
        "SWARM_BIN": _swarm_bin(),
        "SWARM_STAGE": "0",
        "SWARM_REBALANCE_PERIOD": "0",
        "SWARM_ANNOUNCE_PERIOD": "0.5",
        "SWARM_PREEMPTION_POLL": "0.5",
    }
    with MetadataService(aws={"public-ipv4": "127.0.0.1"}) as metadata:
        peer = _start_launcher(settings, metadata, log)
        try:
            _wait_for(identity.exists, 60, "identity file", peer, log)
            peer_id = read_identity(identity).peer_id
            wait_for_records(initial_peers, _serving_as(peer_id), timeout=90)
            with socket.create_connection(("127.0.0.1", port), timeout=5):  # listening on 0.0.0.0:PORT
                pass

            metadata.aws["spot/instance-action"] = '{"action": "terminate", "time": "2030-01-01T00:00:00Z"}'
            assert peer.wait(60) == 0, log.read_text()
            assert "Preemption notice received" in log.read_text()
            assert checkpoint_path(checkpoints, "gpt-tiny", 0, 3).exists()
        finally:
            reap(peer, 20)

        refused = run_launcher(settings, metadata=metadata, dry_run=False)  # the notice still stands
        assert refused.returncode == 75, refused.stderr

        del metadata.aws["spot/instance-action"]  # e.g. a stopped spot instance started again
        restarted_at = time.time()  # DHT time is wall-clock time
        peer = _start_launcher(settings, metadata, log)
        try:
            _wait_for(lambda: "Resumed stage 0 from its checkpoint" in log.read_text(), 60, "resume", peer, log)
            wait_for_records(initial_peers, _serving_as(peer_id, since=restarted_at), timeout=90)
            assert read_identity(identity).peer_id == peer_id
            peer.send_signal(signal.SIGTERM)  # what systemd sends on stop
            assert peer.wait(60) == 0, log.read_text()
        finally:
            reap(peer, 20)


# --- the scripts, the unit and the image, checked with the tools this machine has ----------------


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.name for script in SCRIPTS])
def test_shellcheck(script):
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    result = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_restarts_always_and_verifies(tmp_path):
    unit = _unit_settings()
    assert unit["Restart"] == ["always"] and unit["WantedBy"] == ["multi-user.target"]
    # the launcher's exit code for a bad setting, which restarting would only repeat
    assert unit["RestartPreventExitStatus"] == [re.search(r"EXIT_BAD_SETTING=(\d+)", LAUNCHER.read_text())[1]]
    # where install-peer.sh puts the launcher and the environment
    install = (SPOT / "install-peer.sh").read_text()
    assert unit["ExecStart"] == [re.search(r"LAUNCHER=(\S+)", install)[1]]
    venv = re.search(r"VENV=(\S+)", install)[1]
    assert f"SWARM_BIN={venv}/bin/swarm" in unit["Environment"]
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit's syntax was not verified")
    # verify checks that ExecStart exists: point it at the launcher in this checkout
    copy = tmp_path / UNIT.name
    copy.write_text(UNIT.read_text().replace(unit["ExecStart"][0], str(LAUNCHER)))
    result = subprocess.run(["systemd-analyze", "verify", str(copy)], capture_output=True, text=True, timeout=60)
    complaints = [line for line in (result.stdout + result.stderr).splitlines() if UNIT.name in line]
    assert result.returncode == 0 and not complaints, result.stdout + result.stderr


@pytest.mark.parametrize(("script", "cloud"), [("aws-user-data.sh", "aws"), ("gcp-startup.sh", "gcp")])
def test_cloud_script_settings_make_a_valid_command(script, cloud):
    text = (SPOT / script).read_text()
    block = re.search(r"<<'SETTINGS'\n(.*?)\nSETTINGS\n", text, re.S)[1]
    settings = dict(line.split("=", 1) for line in block.splitlines() if line and not line.startswith("#"))
    fields = {"SWARM_" + name.upper() for name in PeerConfig.__dataclass_fields__}
    assert set(settings) <= fields | LAUNCHER_SETTINGS, set(settings) - fields - LAUNCHER_SETTINGS
    assert settings["SWARM_CLOUD"] == cloud
    assert "install-peer.sh" in text
    # the shipped defaults, with the one setting a user must fill in
    services = {
        "aws": {"aws": {"public-ipv4": "203.0.113.7"}},
        "gcp": {
            "gcp": {"instance/id": "1", "instance/network-interfaces/0/access-configs/0/external-ip": "203.0.113.7"}
        },
    }
    with MetadataService(**services[cloud]) as metadata:
        _, _, config, _ = dry_run({**settings, "SWARM_INITIAL_PEERS": BOOTSTRAP[0]}, metadata=metadata)
    assert config.preemption_notice == cloud and config.announce_maddrs == ["/ip4/203.0.113.7/tcp/31338"]
    assert config.checkpoint_dir == "/var/lib/swarm/checkpoints"


def _dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_installs_what_the_launcher_needs(tmp_path):
    instructions = _dockerfile_instructions()
    keywords = [keyword for keyword, _ in instructions]
    assert instructions[0][0] == "FROM" and re.fullmatch(r"python:3\.1\d+-slim", instructions[0][1])
    runs = [argument for keyword, argument in instructions if keyword == "RUN"]
    torch_at = next(i for i, run in enumerate(runs) if "$TORCH" in run)
    swarm_at = next(i for i, run in enumerate(runs) if "$SWARM_SOURCE" in run)
    assert torch_at < swarm_at, "torch must be installed (pinned) before swarm"
    assert any("curl" in run for run in runs), "the launcher needs curl"
    copies = [argument.split() for keyword, argument in instructions if keyword == "COPY"]
    sources = {source: copy[-1] for copy in copies for source in copy[:-1]}
    for source in sources:
        assert (REPO / source).exists(), f"COPY {source}: no such file in the repository"
    # every package directory pyproject.toml installs is in the image
    package_dirs = set(re.findall(r'^"swarm[.\w]*" = "(\w+)"', (REPO / "pyproject.toml").read_text(), re.M))
    assert package_dirs and package_dirs <= set(sources), package_dirs - set(sources)
    entrypoint = dict(instructions)["ENTRYPOINT"]
    assert entrypoint == '["swarm-peer"]' and sources["scripts/spot/swarm-peer.sh"] == "/usr/local/bin/swarm-peer"
    assert dict(instructions)["USER"] != "root" and keywords.index("USER") > keywords.index("RUN")
    assert "/var/lib/swarm" in dict(instructions)["VOLUME"]
    # what the build context lets through is what the COPY lines take
    ignore = (SPOT / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:] for line in ignore if line.startswith("!")}
    assert set(sources) <= allowed

    # the swarm the image installs builds from exactly those files, with its command
    context = tmp_path / "context"
    for source in sources:
        target = context / source
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / source).is_dir():
            shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / source, target)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
        + [str(context)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "swarm/cli.py" in names and "swarm/peer/preemption.py" in names
    assert re.search(r"^swarm = swarm\.cli:main$", entry_points, re.M)


def _docker_works() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


@pytest.mark.timeout(1800)
def test_image_builds_and_its_entry_point_dry_runs():
    if os.environ.get("SWARM_TEST_DOCKER") != "1":
        pytest.skip("building the image takes minutes and the network: set SWARM_TEST_DOCKER=1 to run it")
    if not _docker_works():
        pytest.skip("no working Docker daemon (docker info fails)")
    tag = f"swarm-peer-test:{os.getpid()}"
    build = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "-t", tag, str(REPO)], timeout=1700)
    assert build.returncode == 0
    try:
        run = subprocess.run(
            ["docker", "run", "--rm", "-e", "SWARM_CLOUD=none", "-e", f"SWARM_INITIAL_PEERS={BOOTSTRAP[0]}"]
            + [tag, "--dry-run"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        _, _, config = parse_command(run.stdout.strip())
        assert config.checkpoint_dir == "/var/lib/swarm/checkpoints" and config.preemption_notice == "none"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)
