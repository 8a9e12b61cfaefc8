from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT32: DType

class SharedSlice(_message.Message):
    __slots__ = ("region_id", "offset")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    offset: int
    def __init__(self, region_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "shared")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    shared: SharedSlice
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., shared: _Optional[_Union[SharedSlice, _Mapping]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("dtype", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "kv_dtype", "fingerprint", "bytes_per_block")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: DType
    fingerprint: str
    bytes_per_block: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[_Union[DType, str]] = ..., fingerprint: _Optional[str] = ..., bytes_per_block: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "device", "num_blocks", "epoch", "up", "data_path")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    DATA_PATH_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device: str
    num_blocks: int
    epoch: str
    up: bool
    data_path: str
    def __init__(self, worker_id: _Optional[str] = ..., device: _Optional[str] = ..., num_blocks: _Optional[int] = ..., epoch: _Optional[str] = ..., up: _Optional[bool] = ..., data_path: _Optional[str] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("layout", "workers", "total_blocks", "capacity_tokens", "max_message_bytes", "server_version", "local_session_socket")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SESSION_SOCKET_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    total_blocks: int
    capacity_tokens: int
    max_message_bytes: int
    server_version: str
    local_session_socket: str
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., total_blocks: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., local_session_socket: _Optional[str] = ...) -> None: ...

class CreateSequenceRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "namespace", "request_id", "timeout_us")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    request_id: str
    timeout_us: int
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ..., request_id: _Optional[str] = ..., timeout_us: _Optional[int] = ...) -> None: ...

class CreateSequenceResponse(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_cached_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class ForkSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "request_id", "timeout_us")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    request_id: str
    timeout_us: int
    def __init__(self, seq_id: _Optional[str] = ..., request_id: _Optional[str] = ..., timeout_us: _Optional[int] = ...) -> None: ...

class ForkSequenceResponse(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_cached_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class FreeSequenceRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class FreeSequenceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CreateSequencesRequest(_message.Message):
    __slots__ = ("sequences", "shared_prompt_token_ids", "timeout_us")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SHARED_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[CreateSequenceRequest]
    shared_prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    timeout_us: int
    def __init__(self, sequences: _Optional[_Iterable[_Union[CreateSequenceRequest, _Mapping]]] = ..., shared_prompt_token_ids: _Optional[_Iterable[int]] = ..., timeout_us: _Optional[int] = ...) -> None: ...

class CreateSequencesResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[CreateSequenceResponse]
    def __init__(self, sequences: _Optional[_Iterable[_Union[CreateSequenceResponse, _Mapping]]] = ...) -> None: ...

class FreeSequencesRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FreeSequencesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("token_ids", "namespace")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_cached_tokens",)
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_cached_tokens: int
    def __init__(self, num_cached_tokens: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("token_ids", "namespace")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ...) -> None: ...

class PinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnpinRequest(_message.Message):
    __slots__ = ("token_ids", "namespace")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[str] = ...) -> None: ...

class UnpinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PublishPublicRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    def __init__(self, seq_id: _Optional[str] = ...) -> None: ...

class PublishPublicResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("seq_id", "layer", "token_ids", "key", "value", "key_data", "value_data", "request_id", "timeout_us")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    KEY_DATA_FIELD_NUMBER: _ClassVar[int]
    VALUE_DATA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    layer: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    key: TensorSpec
    value: TensorSpec
    key_data: bytes
    value_data: bytes
    request_id: str
    timeout_us: int
    def __init__(self, seq_id: _Optional[str] = ..., layer: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., key: _Optional[_Union[TensorSpec, _Mapping]] = ..., value: _Optional[_Union[TensorSpec, _Mapping]] = ..., key_data: _Optional[bytes] = ..., value_data: _Optional[bytes] = ..., request_id: _Optional[str] = ..., timeout_us: _Optional[int] = ...) -> None: ...

class AppendResponse(_message.Message):
    __slots__ = ("start_position", "num_tokens")
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    start_position: int
    num_tokens: int
    def __init__(self, start_position: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AttendItem(_message.Message):
    __slots__ = ("seq_id", "query")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    query: Tensor
    def __init__(self, seq_id: _Optional[str] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("layer", "items", "return_lse")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LSE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    items: _containers.RepeatedCompositeFieldContainer[AttendItem]
    return_lse: bool
    def __init__(self, layer: _Optional[int] = ..., items: _Optional[_Iterable[_Union[AttendItem, _Mapping]]] = ..., return_lse: _Optional[bool] = ...) -> None: ...

class AttendResult(_message.Message):
    __slots__ = ("output", "lse")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    lse: Tensor
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AttendResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AttendResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AttendResult, _Mapping]]] = ...) -> None: ...

