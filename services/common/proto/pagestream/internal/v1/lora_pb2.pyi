from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoRAAdapter(_message.Message):
    __slots__ = ("name", "id", "path", "digest", "base_model_name")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    path: str
    digest: str
    base_model_name: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., path: _Optional[str] = ..., digest: _Optional[str] = ..., base_model_name: _Optional[str] = ...) -> None: ...
