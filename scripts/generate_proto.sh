#!/usr/bin/env bash
# Regenerates the generated protobuf code in proto/ from its .proto files (needs the test extras: grpcio-tools).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto proto/swarm.proto proto/reachability.proto
