from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CallKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CALL_KIND_UNSPECIFIED: _ClassVar[CallKind]
    FORWARD: _ClassVar[CallKind]
    BACKWARD: _ClassVar[CallKind]
    INFER: _ClassVar[CallKind]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[ErrorCode]
    BAD_REQUEST: _ClassVar[ErrorCode]
    VERSION_MISMATCH: _ClassVar[ErrorCode]
    WRONG_STAGE: _ClassVar[ErrorCode]
    TOO_LARGE: _ClassVar[ErrorCode]
    UNAVAILABLE: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    STALE: _ClassVar[ErrorCode]
    OUT_OF_SYNC: _ClassVar[ErrorCode]
    SHORT: _ClassVar[ErrorCode]
    FORBIDDEN: _ClassVar[ErrorCode]
    SESSION_LOST: _ClassVar[ErrorCode]

class SliceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLICE_KIND_UNSPECIFIED: _ClassVar[SliceKind]
    PART: _ClassVar[SliceKind]
    REDUCED: _ClassVar[SliceKind]
    FAILED: _ClassVar[SliceKind]
    FETCH: _ClassVar[SliceKind]
CALL_KIND_UNSPECIFIED: CallKind
FORWARD: CallKind
BACKWARD: CallKind
INFER: CallKind
OK: ErrorCode
BAD_REQUEST: ErrorCode
VERSION_MISMATCH: ErrorCode
WRONG_STAGE: ErrorCode
TOO_LARGE: ErrorCode
UNAVAILABLE: ErrorCode
INTERNAL: ErrorCode
STALE: ErrorCode
OUT_OF_SYNC: ErrorCode
SHORT: ErrorCode
FORBIDDEN: ErrorCode
SESSION_LOST: ErrorCode
SLICE_KIND_UNSPECIFIED: SliceKind
PART: SliceKind
REDUCED: SliceKind
FAILED: SliceKind
FETCH: SliceKind

class SampleId(_message.Message):
    __slots__ = ("trainer", "microbatch", "samples")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    microbatch: int
    samples: int
    def __init__(self, trainer: _Optional[str] = ..., microbatch: _Optional[int] = ..., samples: _Optional[int] = ...) -> None: ...