class AppendAttendItem(_message.Message):
    __slots__ = ("seq_id", "token_ids", "key", "value", "query")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    key: Tensor
    value: Tensor
    query: Tensor
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AppendAttendRequest(_message.Message):
    __slots__ = ("layer", "items", "return_lse", "request_id", "timeout_us")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LSE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    layer: int
    items: _containers.RepeatedCompositeFieldContainer[AppendAttendItem]
    return_lse: bool
    request_id: str
    timeout_us: int
    def __init__(self, layer: _Optional[int] = ..., items: _Optional[_Iterable[_Union[AppendAttendItem, _Mapping]]] = ..., return_lse: _Optional[bool] = ..., request_id: _Optional[str] = ..., timeout_us: _Optional[int] = ...) -> None: ...

class AppendAttendResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[AttendResult]
    def __init__(self, results: _Optional[_Iterable[_Union[AttendResult, _Mapping]]] = ...) -> None: ...

class AppendAttendBatchRequest(_message.Message):
    __slots__ = ("layer", "seq_ids", "token_ids", "key", "value", "query", "return_lse", "output_to", "lse_to", "request_id", "timeout_us")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    RETURN_LSE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TO_FIELD_NUMBER: _ClassVar[int]
    LSE_TO_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    layer: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    key: Tensor
    value: Tensor
    query: Tensor
    return_lse: bool
    output_to: SharedSlice
    lse_to: SharedSlice
    request_id: str
    timeout_us: int
    def __init__(self, layer: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., key: _Optional[_Union[Tensor, _Mapping]] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ..., return_lse: _Optional[bool] = ..., output_to: _Optional[_Union[SharedSlice, _Mapping]] = ..., lse_to: _Optional[_Union[SharedSlice, _Mapping]] = ..., request_id: _Optional[str] = ..., timeout_us: _Optional[int] = ...) -> None: ...

class AppendAttendBatchResponse(_message.Message):
    __slots__ = ("output", "lse")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    lse: Tensor
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class AttendBatchRequest(_message.Message):
    __slots__ = ("layer", "seq_ids", "query", "return_lse", "output_to", "lse_to")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    RETURN_LSE_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TO_FIELD_NUMBER: _ClassVar[int]
    LSE_TO_FIELD_NUMBER: _ClassVar[int]
    layer: int
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    query: Tensor
    return_lse: bool
    output_to: SharedSlice
    lse_to: SharedSlice
    def __init__(self, layer: _Optional[int] = ..., seq_ids: _Optional[_Iterable[str]] = ..., query: _Optional[_Union[Tensor, _Mapping]] = ..., return_lse: _Optional[bool] = ..., output_to: _Optional[_Union[SharedSlice, _Mapping]] = ..., lse_to: _Optional[_Union[SharedSlice, _Mapping]] = ...) -> None: ...

class AttendBatchResponse(_message.Message):
    __slots__ = ("output", "lse")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    output: Tensor
    lse: Tensor
    def __init__(self, output: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("call_id", "append_attend_batch", "attend_batch", "step_lease")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_ATTEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    ATTEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_LEASE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    append_attend_batch: AppendAttendBatchRequest
    attend_batch: AttendBatchRequest
    step_lease: StepLeaseRequest
    def __init__(self, call_id: _Optional[int] = ..., append_attend_batch: _Optional[_Union[AppendAttendBatchRequest, _Mapping]] = ..., attend_batch: _Optional[_Union[AttendBatchRequest, _Mapping]] = ..., step_lease: _Optional[_Union[StepLeaseRequest, _Mapping]] = ...) -> None: ...

class StepLeaseRequest(_message.Message):
    __slots__ = ("seq_ids", "num_q_heads", "token_ids", "num_tokens", "lease_connections", "steps")
    class LeaseConnectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_Q_HEADS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_q_heads: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    lease_connections: _containers.ScalarMap[str, bytes]
    steps: int
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., num_q_heads: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., lease_connections: _Optional[_Mapping[str, bytes]] = ..., steps: _Optional[int] = ...) -> None: ...

class StepLeaseResponse(_message.Message):
    __slots__ = ("granted", "reason", "lease_id", "socket", "layers", "timeout_us", "plan", "steps")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    granted: bool
    reason: str
    lease_id: bytes
    socket: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    timeout_us: int
    plan: bytes
    steps: int
    def __init__(self, granted: _Optional[bool] = ..., reason: _Optional[str] = ..., lease_id: _Optional[bytes] = ..., socket: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., timeout_us: _Optional[int] = ..., plan: _Optional[bytes] = ..., steps: _Optional[int] = ...) -> None: ...

class CallError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("call_id", "append_attend_batch", "attend_batch", "error", "step_lease")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    APPEND_ATTEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    ATTEND_BATCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_LEASE_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    append_attend_batch: AppendAttendBatchResponse
    attend_batch: AttendBatchResponse
    error: CallError
    step_lease: StepLeaseResponse
    def __init__(self, call_id: _Optional[int] = ..., append_attend_batch: _Optional[_Union[AppendAttendBatchResponse, _Mapping]] = ..., attend_batch: _Optional[_Union[AttendBatchResponse, _Mapping]] = ..., error: _Optional[_Union[CallError, _Mapping]] = ..., step_lease: _Optional[_Union[StepLeaseResponse, _Mapping]] = ...) -> None: ...

