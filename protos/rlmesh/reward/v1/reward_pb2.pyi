from rlmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Sample(_message.Message):
    __slots__ = ("sample_id", "prompt", "response", "query", "label", "data_source", "extra_info")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt: str
    response: str
    query: str
    label: str
    data_source: str
    extra_info: str
    def __init__(self, sample_id: _Optional[str] = ..., prompt: _Optional[str] = ..., response: _Optional[str] = ..., query: _Optional[str] = ..., label: _Optional[str] = ..., data_source: _Optional[str] = ..., extra_info: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("samples", "prompt_token_ids", "response_token_ids", "request_id")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    prompt_token_ids: _common_pb2.RaggedTensor
    response_token_ids: _common_pb2.RaggedTensor
    request_id: str
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., prompt_token_ids: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., response_token_ids: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("rewards", "scores", "extra_metrics", "sample_ids", "source", "batch_metrics")
    class ExtraMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...
    class BatchMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: BatchMetric
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[BatchMetric, _Mapping]] = ...) -> None: ...
    REWARDS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_METRICS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    BATCH_METRICS_FIELD_NUMBER: _ClassVar[int]
    rewards: _common_pb2.Tensor
    scores: _common_pb2.Tensor
    extra_metrics: _containers.MessageMap[str, _common_pb2.Tensor]
    sample_ids: _containers.RepeatedScalarFieldContainer[str]
    source: str
    batch_metrics: _containers.MessageMap[str, BatchMetric]
    def __init__(self, rewards: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., scores: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., extra_metrics: _Optional[_Mapping[str, _common_pb2.Tensor]] = ..., sample_ids: _Optional[_Iterable[str]] = ..., source: _Optional[str] = ..., batch_metrics: _Optional[_Mapping[str, BatchMetric]] = ...) -> None: ...

class BatchMetric(_message.Message):
    __slots__ = ("weighted_sum", "samples")
    WEIGHTED_SUM_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    weighted_sum: float
    samples: int
    def __init__(self, weighted_sum: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class GetRewardInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRewardInfoResponse(_message.Message):
    __slots__ = ("source", "description", "requires_labels", "requires_token_ids", "clip_low", "clip_high")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_LABELS_FIELD_NUMBER: _ClassVar[int]
    REQUIRES_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIP_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_HIGH_FIELD_NUMBER: _ClassVar[int]
    source: str
    description: str
    requires_labels: bool
    requires_token_ids: bool
    clip_low: float
    clip_high: float
    def __init__(self, source: _Optional[str] = ..., description: _Optional[str] = ..., requires_labels: _Optional[bool] = ..., requires_token_ids: _Optional[bool] = ..., clip_low: _Optional[float] = ..., clip_high: _Optional[float] = ...) -> None: ...
