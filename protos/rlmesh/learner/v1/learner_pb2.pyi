from rlmesh.common.v1 import common_pb2 as _common_pb2
from rlmesh.rollout.v1 import rollout_pb2 as _rollout_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PolicyLossType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_LOSS_TYPE_UNSPECIFIED: _ClassVar[PolicyLossType]
    POLICY_LOSS_TYPE_PPO: _ClassVar[PolicyLossType]
    POLICY_LOSS_TYPE_GSPO: _ClassVar[PolicyLossType]

class ISCorrectionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IS_CORRECTION_TYPE_UNSPECIFIED: _ClassVar[ISCorrectionType]
    IS_CORRECTION_TYPE_TIS: _ClassVar[ISCorrectionType]
    IS_CORRECTION_TYPE_ICEPOP: _ClassVar[ISCorrectionType]
    IS_CORRECTION_TYPE_SEQ_MASK_TIS: _ClassVar[ISCorrectionType]

class KLEstimator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KL_ESTIMATOR_UNSPECIFIED: _ClassVar[KLEstimator]
    KL_ESTIMATOR_K1: _ClassVar[KLEstimator]
    KL_ESTIMATOR_K2: _ClassVar[KLEstimator]
    KL_ESTIMATOR_K3: _ClassVar[KLEstimator]

class LossAggregation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_AGGREGATION_UNSPECIFIED: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_TOKEN_MEAN: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_SEQUENCE_MEAN: _ClassVar[LossAggregation]
    LOSS_AGGREGATION_SEQUENCE_SUM: _ClassVar[LossAggregation]
POLICY_LOSS_TYPE_UNSPECIFIED: PolicyLossType
POLICY_LOSS_TYPE_PPO: PolicyLossType
POLICY_LOSS_TYPE_GSPO: PolicyLossType
IS_CORRECTION_TYPE_UNSPECIFIED: ISCorrectionType
IS_CORRECTION_TYPE_TIS: ISCorrectionType
IS_CORRECTION_TYPE_ICEPOP: ISCorrectionType
IS_CORRECTION_TYPE_SEQ_MASK_TIS: ISCorrectionType
KL_ESTIMATOR_UNSPECIFIED: KLEstimator
KL_ESTIMATOR_K1: KLEstimator
KL_ESTIMATOR_K2: KLEstimator
KL_ESTIMATOR_K3: KLEstimator
LOSS_AGGREGATION_UNSPECIFIED: LossAggregation
LOSS_AGGREGATION_TOKEN_MEAN: LossAggregation
LOSS_AGGREGATION_SEQUENCE_MEAN: LossAggregation
LOSS_AGGREGATION_SEQUENCE_SUM: LossAggregation

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("pretrain", "critic_pretrain", "world_size", "zero_stage", "dtype", "train_batch_size", "micro_train_batch_size", "actor_global_step", "critic_global_step", "weight_version", "actor_num_parameters", "critic_num_parameters", "offloaded", "rank0_host", "dist_backend", "vocab_size")
    PRETRAIN_FIELD_NUMBER: _ClassVar[int]
    CRITIC_PRETRAIN_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ZERO_STAGE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MICRO_TRAIN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ACTOR_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CRITIC_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTOR_NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CRITIC_NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    RANK0_HOST_FIELD_NUMBER: _ClassVar[int]
    DIST_BACKEND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    pretrain: str
    critic_pretrain: str
    world_size: int
    zero_stage: int
    dtype: str
    train_batch_size: int
    micro_train_batch_size: int
    actor_global_step: int
    critic_global_step: int
    weight_version: int
    actor_num_parameters: int
    critic_num_parameters: int
    offloaded: bool
    rank0_host: str
    dist_backend: str
    vocab_size: int
    def __init__(self, pretrain: _Optional[str] = ..., critic_pretrain: _Optional[str] = ..., world_size: _Optional[int] = ..., zero_stage: _Optional[int] = ..., dtype: _Optional[str] = ..., train_batch_size: _Optional[int] = ..., micro_train_batch_size: _Optional[int] = ..., actor_global_step: _Optional[int] = ..., critic_global_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., actor_num_parameters: _Optional[int] = ..., critic_num_parameters: _Optional[int] = ..., offloaded: _Optional[bool] = ..., rank0_host: _Optional[str] = ..., dist_backend: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...

class LogProbsRequest(_message.Message):
    __slots__ = ("input_ids", "response_start", "temperature", "request_id", "packed")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_START_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    input_ids: _common_pb2.RaggedTensor
    response_start: _common_pb2.Tensor
    temperature: float
    request_id: str
    packed: bool
    def __init__(self, input_ids: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., response_start: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., request_id: _Optional[str] = ..., packed: _Optional[bool] = ...) -> None: ...

class LogProbsResponse(_message.Message):
    __slots__ = ("logprobs", "actor_global_step")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ACTOR_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.RaggedTensor
    actor_global_step: int
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., actor_global_step: _Optional[int] = ...) -> None: ...

