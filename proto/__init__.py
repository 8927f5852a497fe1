"""The wire schema of swarm (`swarm.proto`) and its generated protobuf classes.

Regenerate `swarm_pb2.py` with `scripts/generate_proto.sh` after editing `swarm.proto`;
`tests/test_wire.py` fails while the two disagree.
"""

from swarm.proto import swarm_pb2
from swarm.proto.swarm_pb2 import (
    BACKWARD,
    FORWARD,
    INFER,
    CallKind,
    DirectChallenge,
    DirectHello,
    DirectProof,
    Error,
    ErrorCode,
    GradContribution,
    HeldSamples,
    MateProgress,
    MateReply,
    PeerInfo,
    PeerInfoRequest,
    Receipt,
    RoundCommit,
    RoundSlice,
    SampleId,
    SliceKind,
    StageReply,
    StageRequest,
    StateReply,
    StateRequest,
    Tensor,
    Voucher,
)

# Bump on any change to the messages or their meaning that an older peer would misread.
PROTOCOL_VERSION = 6

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INFER",
    "PROTOCOL_VERSION",
    "CallKind",
    "DirectChallenge",
    "DirectHello",
    "DirectProof",
    "Error",
    "ErrorCode",
    "GradContribution",
    "HeldSamples",
    "MateProgress",
    "MateReply",
    "PeerInfo",
    "PeerInfoRequest",
    "Receipt",
    "RoundCommit",
    "RoundSlice",
    "SampleId",
    "SliceKind",
    "StageReply",
    "StageRequest",
    "StateReply",
    "StateRequest",
    "Tensor",
    "Voucher",
    "swarm_pb2",
]
