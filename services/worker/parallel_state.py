"""The process groups of a worker group: the only module that talks torch.distributed.

A worker group is `tp * pp` ranks, rank = pp_rank * tp + tp_rank. Each rank joins one group
over all ranks (gloo on the CPU, NCCL on CUDA) and from it its tensor-parallel group, its
pipeline group and a gloo CPU group for control. Model code calls the small functions
below, never the default group; with world size 1 they are no-ops. Every set-up call and
every collective here has a timeout: a missing rank fails the start, it never hangs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.common.rank_info import RankInfo

__all__ = ["DEFAULT_TIMEOUT_S", "RankInfo", "StageLink", "init_parallel_state"]

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class ParallelState:
    info: RankInfo
    tp_group: object | None = None
    pp_group: object | None = None
    cpu_group: object | None = None


_STATE = ParallelState(RankInfo())


def get_rank_info() -> RankInfo:
    return _STATE.info


def init_parallel_state(
    info: RankInfo,
    init_method: str,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ParallelState:
    """Join the group at `init_method` (tcp://host:port or file:///path) and build the
    TP, PP and CPU groups. World size 1 makes no group at all."""
    global _STATE
    if info.world_size == 1:
        _STATE = ParallelState(info)
        return _STATE
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    logger.info(
        "rank %d/%d joining the worker group at %s (%s)",
        info.rank,
        info.world_size,
        init_method,
        backend,
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=init_method, rank=info.rank, world_size=info.world_size,
        timeout=timeout,
    )  # fmt: skip
    _STATE = ParallelState(
        info,
        tp_group=_subgroup(info, _tp_ranks, backend, timeout),
        pp_group=_subgroup(info, _pp_ranks, backend, timeout),
        cpu_group=dist.new_group(list(range(info.world_size)), timeout=timeout, backend="gloo"),
    )
    logger.info("rank %d: process groups ready", info.rank)
    return _STATE


def _tp_ranks(info: RankInfo, index: int) -> list[int]:
    return [info.global_rank(index, t) for t in range(info.tensor_parallel_size)]


def _pp_ranks(info: RankInfo, index: int) -> list[int]:
    return [info.global_rank(p, index) for p in range(info.pipeline_parallel_size)]


def _subgroup(info: RankInfo, ranks_of, backend: str, timeout: timedelta):
    """Every rank creates every group (torch requires it) and keeps its own."""
    mine = None
    count = info.pipeline_parallel_size if ranks_of is _tp_ranks else info.tensor_parallel_size
    for index in range(count):
        ranks = ranks_of(info, index)
        group = dist.new_group(ranks, timeout=timeout, backend=backend)
        if info.rank in ranks:
            mine = group
    return mine


# ---- what model code calls -------------------------------------------------------------


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor parallel group, in place; returns x."""
    if _STATE.info.tensor_parallel_size > 1:
        dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_gather_last_dim(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate each TP rank's x along the last dim on TP rank 0; None elsewhere."""
    info = _STATE.info
    if info.tensor_parallel_size == 1:
        return x
    x = x.contiguous()
    dst = info.global_rank(info.pp_rank, 0)
    if info.tp_rank != 0:
        dist.gather(x, None, dst=dst, group=_STATE.tp_group)
        return None
    parts = [torch.empty_like(x) for _ in range(info.tensor_parallel_size)]
    dist.gather(x, parts, dst=dst, group=_STATE.tp_group)
    return torch.cat(parts, dim=-1)


class StageLink:
    """Hidden states from one pipeline stage to the next (same tp_rank), in plan order.

    Sends are asynchronous (a stage moves on to its next plan while the next stage
    computes); a send is waited for before the next one starts, so at most one is out.
    """

    def __init__(self) -> None:
        self._pending = None

    def send(self, hidden: torch.Tensor) -> None:
        info = _STATE.info
        self.wait()
        dst = info.global_rank(info.pp_rank + 1, info.tp_rank)
        self._pending = (dist.isend(hidden.contiguous(), dst=dst, group=_STATE.pp_group), hidden)

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
        info = _STATE.info
        hidden = torch.empty(shape, dtype=dtype, device=device)
        src = info.global_rank(info.pp_rank - 1, info.tp_rank)
        dist.recv(hidden, src=src, group=_STATE.pp_group)
        return hidden

    def wait(self) -> None:
        if self._pending is not None:
            work, _ = self._pending
            self._pending = None
            work.wait()
