"""SamplingParamsTable: per-slot sampling parameters as numpy columns.

The InputBatch keeps one slot per request it holds; each step it gathers the columns of
the rows that sample into a SamplingMetadata with a handful of vectorised numpy ops.
`build_sampling_metadata` is the same path for callers that hold plain lists.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sampling_metadata import LogitBias, SamplingMetadata, TokenMask

logger = logging.getLogger(__name__)

_GREEDY_EPS = 1e-5
_FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition")
_INT_COLUMNS = ("top_k", "min_tokens")


_FLOAT32_MAX = float(np.finfo(np.float32).max)


class SamplingParamsTable:
    """Sampling columns indexed by slot; grows on demand."""

    def __init__(self, capacity: int, vocab_size: int, eos_token_id: int | None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.capacity = 0
        self._float = {name: np.zeros(0, np.float32) for name in _FLOAT_COLUMNS}
        self._int = {name: np.zeros(0, np.int64) for name in _INT_COLUMNS}
        self._seeds: list[int | None] = []
        self._num_logprobs: list[int | None] = []
        self._logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._stop_token_ids: dict[int, np.ndarray] = {}
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        extra = capacity - self.capacity
        if extra <= 0:
            return
        for name, column in self._float.items():
            self._float[name] = np.concatenate([column, np.zeros(extra, np.float32)])
        for name, column in self._int.items():
            self._int[name] = np.concatenate([column, np.zeros(extra, np.int64)])
        self._seeds.extend([None] * extra)
        self._num_logprobs.extend([None] * extra)
        self.capacity = capacity

    def set_row(self, slot: int, params: SamplingParams) -> None:
        values = (
            params.temperature,
            params.top_p,
            params.min_p,
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
        )
        for name, value in zip(_FLOAT_COLUMNS, values, strict=True):
            self._float[name][slot] = min(max(value, -_FLOAT32_MAX), _FLOAT32_MAX)
        self._int["top_k"][slot] = min(params.top_k, self.vocab_size)
        self._int["min_tokens"][slot] = params.min_tokens
        self._seeds[slot] = params.seed
        self._num_logprobs[slot] = params.logprobs
        self._set_sparse(slot, params)

    def _set_sparse(self, slot: int, params: SamplingParams) -> None:
        self._logit_bias.pop(slot, None)
        self._stop_token_ids.pop(slot, None)
        bias = {t: b for t, b in (params.logit_bias or {}).items() if t < self.vocab_size}
        if len(bias) != len(params.logit_bias or {}):
            logger.warning("logit_bias: dropped token ids >= vocab_size %d", self.vocab_size)
        if bias:
            tokens = np.fromiter(bias.keys(), np.int64, len(bias))
            self._logit_bias[slot] = (tokens, np.fromiter(bias.values(), np.float32, len(bias)))
        stops = set(params.stop_token_ids or ())
        if self.eos_token_id is not None and not params.ignore_eos:
            stops.add(self.eos_token_id)
        stops = {t for t in stops if t < self.vocab_size}
        if params.min_tokens > 0 and stops:
            self._stop_token_ids[slot] = np.array(sorted(stops), np.int64)

    def clear_row(self, slot: int) -> None:
        self._logit_bias.pop(slot, None)
        self._stop_token_ids.pop(slot, None)
        self._seeds[slot] = None
        self._num_logprobs[slot] = None

    def make_metadata(
        self,
        slots: np.ndarray,  # [R] int64, the sampling rows' slots (repeated: one row per
        # verified position of a sequence with speculative proposals)
        token_ids: np.ndarray,  # [capacity, max_len] every slot's prompt + output ids
        num_prompt: np.ndarray,  # [R] int64 prompt tokens of each row's sequence
        num_tokens: np.ndarray,  # [R] int64 tokens before each row's position
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Row r samples the token after num_tokens[r] tokens of its slot's sequence: its
        penalties see those tokens, its min_tokens and seeded noise their output count."""

        def to_device(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        floats = {name: column[slots] for name, column in self._float.items()}
        top_k = self._int["top_k"][slots]
        num_output = num_tokens - num_prompt
        greedy = floats["temperature"] < _GREEDY_EPS
        no_penalties = bool(
            np.all(floats["presence"] == 0)
            and np.all(floats["frequency"] == 0)
            and np.all(floats["repetition"] == 1)
        )
        prompt_ids = output_ids = None
        if not no_penalties:
            prompt_ids = to_device(_padded_rows(token_ids, slots, 0, num_prompt, self.vocab_size))
            output_ids = to_device(
                _padded_rows(token_ids, slots, num_prompt, num_output, self.vocab_size)
            )
        num_logprobs = tuple(self._num_logprobs[s] for s in slots.tolist())
        requested = [k for k in num_logprobs if k is not None]
        return SamplingMetadata(
            temperature=to_device(floats["temperature"]),
            top_p=to_device(floats["top_p"]),
            top_k=to_device(top_k),
            min_p=to_device(floats["min_p"]),
            presence_penalty=to_device(floats["presence"]),
            frequency_penalty=to_device(floats["frequency"]),
            repetition_penalty=to_device(floats["repetition"]),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            logit_bias=self._gather_logit_bias(slots, device),
            min_tokens_mask=self._gather_min_tokens_mask(slots, num_output, device),
            seeds=tuple(self._seeds[s] for s in slots.tolist()),
            output_positions=tuple(num_output.tolist()),
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            no_top_k=bool(np.all(top_k == 0)),
            no_top_p=bool(np.all(floats["top_p"] >= 1.0)),
            no_min_p=bool(np.all(floats["min_p"] == 0)),
            no_penalties=no_penalties,
        )

    def _gather_logit_bias(self, slots: np.ndarray, device) -> LogitBias | None:
        if not self._logit_bias:
            return None
        rows, tokens, values = [], [], []
        for row, slot in enumerate(slots.tolist()):
            entry = self._logit_bias.get(slot)
            if entry is not None:
                rows.append(np.full(len(entry[0]), row, np.int64))
                tokens.append(entry[0])
                values.append(entry[1])
        if not rows:
            return None
        return LogitBias(
            rows=torch.from_numpy(np.concatenate(rows)).to(device),
            token_ids=torch.from_numpy(np.concatenate(tokens)).to(device),
            values=torch.from_numpy(np.concatenate(values)).to(device),
        )

    def _gather_min_tokens_mask(
        self, slots: np.ndarray, num_output: np.ndarray, device
    ) -> TokenMask | None:
        if not self._stop_token_ids:
            return None
        below = np.nonzero(num_output < self._int["min_tokens"][slots])[0]
        rows, tokens = [], []
        for row in below.tolist():
            stops = self._stop_token_ids.get(int(slots[row]))
            if stops is not None:
                rows.append(np.full(len(stops), row, np.int64))
                tokens.append(stops)
        if not rows:
            return None
        return TokenMask(
            rows=torch.from_numpy(np.concatenate(rows)).to(device),
            token_ids=torch.from_numpy(np.concatenate(tokens)).to(device),
        )


def _padded_rows(
    token_ids: np.ndarray,  # [capacity, max_len]
    slots: np.ndarray,  # [R]
    starts: np.ndarray | int,  # [R] first column of each row's span
    lengths: np.ndarray,  # [R] span lengths
    pad_id: int,
) -> np.ndarray:
    """token_ids[slot, start:start+length] per row, right-padded with pad_id: [R, max_length]."""
    width = int(lengths.max(initial=0))
    offsets = np.arange(width, dtype=np.int64)  # [W]
    cols = np.asarray(starts, np.int64).reshape(-1, 1) + offsets  # [R or 1, W]
    cols = np.broadcast_to(cols, (len(slots), width))
    valid = offsets < lengths[:, None]  # [R, W]
    gathered = token_ids[slots[:, None], np.minimum(cols, token_ids.shape[1] - 1)]
    return np.where(valid, gathered, pad_id).astype(np.int64)


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    vocab_size: int,
    eos_token_id: int | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """SamplingMetadata for rows given as lists (tests, tools); row i = params[i]."""
    num_rows = len(params)
    num_prompt = np.array([len(p) for p in prompt_token_ids], np.int64)
    num_tokens = num_prompt + np.array([len(o) for o in output_token_ids], np.int64)
    token_ids = np.zeros((num_rows, max(int(num_tokens.max(initial=0)), 1)), np.int64)
    table = SamplingParamsTable(num_rows, vocab_size, eos_token_id)
    for row in range(num_rows):
        tokens = list(prompt_token_ids[row]) + list(output_token_ids[row])
        token_ids[row, : len(tokens)] = tokens
        table.set_row(row, params[row])
    slots = np.arange(num_rows, dtype=np.int64)
    return table.make_metadata(slots, token_ids, num_prompt, num_tokens, device)
