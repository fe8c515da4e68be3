from rlmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class WeightBackend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_BACKEND_UNSPECIFIED: _ClassVar[WeightBackend]
    WEIGHT_BACKEND_GLOO: _ClassVar[WeightBackend]
    WEIGHT_BACKEND_NCCL: _ClassVar[WeightBackend]
    WEIGHT_BACKEND_IPC: _ClassVar[WeightBackend]

class EngineKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_KIND_UNSPECIFIED: _ClassVar[EngineKind]
    ENGINE_KIND_VLLM: _ClassVar[EngineKind]
    ENGINE_KIND_HF: _ClassVar[EngineKind]

class WeightsState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHTS_STATE_UNSPECIFIED: _ClassVar[WeightsState]
    WEIGHTS_STATE_READY: _ClassVar[WeightsState]
    WEIGHTS_STATE_UPDATING: _ClassVar[WeightsState]
    WEIGHTS_STATE_INCOMPLETE: _ClassVar[WeightsState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
WEIGHT_BACKEND_UNSPECIFIED: WeightBackend
WEIGHT_BACKEND_GLOO: WeightBackend
WEIGHT_BACKEND_NCCL: WeightBackend
WEIGHT_BACKEND_IPC: WeightBackend
ENGINE_KIND_UNSPECIFIED: EngineKind
ENGINE_KIND_VLLM: EngineKind
ENGINE_KIND_HF: EngineKind
WEIGHTS_STATE_UNSPECIFIED: WeightsState
WEIGHTS_STATE_READY: WeightsState
WEIGHTS_STATE_UPDATING: WeightsState
WEIGHTS_STATE_INCOMPLETE: WeightsState

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "token_ids", "text", "chat")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    token_ids: _common_pb2.Tensor
    text: str
    chat: ChatMessages
    def __init__(self, prompt_id: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "seed", "logprobs", "ignore_eos", "return_text")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    logprobs: bool
    ignore_eos: bool
    return_text: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., return_text: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "n", "sampling", "expected_weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[Prompt]
    n: int
    sampling: SamplingOptions
    expected_weight_version: int
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[Prompt, _Mapping]]] = ..., n: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., expected_weight_version: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("prompt_id", "sample_index", "response_token_ids", "logprobs", "finish_reason", "weight_version", "prompt_token_ids", "text", "token_weight_versions")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    sample_index: int
    response_token_ids: _common_pb2.Tensor
    logprobs: _common_pb2.Tensor
    finish_reason: FinishReason
    weight_version: int
    prompt_token_ids: _common_pb2.Tensor
    text: str
    token_weight_versions: _common_pb2.Tensor
    def __init__(self, prompt_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., response_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., weight_version: _Optional[int] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., text: _Optional[str] = ..., token_weight_versions: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "world_size", "rank_offset", "group_name", "timeout_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    backend: WeightBackend
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group_name: str
    timeout_s: float
    def __init__(self, backend: _Optional[_Union[WeightBackend, str]] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., group_name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ("ranks",)
    RANKS_FIELD_NUMBER: _ClassVar[int]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class ParameterMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "bucket", "offset_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: _common_pb2.DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    bucket: int
    offset_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., bucket: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "scaling", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SCALING_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    scaling: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., scaling: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class IpcBucket(_message.Message):
    __slots__ = ("bucket", "device_uuid", "nbytes", "tensor_offset", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    device_uuid: str
    nbytes: int
    tensor_offset: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, bucket: _Optional[int] = ..., device_uuid: _Optional[str] = ..., nbytes: _Optional[int] = ..., tensor_offset: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "chunk_index", "final", "params", "bucket_bytes", "ipc_buckets", "pause_generation", "adapter")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    IPC_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    PAUSE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk_index: int
    final: bool
    params: _containers.RepeatedCompositeFieldContainer[ParameterMeta]
    bucket_bytes: _containers.RepeatedScalarFieldContainer[int]
    ipc_buckets: _containers.RepeatedCompositeFieldContainer[IpcBucket]
    pause_generation: bool
    adapter: LoraAdapter
    def __init__(self, version: _Optional[int] = ..., chunk_index: _Optional[int] = ..., final: _Optional[bool] = ..., params: _Optional[_Iterable[_Union[ParameterMeta, _Mapping]]] = ..., bucket_bytes: _Optional[_Iterable[int]] = ..., ipc_buckets: _Optional[_Iterable[_Union[IpcBucket, _Mapping]]] = ..., pause_generation: _Optional[bool] = ..., adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "weights_checksum", "received_params", "duration_s")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    weights_checksum: str
    received_params: int
    duration_s: float
    def __init__(self, weight_version: _Optional[int] = ..., weights_checksum: _Optional[str] = ..., received_params: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ("include_parameters",)
    INCLUDE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    include_parameters: bool
    def __init__(self, include_parameters: _Optional[bool] = ...) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "weight_version", "weights_checksum", "vocab_size", "engine_kind", "engine_version", "weights_dtype", "tensor_parallel_size", "weights_state", "weights_state_detail", "sleep_level", "parameters", "adapter", "lora_enabled")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_STATE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SLEEP_LEVEL_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LORA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    weight_version: int
    weights_checksum: str
    vocab_size: int
    engine_kind: EngineKind
    engine_version: str
    weights_dtype: _common_pb2.DType
    tensor_parallel_size: int
    weights_state: WeightsState
    weights_state_detail: str
    sleep_level: int
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterMeta]
    adapter: LoraAdapter
    lora_enabled: bool
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., weight_version: _Optional[int] = ..., weights_checksum: _Optional[str] = ..., vocab_size: _Optional[int] = ..., engine_kind: _Optional[_Union[EngineKind, str]] = ..., engine_version: _Optional[str] = ..., weights_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., tensor_parallel_size: _Optional[int] = ..., weights_state: _Optional[_Union[WeightsState, str]] = ..., weights_state_detail: _Optional[str] = ..., sleep_level: _Optional[int] = ..., parameters: _Optional[_Iterable[_Union[ParameterMeta, _Mapping]]] = ..., adapter: _Optional[_Union[LoraAdapter, _Mapping]] = ..., lora_enabled: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ("freed_bytes", "duration_s")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    duration_s: float
    def __init__(self, freed_bytes: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ("fully_awake", "duration_s")
    FULLY_AWAKE_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    fully_awake: bool
    duration_s: float
    def __init__(self, fully_awake: _Optional[bool] = ..., duration_s: _Optional[float] = ...) -> None: ...
