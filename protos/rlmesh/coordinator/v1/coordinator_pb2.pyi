from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_STARTING: _ClassVar[Phase]
    PHASE_GENERATING: _ClassVar[Phase]
    PHASE_SCORING: _ClassVar[Phase]
    PHASE_TRAINING: _ClassVar[Phase]
    PHASE_PUSHING_WEIGHTS: _ClassVar[Phase]
    PHASE_CHECKPOINTING: _ClassVar[Phase]
    PHASE_IDLE: _ClassVar[Phase]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_STARTING: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_PAUSED: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]

class ServiceHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_HEALTH_UNSPECIFIED: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_SERVING: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_NOT_SERVING: _ClassVar[ServiceHealth]
    SERVICE_HEALTH_UNREACHABLE: _ClassVar[ServiceHealth]
PHASE_UNSPECIFIED: Phase
PHASE_STARTING: Phase
PHASE_GENERATING: Phase
PHASE_SCORING: Phase
PHASE_TRAINING: Phase
PHASE_PUSHING_WEIGHTS: Phase
PHASE_CHECKPOINTING: Phase
PHASE_IDLE: Phase
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_STARTING: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_PAUSED: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_FAILED: RunState
SERVICE_HEALTH_UNSPECIFIED: ServiceHealth
SERVICE_HEALTH_SERVING: ServiceHealth
SERVICE_HEALTH_NOT_SERVING: ServiceHealth
SERVICE_HEALTH_UNREACHABLE: ServiceHealth

class ServiceStatus(_message.Message):
    __slots__ = ("role", "index", "address", "health", "weight_version", "detail", "state", "restarts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    index: int
    address: str
    health: ServiceHealth
    weight_version: int
    detail: str
    state: str
    restarts: int
    def __init__(self, role: _Optional[str] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., health: _Optional[_Union[ServiceHealth, str]] = ..., weight_version: _Optional[int] = ..., detail: _Optional[str] = ..., state: _Optional[str] = ..., restarts: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("global_step", "total_steps", "episode", "phase", "state", "services", "run_dir", "last_checkpoint_step", "weight_version", "elapsed_s", "error", "placement", "shape")
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    total_steps: int
    episode: int
    phase: Phase
    state: RunState
    services: _containers.RepeatedCompositeFieldContainer[ServiceStatus]
    run_dir: str
    last_checkpoint_step: int
    weight_version: int
    elapsed_s: float
    error: str
    placement: str
    shape: RunShape
    def __init__(self, global_step: _Optional[int] = ..., total_steps: _Optional[int] = ..., episode: _Optional[int] = ..., phase: _Optional[_Union[Phase, str]] = ..., state: _Optional[_Union[RunState, str]] = ..., services: _Optional[_Iterable[_Union[ServiceStatus, _Mapping]]] = ..., run_dir: _Optional[str] = ..., last_checkpoint_step: _Optional[int] = ..., weight_version: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., error: _Optional[str] = ..., placement: _Optional[str] = ..., shape: _Optional[_Union[RunShape, _Mapping]] = ...) -> None: ...

class RunShape(_message.Message):
    __slots__ = ("rollout_engines", "planned_rollout_engines", "learner_ranks", "planned_learner_ranks", "reward_instances", "planned_reward_instances", "reference_instances", "planned_reference_instances", "reshapes", "elastic", "left_out")
    ROLLOUT_ENGINES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ROLLOUT_ENGINES_FIELD_NUMBER: _ClassVar[int]
    LEARNER_RANKS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_LEARNER_RANKS_FIELD_NUMBER: _ClassVar[int]
    REWARD_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_REWARD_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    PLANNED_REFERENCE_INSTANCES_FIELD_NUMBER: _ClassVar[int]
    RESHAPES_FIELD_NUMBER: _ClassVar[int]
    ELASTIC_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    rollout_engines: int
    planned_rollout_engines: int
    learner_ranks: int
    planned_learner_ranks: int
    reward_instances: int
    planned_reward_instances: int
    reference_instances: int
    planned_reference_instances: int
    reshapes: int
    elastic: bool
    left_out: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rollout_engines: _Optional[int] = ..., planned_rollout_engines: _Optional[int] = ..., learner_ranks: _Optional[int] = ..., planned_learner_ranks: _Optional[int] = ..., reward_instances: _Optional[int] = ..., planned_reward_instances: _Optional[int] = ..., reference_instances: _Optional[int] = ..., planned_reference_instances: _Optional[int] = ..., reshapes: _Optional[int] = ..., elastic: _Optional[bool] = ..., left_out: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamMetricsRequest(_message.Message):
    __slots__ = ("since_step",)
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    since_step: int
    def __init__(self, since_step: _Optional[int] = ...) -> None: ...

class StreamMetricsResponse(_message.Message):
    __slots__ = ("global_step", "unix_time", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    GLOBAL_STEP_FIELD_NUMBER: _ClassVar[int]
    UNIX_TIME_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    global_step: int
    unix_time: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, global_step: _Optional[int] = ..., unix_time: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("state", "pause_after_step")
    STATE_FIELD_NUMBER: _ClassVar[int]
    PAUSE_AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    pause_after_step: int
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., pause_after_step: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    def __init__(self, state: _Optional[_Union[RunState, str]] = ...) -> None: ...

class StopRequest(_message.Message):
    __slots__ = ("skip_checkpoint", "wait")
    SKIP_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    skip_checkpoint: bool
    wait: bool
    def __init__(self, skip_checkpoint: _Optional[bool] = ..., wait: _Optional[bool] = ...) -> None: ...

class StopResponse(_message.Message):
    __slots__ = ("state", "final_step", "checkpoint_step")
    STATE_FIELD_NUMBER: _ClassVar[int]
    FINAL_STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    state: RunState
    final_step: int
    checkpoint_step: int
    def __init__(self, state: _Optional[_Union[RunState, str]] = ..., final_step: _Optional[int] = ..., checkpoint_step: _Optional[int] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("role", "replicas", "add_addresses", "remove_addresses")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    ADD_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    REMOVE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    role: str
    replicas: int
    add_addresses: _containers.RepeatedScalarFieldContainer[str]
    remove_addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, role: _Optional[str] = ..., replicas: _Optional[int] = ..., add_addresses: _Optional[_Iterable[str]] = ..., remove_addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("addresses", "added", "removed")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, addresses: _Optional[_Iterable[str]] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...