class ValuesRequest(_message.Message):
    __slots__ = ("input_ids", "response_start", "request_id", "packed")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_START_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    input_ids: _common_pb2.RaggedTensor
    response_start: _common_pb2.Tensor
    request_id: str
    packed: bool
    def __init__(self, input_ids: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., response_start: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., request_id: _Optional[str] = ..., packed: _Optional[bool] = ...) -> None: ...

class ValuesResponse(_message.Message):
    __slots__ = ("values", "critic_global_step")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    CRITIC_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    values: _common_pb2.RaggedTensor
    critic_global_step: int
    def __init__(self, values: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., critic_global_step: _Optional[int] = ...) -> None: ...

class ExperienceBatch(_message.Message):
    __slots__ = ("input_ids", "response_start", "action_mask", "old_logprobs", "advantages", "ref_logprobs", "returns", "old_values", "rollout_logprobs")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_START_FIELD_NUMBER: _ClassVar[int]
    ACTION_MASK_FIELD_NUMBER: _ClassVar[int]
    OLD_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    OLD_VALUES_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    input_ids: _common_pb2.RaggedTensor
    response_start: _common_pb2.Tensor
    action_mask: _common_pb2.RaggedTensor
    old_logprobs: _common_pb2.RaggedTensor
    advantages: _common_pb2.RaggedTensor
    ref_logprobs: _common_pb2.RaggedTensor
    returns: _common_pb2.RaggedTensor
    old_values: _common_pb2.RaggedTensor
    rollout_logprobs: _common_pb2.RaggedTensor
    def __init__(self, input_ids: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., response_start: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., action_mask: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., old_logprobs: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., advantages: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., ref_logprobs: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., returns: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., old_values: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ...) -> None: ...

class ActorLoss(_message.Message):
    __slots__ = ("policy_loss_type", "eps_clip_low", "eps_clip_high", "dual_clip", "kl_coef", "kl_estimator", "entropy_coef", "loss_aggregation", "temperature", "policy_loss_aggregation", "tis_cap", "tis_low", "is_correction_type", "aux_loss_coef")
    POLICY_LOSS_TYPE_FIELD_NUMBER: _ClassVar[int]
    EPS_CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    EPS_CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    DUAL_CLIP_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    KL_ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_COEF_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    POLICY_LOSS_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    TIS_LOW_FIELD_NUMBER: _ClassVar[int]
    IS_CORRECTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_COEF_FIELD_NUMBER: _ClassVar[int]
    policy_loss_type: PolicyLossType
    eps_clip_low: float
    eps_clip_high: float
    dual_clip: float
    kl_coef: float
    kl_estimator: KLEstimator
    entropy_coef: float
    loss_aggregation: LossAggregation
    temperature: float
    policy_loss_aggregation: LossAggregation
    tis_cap: float
    tis_low: float
    is_correction_type: ISCorrectionType
    aux_loss_coef: float
    def __init__(self, policy_loss_type: _Optional[_Union[PolicyLossType, str]] = ..., eps_clip_low: _Optional[float] = ..., eps_clip_high: _Optional[float] = ..., dual_clip: _Optional[float] = ..., kl_coef: _Optional[float] = ..., kl_estimator: _Optional[_Union[KLEstimator, str]] = ..., entropy_coef: _Optional[float] = ..., loss_aggregation: _Optional[_Union[LossAggregation, str]] = ..., temperature: _Optional[float] = ..., policy_loss_aggregation: _Optional[_Union[LossAggregation, str]] = ..., tis_cap: _Optional[float] = ..., tis_low: _Optional[float] = ..., is_correction_type: _Optional[_Union[ISCorrectionType, str]] = ..., aux_loss_coef: _Optional[float] = ...) -> None: ...

