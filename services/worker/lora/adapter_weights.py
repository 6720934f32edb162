"""AdapterWeights: one PEFT adapter's tensors as this rank applies them.

Per (layer, HF module): A [r, in] and B [out, r] float32, cut to this rank's shard
(lora_layout.py) and with PEFT's scale folded into B, so a slot computes B (A x).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.common.lora_adapter import _KEY, WEIGHTS_FILE, AdapterSpec
from services.common.lora_request import LoRARequest
from services.worker.lora.lora_layout import SliceLayout


@dataclass
class AdapterWeights:
    identity: str
    rank: int
    # (layer, HF module) -> (A [r, in_size], scale * B [out_size, r]) of this rank
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.tensors.values())

    @classmethod
    def load(
        cls,
        lora: LoRARequest,
        spec: AdapterSpec,
        layouts: dict[tuple[int, str], SliceLayout],
    ) -> AdapterWeights:
        """`layouts`: this rank's slice of every (layer, module) it holds."""
        raw = load_file(str(Path(lora.lora_path) / WEIGHTS_FILE))
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, tensor in raw.items():
            match = _KEY.search(name)
            key = (int(match[1]), match[2])
            if key in layouts:  # a layer of another pipeline stage is not ours
                pairs.setdefault(key, {})[match[3]] = tensor
        tensors = {}
        for key, pair in pairs.items():
            where = layouts[key]
            a = pair["A"].float().narrow(1, where.in_src, where.in_size)
            b = pair["B"].float().narrow(0, where.out_src, where.out_size) * spec.scale
            tensors[key] = (a.contiguous(), b.contiguous())
        return cls(lora.identity, spec.rank, tensors)
