#!/usr/bin/env bash
# Starts `swarm peer` on a spot (AWS) or preemptible (GCP) instance, or any machine.
#
# One launcher for both clouds, used by the systemd unit (swarm-peer.service) and as the container
# image's entry point. It reads its settings from the environment (the unit loads them from
# /etc/swarm/peer.env), finds out which cloud it runs on and the instance's public address from the
# cloud's metadata service, and starts `swarm peer` with the matching --preemption-notice, a
# checkpoint directory and an identity file on persistent disk, listening on 0.0.0.0 and
# announcing the public address. Any other SWARM_<FLAG> variable (SWARM_MODEL, SWARM_NUM_STAGES,
# ...) is read by `swarm peer` itself.
#
# Usage: swarm-peer.sh [--dry-run] [EXTRA SWARM PEER FLAGS...]
#   --dry-run   print the exact command (with the SWARM_ variables it passes on) and exit
#
# Exit codes: 2 for a bad setting (the unit does not restart on it), 1 when the metadata service
# cannot be reached, 75 when a preemption notice is pending (the unit tries again later).
set -euo pipefail

readonly EXIT_BAD_SETTING=2
readonly EXIT_NO_METADATA=1
readonly EXIT_PREEMPTED=75

# Settings read by this launcher only. Every other SWARM_ variable is passed on: a `swarm peer`
# flag, or SWARM_AWS_METADATA_URL / SWARM_GCP_METADATA_URL, read by the peer's notice watch too.
LAUNCHER_SETTINGS=(SWARM_CLOUD SWARM_PORT SWARM_PUBLIC_IP SWARM_BIN)
# Flags this launcher always passes; their SWARM_ variables are folded into the command line.
COMMAND_SETTINGS=(SWARM_PREEMPTION_NOTICE SWARM_CHECKPOINT_DIR SWARM_CHECKPOINT_EVERY SWARM_IDENTITY_PATH
    SWARM_INITIAL_PEERS SWARM_HOST_MADDRS SWARM_ANNOUNCE_MADDRS SWARM_DEVICE)

usage() {
    cat <<'EOF'
Usage: swarm-peer.sh [--dry-run] [EXTRA SWARM PEER FLAGS...]

Starts `swarm peer` for a spot/preemptible instance. Settings (environment variables):
  SWARM_INITIAL_PEERS     required: comma-separated multiaddrs of live swarm members (.../p2p/PEER_ID)
  SWARM_CLOUD             aws, gcp, none or auto (default: auto, asks the metadata services)
  SWARM_PORT              TCP port to listen on and announce (default: 31338)
  SWARM_PUBLIC_IP         address to announce (default: the instance's public IPv4 from the metadata)
  SWARM_ANNOUNCE_MADDRS   comma-separated multiaddrs to announce instead of /ip4/PUBLIC_IP/tcp/PORT
  SWARM_HOST_MADDRS       comma-separated multiaddrs to listen on (default: /ip4/0.0.0.0/tcp/PORT)
  SWARM_CHECKPOINT_DIR    default: /var/lib/swarm/checkpoints
  SWARM_CHECKPOINT_EVERY  save every N steps (default: 100)
  SWARM_IDENTITY_PATH     the peer's key, so its peer id survives restarts (default: /var/lib/swarm/identity.key)
  SWARM_DEVICE            torch device (default: cuda:0 when nvidia-smi sees a GPU, else cpu)
  SWARM_PREEMPTION_NOTICE default: the cloud's (aws or gcp; none elsewhere)
  SWARM_BIN               the swarm command (default: swarm)
  SWARM_AWS_METADATA_URL  default: http://169.254.169.254 (the peer polls its notice there too)
  SWARM_GCP_METADATA_URL  default: http://metadata.google.internal (likewise)
Every other SWARM_<FLAG> variable (SWARM_MODEL=gpt-small, SWARM_NUM_STAGES=4, ...) is passed on
to `swarm peer`, which reads it as --<flag>.
EOF
}

fail() {  # fail CODE MESSAGE: one clear line on stderr, then exit
    echo "swarm-peer: error: $2" >&2
    exit "$1"
}

note() {
    echo "swarm-peer: $*" >&2
}

# --- metadata services --------------------------------------------------------------------------

aws_url="${SWARM_AWS_METADATA_URL:-http://169.254.169.254}"
gcp_url="${SWARM_GCP_METADATA_URL:-http://metadata.google.internal}"
aws_token=""

# curl options for a link-local service that answers in milliseconds or not at all, never via a proxy
CURL=(curl --silent --show-error --fail --noproxy '*' --connect-timeout 1 --max-time 3)

aws_get_token() {  # IMDSv2 session token; fails where there is no AWS metadata service
    [[ -n "$aws_token" ]] && return 0
    aws_token="$("${CURL[@]}" -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" \
        "$aws_url/latest/api/token" 2>/dev/null)" && [[ -n "$aws_token" ]]
}

aws_get() {  # aws_get PATH: a metadata value (fails on 404, e.g. no public IPv4)
    "${CURL[@]}" -H "X-aws-ec2-metadata-token: $aws_token" "$aws_url/latest/meta-data/$1" 2>/dev/null
}

gcp_get() {  # gcp_get PATH: a metadata value under computeMetadata/v1/
    "${CURL[@]}" -H "Metadata-Flavor: Google" "$gcp_url/computeMetadata/v1/$1" 2>/dev/null
}

detect_cloud() {
    if aws_get_token; then
        echo aws
    elif gcp_get instance/id >/dev/null; then
        echo gcp
    else
        fail "$EXIT_NO_METADATA" "no AWS or GCP metadata service answers ($aws_url, $gcp_url); set SWARM_CLOUD=aws, gcp or none"
    fi
}

