#!/bin/bash
# EC2 user data: turns a fresh spot instance into a swarm peer (Ubuntu, Debian or Amazon Linux 2023).
#
# Edit the settings below, then launch with this file as user data, e.g.:
#   aws ec2 run-instances --image-id AMI --instance-type g5.xlarge --key-name KEY \
#     --security-group-ids SG_WITH_TCP_31338_OPEN \
#     --instance-market-options 'MarketType=spot,SpotOptions={SpotInstanceType=persistent,InstanceInterruptionBehavior=stop}' \
#     --metadata-options HttpTokens=required,HttpPutResponseHopLimit=2 \
#     --user-data file://scripts/spot/aws-user-data.sh
# It runs once, at first boot (log: /var/log/cloud-init-output.log): it installs swarm from SWARM_REPO
# and the unit swarm-peer.service, which starts the peer at every boot with --preemption-notice aws.
set -euo pipefail

# --- settings ---------------------------------------------------------------------------------
SWARM_REPO=""   # git URL of swarm (the project's or your fork's)
SWARM_REF=main  # branch, tag or commit to install
mkdir -p /etc/swarm
# The peer's settings: KEY=VALUE, no quotes; any `swarm peer` flag as SWARM_<FLAG> (see swarm-peer.sh --help).
cat >/etc/swarm/peer.env <<'SETTINGS'
SWARM_CLOUD=aws
SWARM_INITIAL_PEERS=
SWARM_MODEL=gpt-small
SWARM_NUM_STAGES=4
SWARM_TARGET_BATCH_SIZE=512
SWARM_PORT=31338
SWARM_CHECKPOINT_DIR=/var/lib/swarm/checkpoints
SWARM_CHECKPOINT_EVERY=100
SETTINGS
# --- end of settings --------------------------------------------------------------------------

[[ -n "$SWARM_REPO" ]] || { echo "aws-user-data: error: set SWARM_REPO to swarm's git URL" >&2; exit 1; }
if ! command -v git >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q git
    else
        dnf install -y -q git
    fi
fi
if [[ ! -d /opt/swarm/src/.git ]]; then
    git clone --quiet "$SWARM_REPO" /opt/swarm/src
fi
git -C /opt/swarm/src fetch --quiet origin "$SWARM_REF"
git -C /opt/swarm/src checkout --quiet --force FETCH_HEAD
bash /opt/swarm/src/scripts/spot/install-peer.sh