class TrainActorRequest(_message.Message):
    __slots__ = ("batch", "loss", "max_epochs", "shuffle_seed", "request_id")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    batch: ExperienceBatch
    loss: ActorLoss
    max_epochs: int
    shuffle_seed: int
    request_id: str
    def __init__(self, batch: _Optional[_Union[ExperienceBatch, _Mapping]] = ..., loss: _Optional[_Union[ActorLoss, _Mapping]] = ..., max_epochs: _Optional[int] = ..., shuffle_seed: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class TrainActorResponse(_message.Message):
    __slots__ = ("policy_loss", "kl_loss", "entropy", "clip_ratio", "ppo_kl", "grad_norm", "learning_rate", "optimizer_steps", "skipped_steps", "tokens", "actor_global_step", "duration_s", "tis_weight_mean", "rollout_kl", "aux_loss")
    POLICY_LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_LOSS_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    CLIP_RATIO_FIELD_NUMBER: _ClassVar[int]
    PPO_KL_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTOR_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    TIS_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_KL_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_FIELD_NUMBER: _ClassVar[int]
    policy_loss: float
    kl_loss: float
    entropy: float
    clip_ratio: float
    ppo_kl: float
    grad_norm: float
    learning_rate: float
    optimizer_steps: int
    skipped_steps: int
    tokens: int
    actor_global_step: int
    duration_s: float
    tis_weight_mean: float
    rollout_kl: float
    aux_loss: float
    def __init__(self, policy_loss: _Optional[float] = ..., kl_loss: _Optional[float] = ..., entropy: _Optional[float] = ..., clip_ratio: _Optional[float] = ..., ppo_kl: _Optional[float] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ..., optimizer_steps: _Optional[int] = ..., skipped_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., actor_global_step: _Optional[int] = ..., duration_s: _Optional[float] = ..., tis_weight_mean: _Optional[float] = ..., rollout_kl: _Optional[float] = ..., aux_loss: _Optional[float] = ...) -> None: ...

class TrainCriticRequest(_message.Message):
    __slots__ = ("batch", "value_clip", "loss_aggregation", "max_epochs", "shuffle_seed", "request_id", "aux_loss_coef")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_FIELD_NUMBER: _ClassVar[int]
    LOSS_AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    MAX_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_SEED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_COEF_FIELD_NUMBER: _ClassVar[int]
    batch: ExperienceBatch
    value_clip: float
    loss_aggregation: LossAggregation
    max_epochs: int
    shuffle_seed: int
    request_id: str
    aux_loss_coef: float
    def __init__(self, batch: _Optional[_Union[ExperienceBatch, _Mapping]] = ..., value_clip: _Optional[float] = ..., loss_aggregation: _Optional[_Union[LossAggregation, str]] = ..., max_epochs: _Optional[int] = ..., shuffle_seed: _Optional[int] = ..., request_id: _Optional[str] = ..., aux_loss_coef: _Optional[float] = ...) -> None: ...

class TrainCriticResponse(_message.Message):
    __slots__ = ("value_loss", "values_mean", "value_clip_ratio", "grad_norm", "learning_rate", "optimizer_steps", "skipped_steps", "tokens", "critic_global_step", "duration_s", "aux_loss")
    VALUE_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALUES_MEAN_FIELD_NUMBER: _ClassVar[int]
    VALUE_CLIP_RATIO_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STEPS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CRITIC_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    AUX_LOSS_FIELD_NUMBER: _ClassVar[int]
    value_loss: float
    values_mean: float
    value_clip_ratio: float
    grad_norm: float
    learning_rate: float
    optimizer_steps: int
    skipped_steps: int
    tokens: int
    critic_global_step: int
    duration_s: float
    aux_loss: float
    def __init__(self, value_loss: _Optional[float] = ..., values_mean: _Optional[float] = ..., value_clip_ratio: _Optional[float] = ..., grad_norm: _Optional[float] = ..., learning_rate: _Optional[float] = ..., optimizer_steps: _Optional[int] = ..., skipped_steps: _Optional[int] = ..., tokens: _Optional[int] = ..., critic_global_step: _Optional[int] = ..., duration_s: _Optional[float] = ..., aux_loss: _Optional[float] = ...) -> None: ...

class InitWeightTransferRequest(_message.Message):
    __slots__ = ("backend", "master_address", "master_port", "world_size", "group_name", "timeout_s")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    backend: _rollout_pb2.WeightBackend
    master_address: str
    master_port: int
    world_size: int
    group_name: str
    timeout_s: float
    def __init__(self, backend: _Optional[_Union[_rollout_pb2.WeightBackend, str]] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., group_name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class InitWeightTransferResponse(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class PushWeightsStart(_message.Message):
    __slots__ = ("version", "weights_dtype", "bucket_bytes", "buckets_per_chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_dtype: _common_pb2.DType
    bucket_bytes: int
    buckets_per_chunk: int
    def __init__(self, version: _Optional[int] = ..., weights_dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., bucket_bytes: _Optional[int] = ..., buckets_per_chunk: _Optional[int] = ...) -> None: ...

class PushWeightsAck(_message.Message):
    __slots__ = ("chunk_index",)
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    chunk_index: int
    def __init__(self, chunk_index: _Optional[int] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("start", "ack")
    START_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    start: PushWeightsStart
    ack: PushWeightsAck
    def __init__(self, start: _Optional[_Union[PushWeightsStart, _Mapping]] = ..., ack: _Optional[_Union[PushWeightsAck, _Mapping]] = ...) -> None: ...

class PushWeightsDone(_message.Message):
    __slots__ = ("version", "weights_checksum", "bytes", "num_params", "num_buckets", "duration_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    weights_checksum: str
    bytes: int
    num_params: int
    num_buckets: int
    duration_s: float
    def __init__(self, version: _Optional[int] = ..., weights_checksum: _Optional[str] = ..., bytes: _Optional[int] = ..., num_params: _Optional[int] = ..., num_buckets: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("chunk", "done")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    chunk: PushWeightsChunk
    done: PushWeightsDone
    def __init__(self, chunk: _Optional[_Union[PushWeightsChunk, _Mapping]] = ..., done: _Optional[_Union[PushWeightsDone, _Mapping]] = ...) -> None: ...

class PushWeightsChunk(_message.Message):
    __slots__ = ("update",)
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    update: _rollout_pb2.UpdateWeightsRequest
    def __init__(self, update: _Optional[_Union[_rollout_pb2.UpdateWeightsRequest, _Mapping]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("ckpt_path", "global_step", "client_state", "max_ckpt_num", "request_id")
    CKPT_PATH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_FIELD_NUMBER: _ClassVar[int]
    MAX_CKPT_NUM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ckpt_path: str
    global_step: int
    client_state: bytes
    max_ckpt_num: int
    request_id: str
    def __init__(self, ckpt_path: _Optional[str] = ..., global_step: _Optional[int] = ..., client_state: _Optional[bytes] = ..., max_ckpt_num: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "removed", "duration_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    removed: _containers.RepeatedScalarFieldContainer[str]
    duration_s: float
    def __init__(self, path: _Optional[str] = ..., removed: _Optional[_Iterable[str]] = ..., duration_s: _Optional[float] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("ckpt_path", "global_step", "load_optimizer_states", "request_id")
    CKPT_PATH_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    LOAD_OPTIMIZER_STATES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ckpt_path: str
    global_step: int
    load_optimizer_states: bool
    request_id: str
    def __init__(self, ckpt_path: _Optional[str] = ..., global_step: _Optional[int] = ..., load_optimizer_states: _Optional[bool] = ..., request_id: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("global_step", "path", "client_state", "actor_global_step", "duration_s")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_FIELD_NUMBER: _ClassVar[int]
    ACTOR_GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    path: str
    client_state: bytes
    actor_global_step: int
    duration_s: float
    def __init__(self, global_step: _Optional[int] = ..., path: _Optional[str] = ..., client_state: _Optional[bytes] = ..., actor_global_step: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class ExportHFRequest(_message.Message):
    __slots__ = ("output_dir", "dtype", "critic")
    OUTPUT_DIR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CRITIC_FIELD_NUMBER: _ClassVar[int]
    output_dir: str
    dtype: _common_pb2.DType
    critic: bool
    def __init__(self, output_dir: _Optional[str] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., critic: _Optional[bool] = ...) -> None: ...

class ExportHFResponse(_message.Message):
    __slots__ = ("path", "bytes", "duration_s")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    duration_s: float
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., duration_s: _Optional[float] = ...) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OffloadResponse(_message.Message):
    __slots__ = ("moved", "duration_s")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    moved: bool
    duration_s: float
    def __init__(self, moved: _Optional[bool] = ..., duration_s: _Optional[float] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("moved", "duration_s")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    moved: bool
    duration_s: float
    def __init__(self, moved: _Optional[bool] = ..., duration_s: _Optional[float] = ...) -> None: ...
