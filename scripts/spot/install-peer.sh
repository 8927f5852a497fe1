#!/usr/bin/env bash
# Installs swarm from this checkout as a systemd service on a Linux instance, and starts it.
#
# Run as root from a checkout of swarm (aws-user-data.sh and gcp-startup.sh do), after writing the
# peer's settings to /etc/swarm/peer.env. It installs the system packages (apt or dnf), a Python
# virtual environment in /opt/swarm/venv with torch and swarm, the launcher as
# /usr/local/bin/swarm-peer and the unit swarm-peer.service (enabled, so the peer starts at every
# boot and is restarted after a crash). Safe to run again: an installed environment is kept unless
# SWARM_REINSTALL=1, and a running peer is restarted only when its unit, launcher or settings changed.
#
# Settings: SWARM_TORCH (default torch==2.13.0), SWARM_TORCH_INDEX (default: the CPU-only index of
# download.pytorch.org on a machine without an NVIDIA GPU, PyPI's CUDA build otherwise),
# SWARM_REINSTALL=1 to rebuild the environment.
set -euo pipefail

readonly VENV=/opt/swarm/venv
readonly ENV_FILE=/etc/swarm/peer.env
readonly UNIT=/etc/systemd/system/swarm-peer.service
readonly LAUNCHER=/usr/local/bin/swarm-peer
readonly STAMP=/var/lib/swarm/.installed

say() {
    echo "install-peer: $*" >&2
}

fail() {
    echo "install-peer: error: $*" >&2
    exit 1
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"

[[ "$(id -u)" == 0 ]] || fail "run as root"
[[ -f "$repo/pyproject.toml" ]] || fail "$repo is not a checkout of swarm (no pyproject.toml)"
[[ -f "$ENV_FILE" ]] || fail "$ENV_FILE is missing: write the peer's settings there first (see swarm-peer.sh --help)"

has_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'
}

install_system_packages() {
    if command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q
        apt-get install -y -q python3 python3-venv git curl ca-certificates
    elif command -v dnf >/dev/null 2>&1; then
        # Amazon Linux 2023's python3 is 3.9; swarm needs 3.10 or newer
        dnf install -y -q python3.11 git curl-minimal ca-certificates || dnf install -y -q python3.11 git curl
    else
        fail "no apt-get or dnf: install Python 3.10+, git and curl yourself, then run this again"
    fi
}

find_python() {  # the newest Python 3.10+ on this machine
    local candidate
    for candidate in python3.13 python3.12 python3.11 python3.10 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    fail "no Python 3.10 or newer found"
}

install_environment() {
    local python torch_index
    python="$(find_python)"
    rm -rf "$VENV"
    "$python" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    # torch first: an unpinned torch pulled in by swarm's requirements would be a multi-GB CUDA
    # build even on a CPU-only machine
    if has_gpu; then
        torch_index="${SWARM_TORCH_INDEX:-}"
    else
        torch_index="${SWARM_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    fi
    if [[ -n "$torch_index" ]]; then
        "$VENV/bin/pip" install --quiet "${SWARM_TORCH:-torch==2.13.0}" --index-url "$torch_index"
    else
        "$VENV/bin/pip" install --quiet "${SWARM_TORCH:-torch==2.13.0}"
    fi
    "$VENV/bin/pip" install --quiet "$repo"
}

setting() {  # setting NAME: a value from the settings file, empty when unset
    (
        set -a
        # shellcheck source=/dev/null
        . "$ENV_FILE"
        printf '%s' "${!1:-}"
    )
}

if [[ "${SWARM_REINSTALL:-0}" == 1 || ! -x "$VENV/bin/swarm" ]]; then
    say "installing system packages, torch and swarm into $VENV"
    install_system_packages
    install_environment
else
    say "keeping the environment in $VENV (SWARM_REINSTALL=1 rebuilds it)"
fi

id swarm >/dev/null 2>&1 || useradd --system --home-dir /var/lib/swarm --shell /usr/sbin/nologin swarm
install -d -o swarm -g swarm -m 0750 /var/lib/swarm
for name in SWARM_CHECKPOINT_DIR SWARM_IDENTITY_PATH; do
    path="$(setting "$name")"
    if [[ -z "$path" ]]; then
        continue
    fi
    if [[ "$name" == SWARM_IDENTITY_PATH ]]; then
        path="$(dirname "$path")"
    fi
    # a directory elsewhere (e.g. a mounted persistent disk) must be the peer's to write
    install -d -o swarm -g swarm -m 0750 "$path"
done
install -m 0755 "$here/swarm-peer.sh" "$LAUNCHER"
install -m 0644 "$here/swarm-peer.service" "$UNIT"

# The command the unit will start, or why it cannot: in this script's log, before the peer starts.
# shellcheck source=/dev/null
if ! (set -a && . "$ENV_FILE" && SWARM_BIN="$VENV/bin/swarm" "$LAUNCHER" --dry-run); then
    systemctl daemon-reload
    systemctl enable swarm-peer.service
    fail "the settings in $ENV_FILE are not usable (above); fix them, then: systemctl restart swarm-peer"
fi

systemctl daemon-reload
systemctl enable swarm-peer.service
stamp="$(cat "$ENV_FILE" "$UNIT" "$LAUNCHER" "$VENV/bin/swarm" | sha256sum)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$stamp" ]]; then
    systemctl start swarm-peer.service  # a no-op when it is running already
else
    systemctl restart swarm-peer.service
    echo "$stamp" >"$STAMP"
fi
say "swarm-peer.service is running; follow it with: journalctl -u swarm-peer -f"