class LocalSessionHello(_message.Message):
    __slots__ = ("authorization",)
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    authorization: str
    def __init__(self, authorization: _Optional[str] = ...) -> None: ...

class ExportBlocksRequest(_message.Message):
    __slots__ = ("seq_id", "chunk_bytes")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    chunk_bytes: int
    def __init__(self, seq_id: _Optional[str] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class ExportHeader(_message.Message):
    __slots__ = ("layout", "token_ids", "num_tokens", "block_shape", "total_bytes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout: KVLayout
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    def __init__(self, layout: _Optional[_Union[KVLayout, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ExportBlocksResponse(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ExportHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ExportHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportBlocksRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ExportHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ExportHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImportBlocksResponse(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_cached_tokens: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ListSequencesRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SequenceEntry(_message.Message):
    __slots__ = ("seq_id", "num_tokens", "written", "lost")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    num_tokens: int
    written: _containers.RepeatedScalarFieldContainer[int]
    lost: bool
    def __init__(self, seq_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., written: _Optional[_Iterable[int]] = ..., lost: _Optional[bool] = ...) -> None: ...

class ListSequencesResponse(_message.Message):
    __slots__ = ("sequences", "next_page_token")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceEntry]
    next_page_token: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceEntry, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "total_blocks", "used_blocks", "cached_free_blocks", "free_blocks", "allocated_slots", "filled_slots", "host_tier_blocks", "host_tier_used_blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    FILLED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    total_blocks: int
    used_blocks: int
    cached_free_blocks: int
    free_blocks: int
    allocated_slots: int
    filled_slots: int
    host_tier_blocks: int
    host_tier_used_blocks: int
    def __init__(self, worker_id: _Optional[str] = ..., total_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., cached_free_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., allocated_slots: _Optional[int] = ..., filled_slots: _Optional[int] = ..., host_tier_blocks: _Optional[int] = ..., host_tier_used_blocks: _Optional[int] = ...) -> None: ...

class TenantPrefixStats(_message.Message):
    __slots__ = ("tenant", "query_tokens", "hit_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    query_tokens: int
    hit_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., query_tokens: _Optional[int] = ..., hit_tokens: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("workers", "utilization", "fragmentation", "prefix", "evictions", "cow_copies", "pinned_blocks", "active_sequences", "lost_sequences", "host_hit_tokens", "host_evictions")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    COW_COPIES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LOST_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    utilization: float
    fragmentation: float
    prefix: _containers.RepeatedCompositeFieldContainer[TenantPrefixStats]
    evictions: int
    cow_copies: int
    pinned_blocks: int
    active_sequences: int
    lost_sequences: int
    host_hit_tokens: int
    host_evictions: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., utilization: _Optional[float] = ..., fragmentation: _Optional[float] = ..., prefix: _Optional[_Iterable[_Union[TenantPrefixStats, _Mapping]]] = ..., evictions: _Optional[int] = ..., cow_copies: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., active_sequences: _Optional[int] = ..., lost_sequences: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., host_evictions: _Optional[int] = ...) -> None: ...

class CreateSharedRegionRequest(_message.Message):
    __slots__ = ("size_bytes",)
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    size_bytes: int
    def __init__(self, size_bytes: _Optional[int] = ...) -> None: ...

class CreateSharedRegionResponse(_message.Message):
    __slots__ = ("region_id", "path", "size_bytes")
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    path: str
    size_bytes: int
    def __init__(self, region_id: _Optional[str] = ..., path: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ReleaseSharedRegionRequest(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: str
    def __init__(self, region_id: _Optional[str] = ...) -> None: ...

class ReleaseSharedRegionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("from_sequence", "only_new", "worker_id", "namespace", "max_batch_events")
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ONLY_NEW_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_EVENTS_FIELD_NUMBER: _ClassVar[int]
    from_sequence: int
    only_new: bool
    worker_id: str
    namespace: str
    max_batch_events: int
    def __init__(self, from_sequence: _Optional[int] = ..., only_new: _Optional[bool] = ..., worker_id: _Optional[str] = ..., namespace: _Optional[str] = ..., max_batch_events: _Optional[int] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "block_size", "worker_id", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    block_size: int
    worker_id: str
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., block_size: _Optional[int] = ..., worker_id: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "worker_id", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    worker_id: str
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., worker_id: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("sequence", "timestamp_us", "tenant", "public", "namespace", "stored", "removed", "cleared")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_US_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp_us: int
    tenant: str
    public: bool
    namespace: str
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllCleared
    def __init__(self, sequence: _Optional[int] = ..., timestamp_us: _Optional[int] = ..., tenant: _Optional[str] = ..., public: _Optional[bool] = ..., namespace: _Optional[str] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("stream_id", "events", "last_sequence", "oldest_sequence", "newest_sequence")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OLDEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NEWEST_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    last_sequence: int
    oldest_sequence: int
    newest_sequence: int
    def __init__(self, stream_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ..., last_sequence: _Optional[int] = ..., oldest_sequence: _Optional[int] = ..., newest_sequence: _Optional[int] = ...) -> None: ...
