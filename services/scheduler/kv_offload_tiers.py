"""offload_index_for: the KV offload tiers' index an engine core starts with, or None.

The tiers are on when --kv-offload-dir (with room) or --kv-offload-host-bytes asks for
them, prefix caching is on, the model has one full-attention KV cache group and one
worker holds every layer (a sliding window's freed blocks and a shard per rank are not
supported: those run without tiers, said once in the log). Each tier's bound in blocks
is its bytes over a block's: the worker's bytes_per_block (a draft model's cache
included), plus a file's header on disk. With a directory, the disk tier starts with the
blocks a scan of the model's folder finds (a restart, or a reloaded model).
"""

from __future__ import annotations

import logging

from services.common import kv_block_file
from services.common.config import CacheConfig, ModelConfig
from services.common.kv_offload_identity import kv_offload_identity
from services.common.worker_info import CacheInfo, ModelInfo
from services.scheduler.kv_offload_index import KvOffloadIndex, blocks_within

logger = logging.getLogger(__name__)


def offload_index_for(
    model_config: ModelConfig, cache_config: CacheConfig, cache: CacheInfo, model: ModelInfo
) -> KvOffloadIndex | None:
    """`cache_config`: the engine's, with the workers' block size and KV cache groups."""
    if not cache_config.kv_offload_enabled:
        return None
    if (reason := _unsupported(cache_config, model)) is not None:
        logger.warning("KV offload tiers are off: %s", reason)
        return None
    disk_bytes = cache_config.kv_offload_bytes if cache_config.kv_offload_dir else 0
    index = KvOffloadIndex(
        host_blocks=blocks_within(cache_config.kv_offload_host_bytes, cache.bytes_per_block),
        disk_blocks=blocks_within(disk_bytes, kv_block_file.HEADER_BYTES + cache.bytes_per_block),
    )
    if not index.enabled:
        logger.warning(
            "KV offload tiers are off: their bytes hold no block of %d bytes",
            cache.bytes_per_block,
        )
        return None
    if cache_config.kv_offload_dir:
        _fill_from_disk(index, model_config, cache_config, model)
    return index


def _unsupported(cache_config: CacheConfig, model: ModelInfo) -> str | None:
    if not cache_config.enable_prefix_caching:
        return "they hold prefix-cache blocks, and prefix caching is off"
    if tuple(cache_config.kv_cache_groups) != (0,):
        return (
            f"the model has KV cache groups {tuple(cache_config.kv_cache_groups)} (a sliding "
            "window); the tiers hold one full-attention group's blocks"
        )
    if model.world_size > 1:
        return f"{model.world_size} ranks each hold a shard of a block; the tiers need one worker"
    return None


def _fill_from_disk(
    index: KvOffloadIndex, model_config: ModelConfig, cache_config: CacheConfig, model: ModelInfo
) -> None:
    """The disk tier starts with the model's block files in the directory (headers only:
    another model's, a truncated or malformed file is never listed)."""
    try:
        identity = kv_offload_identity(model_config, cache_config, model)
        folder = identity.directory(cache_config.kv_offload_dir or "")
        found = kv_block_file.scan(folder, identity.digest)
    except (OSError, ValueError) as exc:  # e.g. a scheduler without the model's files
        logger.warning("KV offload: not scanning %s (%s)", cache_config.kv_offload_dir, exc)
        return
    taken = index.fill_disk(found)
    logger.info("KV offload: %d blocks found in %s (%d kept)", len(found), folder, taken)
