"""Worker ModelInfo / CacheInfo <-> WorkerDescription / CacheDescription.

The *_to_pb functions read attributes, so they take the worker's own dataclasses as well
as services.common.worker_info's (same fields).
"""

from __future__ import annotations

from dataclasses import fields

from services.common.convert.capabilities import capabilities_from_pb, capabilities_to_pb
from services.common.proto.pagestream.internal.v1 import worker_pb2
from services.common.worker_info import CacheInfo, ModelInfo

_MODEL_FIELDS = tuple(f.name for f in fields(ModelInfo))
_CACHE_FIELDS = tuple(f.name for f in fields(CacheInfo))


def worker_description_to_pb(info) -> worker_pb2.WorkerDescription:
    values = {name: getattr(info, name) for name in _MODEL_FIELDS}
    values["capabilities"] = capabilities_to_pb(info.capabilities)
    return worker_pb2.WorkerDescription(**values)


def worker_description_from_pb(message: worker_pb2.WorkerDescription) -> ModelInfo:
    values = {name: getattr(message, name) for name in _MODEL_FIELDS}
    values["eos_token_ids"] = tuple(values["eos_token_ids"])
    values["kv_cache_groups"] = tuple(values["kv_cache_groups"]) or (0,)
    values["capabilities"] = capabilities_from_pb(message.capabilities)
    return ModelInfo(**values)


def cache_description_to_pb(info) -> worker_pb2.CacheDescription:
    return worker_pb2.CacheDescription(**{name: getattr(info, name) for name in _CACHE_FIELDS})


def cache_description_from_pb(message: worker_pb2.CacheDescription) -> CacheInfo:
    return CacheInfo(**{name: getattr(message, name) for name in _CACHE_FIELDS})