class Voucher(_message.Message):
    __slots__ = ("name", "public_key", "signature")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    name: str
    public_key: bytes
    signature: bytes
    def __init__(self, name: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("trainer", "microbatch", "samples", "stage", "step", "peer", "public_key", "signature")
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    microbatch: int
    samples: int
    stage: int
    step: int
    peer: str
    public_key: bytes
    signature: bytes
    def __init__(self, trainer: _Optional[str] = ..., microbatch: _Optional[int] = ..., samples: _Optional[int] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., peer: _Optional[str] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("buffer", "shape", "dtype", "codec", "num_parts", "shared_offset", "shared_length")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    SHARED_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHARED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    buffer: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    codec: str
    num_parts: int
    shared_offset: int
    shared_length: int
    def __init__(self, buffer: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., codec: _Optional[str] = ..., num_parts: _Optional[int] = ..., shared_offset: _Optional[int] = ..., shared_length: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class StageRequest(_message.Message):
    __slots__ = ("protocol_version", "kind", "model", "stage", "microbatch_id", "step", "tensors", "more", "deadline_s", "reply_codec", "receipt", "voucher", "check", "session", "position", "end_session")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    MICROBATCH_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    REPLY_CODEC_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    VOUCHER_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    END_SESSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    kind: CallKind
    model: str
    stage: int
    microbatch_id: int
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    more: bool
    deadline_s: float
    reply_codec: str
    receipt: Receipt
    voucher: Voucher
    check: bool
    session: str
    position: int
    end_session: bool
    def __init__(self, protocol_version: _Optional[int] = ..., kind: _Optional[_Union[CallKind, str]] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., microbatch_id: _Optional[int] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., more: _Optional[bool] = ..., deadline_s: _Optional[float] = ..., reply_codec: _Optional[str] = ..., receipt: _Optional[_Union[Receipt, _Mapping]] = ..., voucher: _Optional[_Union[Voucher, _Mapping]] = ..., check: _Optional[bool] = ..., session: _Optional[str] = ..., position: _Optional[int] = ..., end_session: _Optional[bool] = ...) -> None: ...

class StageReply(_message.Message):
    __slots__ = ("protocol_version", "error", "step", "tensors", "loss", "num_samples", "more", "server_seconds", "short_step", "lost_peers", "lost", "full")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHORT_STEP_FIELD_NUMBER: _ClassVar[int]
    LOST_PEERS_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    error: Error
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    loss: float
    num_samples: int
    more: bool
    server_seconds: float
    short_step: int
    lost_peers: _containers.RepeatedScalarFieldContainer[str]
    lost: _containers.RepeatedCompositeFieldContainer[SampleId]
    full: bool
    def __init__(self, protocol_version: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., loss: _Optional[float] = ..., num_samples: _Optional[int] = ..., more: _Optional[bool] = ..., server_seconds: _Optional[float] = ..., short_step: _Optional[int] = ..., lost_peers: _Optional[_Iterable[str]] = ..., lost: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ..., full: _Optional[bool] = ...) -> None: ...

class PeerInfoRequest(_message.Message):
    __slots__ = ("protocol_version",)
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    def __init__(self, protocol_version: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("protocol_version", "error", "model", "stage", "num_stages", "step", "throughput", "queue_length", "state", "samples_accumulated", "target_batch_size", "stale_gradients", "requests_served", "resyncs", "samples_stepped", "abandoned_calls", "fingerprint", "samples_lost", "samples_doubled", "divergences", "step_state", "refused_outsiders", "unconfirmed_states", "busy_seconds", "duplicate_backwards", "receipts", "vouchers", "inference_seconds", "inference_requests", "inference_sessions", "inference_delay_p99", "inference_delay_max")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    THROUGHPUT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_ACCUMULATED_FIELD_NUMBER: _ClassVar[int]
    TARGET_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STALE_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_STEPPED_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_LOST_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_DOUBLED_FIELD_NUMBER: _ClassVar[int]
    DIVERGENCES_FIELD_NUMBER: _ClassVar[int]
    STEP_STATE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_OUTSIDERS_FIELD_NUMBER: _ClassVar[int]
    UNCONFIRMED_STATES_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_BACKWARDS_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    VOUCHERS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_DELAY_P99_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_DELAY_MAX_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    error: Error
    model: str
    stage: int
    num_stages: int
    step: int
    throughput: float
    queue_length: int
    state: str
    samples_accumulated: int
    target_batch_size: int
    stale_gradients: int
    requests_served: int
    resyncs: int
    samples_stepped: int
    abandoned_calls: int
    fingerprint: str
    samples_lost: int
    samples_doubled: int
    divergences: int
    step_state: str
    refused_outsiders: int
    unconfirmed_states: int
    busy_seconds: float
    duplicate_backwards: int
    receipts: _containers.RepeatedCompositeFieldContainer[Receipt]
    vouchers: _containers.RepeatedCompositeFieldContainer[Voucher]
    inference_seconds: float
    inference_requests: int
    inference_sessions: int
    inference_delay_p99: float
    inference_delay_max: float
    def __init__(self, protocol_version: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., num_stages: _Optional[int] = ..., step: _Optional[int] = ..., throughput: _Optional[float] = ..., queue_length: _Optional[int] = ..., state: _Optional[str] = ..., samples_accumulated: _Optional[int] = ..., target_batch_size: _Optional[int] = ..., stale_gradients: _Optional[int] = ..., requests_served: _Optional[int] = ..., resyncs: _Optional[int] = ..., samples_stepped: _Optional[int] = ..., abandoned_calls: _Optional[int] = ..., fingerprint: _Optional[str] = ..., samples_lost: _Optional[int] = ..., samples_doubled: _Optional[int] = ..., divergences: _Optional[int] = ..., step_state: _Optional[str] = ..., refused_outsiders: _Optional[int] = ..., unconfirmed_states: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., duplicate_backwards: _Optional[int] = ..., receipts: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., vouchers: _Optional[_Iterable[_Union[Voucher, _Mapping]]] = ..., inference_seconds: _Optional[float] = ..., inference_requests: _Optional[int] = ..., inference_sessions: _Optional[int] = ..., inference_delay_p99: _Optional[float] = ..., inference_delay_max: _Optional[float] = ...) -> None: ...

class MateProgress(_message.Message):
    __slots__ = ("protocol_version", "model", "stage", "step", "samples", "held", "fingerprint", "receipts", "vouchers", "dropped")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    VOUCHERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: str
    stage: int
    step: int
    samples: int
    held: _containers.RepeatedCompositeFieldContainer[SampleId]
    fingerprint: str
    receipts: _containers.RepeatedCompositeFieldContainer[Receipt]
    vouchers: _containers.RepeatedCompositeFieldContainer[Voucher]
    dropped: _containers.RepeatedCompositeFieldContainer[SampleId]
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., held: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., receipts: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., vouchers: _Optional[_Iterable[_Union[Voucher, _Mapping]]] = ..., dropped: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ...) -> None: ...

class GradContribution(_message.Message):
    __slots__ = ("protocol_version", "model", "stage", "step", "samples", "members", "tensors", "more", "handover", "attempt", "held", "known", "give_up", "norm", "receipts", "vouchers", "dropped")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    GIVE_UP_FIELD_NUMBER: _ClassVar[int]
    NORM_FIELD_NUMBER: _ClassVar[int]
    RECEIPTS_FIELD_NUMBER: _ClassVar[int]
    VOUCHERS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: str
    stage: int
    step: int
    samples: int
    members: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    more: bool
    handover: bool
    attempt: int
    held: _containers.RepeatedCompositeFieldContainer[SampleId]
    known: _containers.RepeatedCompositeFieldContainer[SampleId]
    give_up: bool
    norm: float
    receipts: _containers.RepeatedCompositeFieldContainer[Receipt]
    vouchers: _containers.RepeatedCompositeFieldContainer[Voucher]
    dropped: _containers.RepeatedCompositeFieldContainer[SampleId]
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., samples: _Optional[int] = ..., members: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., more: _Optional[bool] = ..., handover: _Optional[bool] = ..., attempt: _Optional[int] = ..., held: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ..., known: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ..., give_up: _Optional[bool] = ..., norm: _Optional[float] = ..., receipts: _Optional[_Iterable[_Union[Receipt, _Mapping]]] = ..., vouchers: _Optional[_Iterable[_Union[Voucher, _Mapping]]] = ..., dropped: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ...) -> None: ...

class RoundCommit(_message.Message):
    __slots__ = ("protocol_version", "model", "stage", "step", "attempt", "contributors")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: str
    stage: int
    step: int
    attempt: int
    contributors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., contributors: _Optional[_Iterable[str]] = ...) -> None: ...

class HeldSamples(_message.Message):
    __slots__ = ("peer", "ids")
    PEER_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    peer: str
    ids: _containers.RepeatedCompositeFieldContainer[SampleId]
    def __init__(self, peer: _Optional[str] = ..., ids: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ...) -> None: ...

class MateReply(_message.Message):
    __slots__ = ("protocol_version", "error", "step", "tensors", "more")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    error: Error
    step: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    more: bool
    def __init__(self, protocol_version: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., step: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("protocol_version", "model", "stage", "deltas", "from_step")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: str
    stage: int
    deltas: bool
    from_step: int
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., deltas: _Optional[bool] = ..., from_step: _Optional[int] = ...) -> None: ...

class StateReply(_message.Message):
    __slots__ = ("protocol_version", "error", "step", "has_optimizer_state", "tensors", "more", "samples_stepped", "progress", "held", "attempt", "recently_summed", "delta_samples", "held_next")
    class ProgressEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_STEPPED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RECENTLY_SUMMED_FIELD_NUMBER: _ClassVar[int]
    DELTA_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    HELD_NEXT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    error: Error
    step: int
    has_optimizer_state: bool
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    more: bool
    samples_stepped: int
    progress: _containers.ScalarMap[str, int]
    held: _containers.RepeatedCompositeFieldContainer[HeldSamples]
    attempt: int
    recently_summed: _containers.RepeatedCompositeFieldContainer[SampleId]
    delta_samples: _containers.RepeatedScalarFieldContainer[int]
    held_next: _containers.RepeatedCompositeFieldContainer[HeldSamples]
    def __init__(self, protocol_version: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., step: _Optional[int] = ..., has_optimizer_state: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., more: _Optional[bool] = ..., samples_stepped: _Optional[int] = ..., progress: _Optional[_Mapping[str, int]] = ..., held: _Optional[_Iterable[_Union[HeldSamples, _Mapping]]] = ..., attempt: _Optional[int] = ..., recently_summed: _Optional[_Iterable[_Union[SampleId, _Mapping]]] = ..., delta_samples: _Optional[_Iterable[int]] = ..., held_next: _Optional[_Iterable[_Union[HeldSamples, _Mapping]]] = ...) -> None: ...

class DirectHello(_message.Message):
    __slots__ = ("protocol_version", "protocol", "nonce", "public_key", "ephemeral_key", "session", "shared_memory", "shared_token", "cipher")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CIPHER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    protocol: str
    nonce: bytes
    public_key: bytes
    ephemeral_key: bytes
    session: bytes
    shared_memory: str
    shared_token: bytes
    cipher: str
    def __init__(self, protocol_version: _Optional[int] = ..., protocol: _Optional[str] = ..., nonce: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., ephemeral_key: _Optional[bytes] = ..., session: _Optional[bytes] = ..., shared_memory: _Optional[str] = ..., shared_token: _Optional[bytes] = ..., cipher: _Optional[str] = ...) -> None: ...

class DirectChallenge(_message.Message):
    __slots__ = ("protocol_version", "error", "nonce", "public_key", "ephemeral_key", "session", "proof", "shared_memory", "shared_token", "cipher")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SHARED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CIPHER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    error: Error
    nonce: bytes
    public_key: bytes
    ephemeral_key: bytes
    session: bytes
    proof: bytes
    shared_memory: str
    shared_token: bytes
    cipher: str
    def __init__(self, protocol_version: _Optional[int] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., nonce: _Optional[bytes] = ..., public_key: _Optional[bytes] = ..., ephemeral_key: _Optional[bytes] = ..., session: _Optional[bytes] = ..., proof: _Optional[bytes] = ..., shared_memory: _Optional[str] = ..., shared_token: _Optional[bytes] = ..., cipher: _Optional[str] = ...) -> None: ...

class DirectProof(_message.Message):
    __slots__ = ("proof", "shared_memory")
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    proof: bytes
    shared_memory: bool
    def __init__(self, proof: _Optional[bytes] = ..., shared_memory: _Optional[bool] = ...) -> None: ...

class RoundSlice(_message.Message):
    __slots__ = ("protocol_version", "model", "stage", "step", "attempt", "kind", "index", "count", "contributors", "tensors", "more", "slice_norms", "audit_seeds", "audits")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    SLICE_NORMS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_SEEDS_FIELD_NUMBER: _ClassVar[int]
    AUDITS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model: str
    stage: int
    step: int
    attempt: int
    kind: SliceKind
    index: int
    count: int
    contributors: bytes
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    more: bool
    slice_norms: _containers.RepeatedScalarFieldContainer[float]
    audit_seeds: _containers.RepeatedScalarFieldContainer[int]
    audits: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, protocol_version: _Optional[int] = ..., model: _Optional[str] = ..., stage: _Optional[int] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., kind: _Optional[_Union[SliceKind, str]] = ..., index: _Optional[int] = ..., count: _Optional[int] = ..., contributors: _Optional[bytes] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., more: _Optional[bool] = ..., slice_norms: _Optional[_Iterable[float]] = ..., audit_seeds: _Optional[_Iterable[int]] = ..., audits: _Optional[_Iterable[float]] = ...) -> None: ...
