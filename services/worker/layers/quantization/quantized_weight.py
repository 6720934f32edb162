"""`QuantizedWeight`: a linear weight [N, K] stored as group-quantized integer codes,

    w[n, k] = scales[n, k // group_size] * code[n, k] + (mins[n, k // group_size] or 0)

computed in float32. 8-bit codes are int8 [N, K]; 4-bit codes uint8 [N, K // 2], byte j
holding code 2j in its low nibble and 2j + 1 in its high one. Every operation is exact:
narrowing selects codes and scales; `cat_rows` first promotes its parts to one wider form.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SCALE_DTYPES = (torch.float16, torch.float32)
CODE_DTYPES = {4: torch.uint8, 8: torch.int8}


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [N, K] (any integer dtype, K even) -> uint8 [N, K // 2], even k low."""
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K // 2] -> the codes 0..15 as int8 [N, K] (k = 2j from byte j's low nibble)."""
    low = packed & 0x0F
    high = packed >> 4
    # [N, K // 2, 2] -> [N, K]: low then high nibble of each byte
    n, half = packed.shape
    return torch.stack((low, high), dim=-1).reshape(n, 2 * half).to(torch.int8)


def _index(value: object, name: str) -> int:
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def _check_range(start: int, size: int, length: int, what: str) -> None:
    if start < 0 or size < 0 or start + size > length:
        raise ValueError(
            f"{what} range [{start}, {start + size}) (start {start}, size {size}) "
            f"is outside 0..{length}"
        )