public_ip() {  # the instance's public IPv4, or nothing when it has none
    case "$1" in
        aws) aws_get public-ipv4 || true ;;
        gcp) gcp_get instance/network-interfaces/0/access-configs/0/external-ip || true ;;
        none) ;;
    esac
}

notice_pending() {  # whether the cloud has already announced this instance's interruption
    case "$1" in
        aws) aws_get spot/instance-action >/dev/null ;;
        gcp) [[ "$(gcp_get instance/preempted || true)" == TRUE ]] ;;
        *) return 1 ;;
    esac
}

# --- settings -----------------------------------------------------------------------------------

dry_run=0
extra=()
for arg in "$@"; do
    case "$arg" in
        --dry-run) dry_run=1 ;;
        -h | --help) usage; exit 0 ;;
        *) extra+=("$arg") ;;
    esac
done

# settings first, so a bad one is reported as such wherever this runs
cloud="${SWARM_CLOUD:-auto}"
case "$cloud" in
    aws | gcp | none | auto) ;;
    *) fail "$EXIT_BAD_SETTING" "SWARM_CLOUD must be aws, gcp, none or auto, got '$cloud'" ;;
esac

port="${SWARM_PORT:-31338}"
if ! [[ "$port" =~ ^[0-9]{1,5}$ ]] || ((10#$port < 1 || 10#$port > 65535)); then
    fail "$EXIT_BAD_SETTING" "SWARM_PORT must be a TCP port number (1-65535), got '$port'"
fi
port=$((10#$port))

initial_peers="${SWARM_INITIAL_PEERS:-}"
if [[ -z "$initial_peers" && " ${extra[*]-} " != *" --initial-peers "* ]]; then
    fail "$EXIT_BAD_SETTING" "SWARM_INITIAL_PEERS is not set: give the address a swarm member prints (swarm dht says 'Join with: --initial-peers /ip4/.../p2p/...'), comma-separated for several"
fi

if [[ "$cloud" == auto ]]; then
    cloud="$(detect_cloud)"
fi
if [[ "$cloud" == aws ]] && ! aws_get_token; then
    fail "$EXIT_NO_METADATA" "the AWS metadata service ($aws_url) does not answer; is this an EC2 instance (IMDSv2, hop limit 2 in a container)?"
fi
if [[ "$cloud" == gcp ]] && ! gcp_get instance/id >/dev/null; then
    fail "$EXIT_NO_METADATA" "the GCP metadata service ($gcp_url) does not answer; is this a Compute Engine instance?"
fi

if notice_pending "$cloud"; then
    note "a preemption notice is pending on this instance; not starting"
    exit "$EXIT_PREEMPTED"
fi

announce="${SWARM_ANNOUNCE_MADDRS:-}"
if [[ -z "$announce" ]]; then
    ip="${SWARM_PUBLIC_IP:-$(public_ip "$cloud")}"
    if [[ -n "$ip" ]]; then
        announce="/ip4/$ip/tcp/$port"
    else
        note "no public IPv4 found ($cloud): announcing none, so only machines that can reach this one's own addresses can join it; set SWARM_PUBLIC_IP or SWARM_ANNOUNCE_MADDRS"
    fi
fi

device="${SWARM_DEVICE:-}"
if [[ -z "$device" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
        device=cuda:0
    else
        device=cpu
    fi
fi

notice="${SWARM_PREEMPTION_NOTICE:-$cloud}"

split_list() {  # split_list "a,b" -> a b (one word each), as swarm reads a list from the environment
    local -a items
    IFS=, read -r -a items <<<"$1"
    printf '%s\n' "${items[@]}"
}

peer_command=("${SWARM_BIN:-swarm}" peer
    --preemption-notice "$notice"
    --checkpoint-dir "${SWARM_CHECKPOINT_DIR:-/var/lib/swarm/checkpoints}"
    --checkpoint-every "${SWARM_CHECKPOINT_EVERY:-100}"
    --identity-path "${SWARM_IDENTITY_PATH:-/var/lib/swarm/identity.key}"
    --device "$device")
if [[ -n "$initial_peers" ]]; then
    mapfile -t peers < <(split_list "$initial_peers")
    peer_command+=(--initial-peers "${peers[@]}")
fi
mapfile -t hosts < <(split_list "${SWARM_HOST_MADDRS:-/ip4/0.0.0.0/tcp/$port}")
peer_command+=(--host-maddrs "${hosts[@]}")
if [[ -n "$announce" ]]; then
    mapfile -t announced < <(split_list "$announce")
    peer_command+=(--announce-maddrs "${announced[@]}")
fi
peer_command+=("${extra[@]}")

# The launcher's own settings, and those folded into flags, are not passed on; every other
# SWARM_ variable is, and `swarm peer` reads it.
for name in "${LAUNCHER_SETTINGS[@]}" "${COMMAND_SETTINGS[@]}"; do
    unset "$name"
done
mapfile -t passed < <(env | grep -E '^SWARM_[A-Z0-9_]+=' | sort || true)

if ((dry_run)); then
    line="$(printf '%q ' "${passed[@]}" "${peer_command[@]}")"
    echo "${line% }"
    exit 0
fi
if ! command -v "${peer_command[0]}" >/dev/null 2>&1; then
    fail "$EXIT_BAD_SETTING" "'${peer_command[0]}' not found; install swarm or set SWARM_BIN"
fi
note "cloud $cloud; starting: ${passed[*]} ${peer_command[*]}"
exec "${peer_command[@]}"
