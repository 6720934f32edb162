"""RankInfo: where one worker sits in its group (pure rank arithmetic, no torch).

A worker group is tensor_parallel_size * pipeline_parallel_size ranks, rank =
pp_rank * tensor_parallel_size + tp_rank; the output rank (the one that samples) is TP
rank 0 of the last pipeline stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Where one worker sits in its group."""

    rank: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"rank must be in [0, {self.world_size}) for tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size "
                f"{self.pipeline_parallel_size}, got {self.rank}."
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_parallel_size - 1

    @property
    def is_output_rank(self) -> bool:
        """TP rank 0 of the last stage: the one rank that samples."""
        return self.is_last_stage and self.tp_rank == 0

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tensor_parallel_size + tp_rank
