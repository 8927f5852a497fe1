#!/usr/bin/env bash
# Regenerates proto/swarm_pb2.py from proto/swarm.proto (needs the test extras: grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto proto/swarm.proto
