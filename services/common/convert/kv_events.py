"""engine.proto KvEventBatch <-> services.common.kv_events.KvEventBatch."""

from __future__ import annotations

from services.common.convert.engine_io import stats_from_pb, stats_to_pb
from services.common.kv_events import KvEventBatch
from services.common.proto.pagestream.internal.v1 import engine_pb2


def kv_events_to_pb(batch: KvEventBatch) -> engine_pb2.KvEventBatch:
    message = engine_pb2.KvEventBatch(
        reset=batch.reset,
        stored=batch.stored,
        removed=batch.removed,
        block_size=batch.block_size,
        prefix_caching=batch.prefix_caching,
        stored_offloaded=batch.stored_offloaded,
        removed_offloaded=batch.removed_offloaded,
    )
    if batch.stats is not None:
        message.stats.CopyFrom(stats_to_pb(batch.stats))
    return message


def kv_events_from_pb(message: engine_pb2.KvEventBatch) -> KvEventBatch:
    return KvEventBatch(
        reset=message.reset,
        stored=list(message.stored),
        removed=list(message.removed),
        stats=stats_from_pb(message.stats) if message.HasField("stats") else None,
        block_size=message.block_size,
        prefix_caching=message.prefix_caching,
        stored_offloaded=list(message.stored_offloaded),
        removed_offloaded=list(message.removed_offloaded),
    )
