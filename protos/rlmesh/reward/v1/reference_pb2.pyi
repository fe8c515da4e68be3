from rlmesh.common.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RefLogProbsRequest(_message.Message):
    __slots__ = ("input_ids", "response_start", "temperature", "request_id")
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_START_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    input_ids: _common_pb2.RaggedTensor
    response_start: _common_pb2.Tensor
    temperature: float
    request_id: str
    def __init__(self, input_ids: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ..., response_start: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., temperature: _Optional[float] = ..., request_id: _Optional[str] = ...) -> None: ...

class RefLogProbsResponse(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _common_pb2.RaggedTensor
    def __init__(self, logprobs: _Optional[_Union[_common_pb2.RaggedTensor, _Mapping]] = ...) -> None: ...