@dataclass(frozen=True, eq=False)  # eq=False: a generated __eq__ would compare tensors
class QuantizedWeight:
    """A linear weight [N, K] as group-quantized codes:
    w[n, k] = scales[n, k // group_size] * code[n, k] + (mins[n, k // group_size] if mins
    is not None else 0), computed in float32."""

    codes: torch.Tensor  # bits 8: int8 [N, K]; bits 4: uint8 [N, K // 2] (k = 2j low nibble)
    scales: torch.Tensor  # [N, K // group_size], float16 or float32
    mins: torch.Tensor | None  # same shape and dtype as scales, or None
    group_size: int  # divides K; K itself for one scale per output channel
    bits: int  # 4 or 8
    source: str  # the format it came from: "Q8_0", "Q4_K", "int8", "int4", "Q4_K+Q6_K", ...

    def __post_init__(self) -> None:
        self._check_codes()
        self._check_scales()
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"source must be a non-empty string, got {self.source!r}")

    def _check_codes(self) -> None:
        if self.bits not in CODE_DTYPES:
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        codes = self.codes
        if not isinstance(codes, torch.Tensor):
            raise ValueError("codes must be a torch.Tensor")
        want = CODE_DTYPES[self.bits]
        if codes.dtype != want:
            raise ValueError(f"{self.bits}-bit codes must be {want}, got {codes.dtype}")
        if codes.dim() != 2:
            raise ValueError(f"codes must be 2-D, got shape {tuple(codes.shape)}")
        k = self.shape[1]
        if k <= 0:
            raise ValueError(f"the weight needs at least one input feature, got K = {k}")
        group = self.group_size
        if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or k % group:
            raise ValueError(f"group_size {group!r} must be a positive divisor of K = {k}")

    def _check_scales(self) -> None:
        n, k = self.shape
        want = (n, k // self.group_size)
        for name in ("scales", "mins"):
            tensor = getattr(self, name)
            if tensor is None and name == "mins":
                continue
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor")
            if tensor.dtype not in SCALE_DTYPES or tuple(tensor.shape) != want:
                raise ValueError(
                    f"{name} must be float16 or float32 of shape {want} (N, K // group_size) "
                    f"for a [{n}, {k}] weight in groups of {self.group_size}, got "
                    f"{tensor.dtype} {tuple(tensor.shape)}"
                )
            if tensor.device != self.codes.device:
                raise ValueError(f"{name} on {tensor.device} but codes on {self.codes.device}")
        if self.mins is not None and self.mins.dtype != self.scales.dtype:
            raise ValueError(
                f"mins must have the scales' dtype {self.scales.dtype}, got {self.mins.dtype}"
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K): output features, input features."""
        n, stored = self.codes.shape
        return n, stored * 2 if self.bits == 4 else stored

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and mins."""
        tensors = [self.codes, self.scales] + ([self.mins] if self.mins is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def unpacked_codes(self) -> torch.Tensor:
        """The codes one per element: int8 [N, K] (4-bit codes 0..15 fit int8 too)."""
        return unpack_int4(self.codes) if self.bits == 4 else self.codes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] (the reference every kernel is held to): float32 math, then dtype."""
        n, k = self.shape
        groups = k // self.group_size
        codes = self.unpacked_codes().to(torch.float32).reshape(n, groups, self.group_size)
        w = codes * self.scales.to(torch.float32).unsqueeze(-1)  # [N, G, g]
        if self.mins is not None:
            w = w + self.mins.to(torch.float32).unsqueeze(-1)
        return w.reshape(n, k).to(dtype)

    def narrow_rows(self, start: int, size: int) -> QuantizedWeight:
        """Output features start..start + size (views of this weight's tensors)."""
        start, size = _index(start, "start"), _index(size, "size")
        _check_range(start, size, self.shape[0], "row")
        mins = self.mins.narrow(0, start, size) if self.mins is not None else None
        return QuantizedWeight(
            self.codes.narrow(0, start, size),
            self.scales.narrow(0, start, size),
            mins,
            self.group_size,
            self.bits,
            self.source,
        )

    def narrow_cols(self, start: int, size: int) -> QuantizedWeight:
        """Input features start..start + size (contiguous copies).

        start and size must be whole groups, except with one scale per output channel
        (group_size == K), where any range keeps the scales and becomes group_size == size.
        With 4-bit codes both must also be even (whole bytes).
        """
        start, size = _index(start, "start"), _index(size, "size")
        k = self.shape[1]
        _check_range(start, size, k, "column")
        if size == 0:
            raise ValueError(f"column range [{start}, {start}) is empty")
        per_channel = self.group_size == k
        if not per_channel and (start % self.group_size or size % self.group_size):
            raise ValueError(
                f"column start {start} and size {size} must be multiples of the group size "
                f"{self.group_size}"
            )
        if self.bits == 4 and (start % 2 or size % 2):
            raise ValueError(
                f"4-bit codes are packed two a byte: column start {start} and size {size} "
                "must be even"
            )
        div = 2 if self.bits == 4 else 1
        codes = self.codes[:, start // div : (start + size) // div].contiguous()
        if per_channel:
            return QuantizedWeight(codes, self.scales, self.mins, size, self.bits, self.source)
        first, count = start // self.group_size, size // self.group_size
        scales = self.scales.narrow(1, first, count).contiguous()
        mins = self.mins.narrow(1, first, count).contiguous() if self.mins is not None else None
        return QuantizedWeight(codes, scales, mins, self.group_size, self.bits, self.source)

    def promoted(
        self, bits: int, group_size: int, scale_dtype: torch.dtype, with_mins: bool
    ) -> QuantizedWeight:
        """The same weight in a wider form, every dequantized value unchanged bit for bit.

        Only widening is exact, so only widening is allowed: 4 -> 8 bits, group_size a
        divisor of this one (scales and mins repeated), float16 -> float32 scales and mins,
        no mins -> mins of -0.0 (x + -0.0 is x for every float x, so even a -0.0 product
        stays -0.0). Returns self when nothing changes.
        """
        self._check_promotion(bits, group_size, scale_dtype, with_mins)
        codes = self.codes if bits == self.bits else unpack_int4(self.codes)
        scales, mins = self.scales.to(scale_dtype), self.mins
        if mins is None and with_mins:
            mins = torch.full_like(scales, -0.0)
        elif mins is not None:
            mins = mins.to(scale_dtype)
        repeat = self.group_size // group_size
        if repeat > 1:
            scales = scales.repeat_interleave(repeat, dim=1)
            mins = mins.repeat_interleave(repeat, dim=1) if mins is not None else None
        if codes is self.codes and scales is self.scales and mins is self.mins and repeat == 1:
            return self
        return QuantizedWeight(codes, scales, mins, group_size, bits, self.source)

    def _check_promotion(
        self, bits: int, group_size: int, scale_dtype: torch.dtype, with_mins: bool
    ) -> None:
        if bits not in CODE_DTYPES or bits < self.bits:
            raise ValueError(f"cannot promote {self.bits}-bit codes to {bits} bits exactly")
        if not isinstance(group_size, int) or group_size <= 0 or self.group_size % group_size:
            raise ValueError(
                f"group size {group_size!r} must divide the current group size "
                f"{self.group_size} (only finer groups are exact)"
            )
        if scale_dtype not in SCALE_DTYPES or (
            scale_dtype == torch.float16 and self.scales.dtype == torch.float32
        ):
            raise ValueError(f"cannot convert {self.scales.dtype} scales to {scale_dtype} exactly")
        if self.mins is not None and not with_mins:
            raise ValueError("cannot drop the mins of a weight that has them")


def joined_sources(parts: Sequence[QuantizedWeight]) -> str:
    """ "+".join of the sources' unique names in order ("Q4_K+Q6_K" counts as two)."""
    names: list[str] = []
    for part in parts:
        names += [name for name in part.source.split("+") if name not in names]
    return "+".join(names)


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight:
    """The parts stacked along N (output features), exactly.

    Parts that differ in bits, group size, scale dtype or presence of mins are first
    promoted to the narrowest form holding them all: 8 bits if any part has 8, the gcd of
    the group sizes, float32 scales if any part has them, mins if any part has them. So
    `cat_rows(parts).dequantize()` equals `torch.cat([p.dequantize() for p in parts])`
    bit for bit.
    """
    parts = list(parts)
    if not parts:
        raise ValueError("cat_rows needs at least one part")
    ks = {part.shape[1] for part in parts}
    if len(ks) != 1:
        raise ValueError(f"cat_rows parts must share K (input features), got {sorted(ks)}")
    devices = {part.codes.device for part in parts}
    if len(devices) != 1:
        raise ValueError(f"cat_rows parts must be on one device, got {sorted(map(str, devices))}")
    bits = max(part.bits for part in parts)
    group_size = math.gcd(*(part.group_size for part in parts))
    fp32 = any(part.scales.dtype == torch.float32 for part in parts)
    scale_dtype = torch.float32 if fp32 else torch.float16
    with_mins = any(part.mins is not None for part in parts)
    same = [part.promoted(bits, group_size, scale_dtype, with_mins) for part in parts]
    mins = torch.cat([part.mins for part in same]) if with_mins else None  # type: ignore[misc]
    return QuantizedWeight(
        torch.cat([part.codes for part in same]),
        torch.cat([part.scales for part in same]),
        mins,
        group_size,
        bits,
        joined_sources(parts),
    )
