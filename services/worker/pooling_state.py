"""PoolingState: one pooling request's pooled state so far, on the worker.

It lives with the request's InputBatch slot: dropped with it (finished, aborted, or
preempted for recompute: the request comes again in full, from position 0), kept on swap.
Only the output rank reads rows into it (the Pooler), chunk by chunk: MEAN adds each
chunk's rows, CLS keeps position 0's row, LAST needs only the row that ends the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.pooling_params import PoolingParams


@dataclass(eq=False)
class PoolingState:
    params: PoolingParams
    # MEAN: the sum of the rows read so far; CLS: position 0's row  [hidden] float32
    total: torch.Tensor | None = None
    num_read: int = 0  # prompt positions read so far: where the next chunk must start

    def read(self, rows: torch.Tensor, first: int, kind: str) -> str | None:
        """Take in a chunk's rows [n, hidden] (prompt positions first..first+n-1); a
        message, reading nothing, when the chunk does not continue where the state
        stopped (positions skipped, or read twice)."""
        if kind == "LAST":
            return None  # only the last row counts (a prefix hit may skip the others)
        if first != self.num_read:
            return (
                f"its {kind} pooled state expects prompt position {self.num_read} next, "
                f"but this step's chunk starts at position {first}"
            )
        if kind == "MEAN":
            part = rows.float().sum(dim=0)  # [hidden]
            self.total = part if self.total is None else self.total + part
        elif first == 0:  # CLS
            self.total = rows[0].float().clone()  # no view: keep not the step's hidden
        self.num_read = first + rows.shape[0]
        return None

    def result(self, last_row: torch.Tensor, kind: str, num_prompt_tokens: int) -> torch.Tensor:
        """The pooled state once the prompt's last row [hidden] is read  [hidden] float32."""
        if kind == "LAST":
            return last_row.float()
        assert self.total is not None, "a pooled state finishes only after reading rows"
        if kind == "MEAN":
            return self.total / num_prompt_tokens
        return self.total
