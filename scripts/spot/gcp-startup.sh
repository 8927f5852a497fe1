#!/bin/bash
# GCE startup script: turns a spot (preemptible) VM into a swarm peer (Debian or Ubuntu images).
#
# Launch with this file as the startup script, and the peer's settings as the swarm-env attribute
# (a file of KEY=VALUE lines, like the defaults below) and swarm's git URL as swarm-repo, e.g.:
#   gcloud compute instances create swarm-peer-1 --machine-type MACHINE_TYPE \
#     --image-family IMAGE_FAMILY --image-project IMAGE_PROJECT \
#     --provisioning-model SPOT --instance-termination-action STOP --tags swarm-peer \
#     --metadata swarm-repo=GIT_URL,install-nvidia-driver=True \
#     --metadata-from-file startup-script=scripts/spot/gcp-startup.sh,swarm-env=peer.env
# GCP runs it at every boot (log: journalctl -u google-startup-scripts); it installs swarm once and
# the unit swarm-peer.service, which starts the peer at every boot with --preemption-notice gcp.
set -euo pipefail

metadata() {  # metadata NAME: an instance attribute, empty when unset
    curl --silent --fail --noproxy '*' --connect-timeout 2 -H "Metadata-Flavor: Google" \
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" || true
}

# --- settings (the swarm-repo, swarm-ref and swarm-env attributes replace them) ---------------
SWARM_REPO="$(metadata swarm-repo)"              # git URL of swarm (the project's or your fork's)
SWARM_REF="$(metadata swarm-ref)"; SWARM_REF="${SWARM_REF:-main}"
mkdir -p /etc/swarm
settings="$(metadata swarm-env)"
if [[ -n "$settings" ]]; then
    printf '%s\n' "$settings" >/etc/swarm/peer.env
else
    # The peer's settings: KEY=VALUE, no quotes; any `swarm peer` flag as SWARM_<FLAG> (see swarm-peer.sh --help).
    cat >/etc/swarm/peer.env <<'SETTINGS'
SWARM_CLOUD=gcp
SWARM_INITIAL_PEERS=
SWARM_MODEL=gpt-small
SWARM_NUM_STAGES=4
SWARM_TARGET_BATCH_SIZE=512
SWARM_PORT=31338
SWARM_CHECKPOINT_DIR=/var/lib/swarm/checkpoints
SWARM_CHECKPOINT_EVERY=100
SETTINGS
fi
# --- end of settings --------------------------------------------------------------------------

if [[ ! -d /opt/swarm/src/.git ]]; then
    [[ -n "$SWARM_REPO" ]] || { echo "gcp-startup: error: set the swarm-repo attribute to swarm's git URL" >&2; exit 1; }
    if ! command -v git >/dev/null 2>&1; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q git
    fi
    git clone --quiet "$SWARM_REPO" /opt/swarm/src
    git -C /opt/swarm/src fetch --quiet origin "$SWARM_REF"
    git -C /opt/swarm/src checkout --quiet --force FETCH_HEAD
fi
# every boot: keeps the installed environment, restarts the peer only if its settings changed
bash /opt/swarm/src/scripts/spot/install-peer.sh
