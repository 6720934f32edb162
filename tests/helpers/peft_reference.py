"""Random PEFT LoRA adapters made in the test, and PEFT itself as the reference the engine's
outputs with them must equal (tests/api/test_lora.py, tests/parallel/test_lora_tp.py).

`save_adapter` (tests/helpers/lora_adapters.py) builds an adapter with peft from a seed.
`PeftReference` runs the base with an adapter (PeftModel.from_pretrained, or
merge_and_unload) in float32 with eager attention: greedy outputs, log-probabilities, and
the greedy comparison of tests/helpers/parallel.py (a divergence only where the
reference's own top-2 logits tie within NEAR_TIE) computed on the adapter's model.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.helpers.lora_adapters import save_adapter
from tests.helpers.parallel import NEAR_TIE

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EOS = 2  # the tiny models' eos_token_id
__all__ = ["ATTENTION", "EOS", "MLP", "PeftReference", "save_adapter"]


def _files_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in sorted(folder.iterdir()):
        if file.is_file():
            h.update(file.name.encode())
            h.update(file.read_bytes())
    return h.hexdigest()


class PeftReference:
    """The base model folder with any adapter folder (None: the base alone), each model
    loaded once per content of its folder (a folder rewritten with other weights is read
    again)."""

    def __init__(self, base: Path) -> None:
        self.base = Path(base)
        self._models: dict[tuple, torch.nn.Module] = {}

    def model(self, adapter: Path | str | None, merged: bool = False) -> torch.nn.Module:
        key = (None, merged) if adapter is None else (str(adapter), merged)
        if adapter is not None:
            key = (*key, _files_digest(Path(adapter)))
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(
                self.base, dtype=torch.float32, attn_implementation="eager"
            )
            if adapter is not None:
                model = PeftModel.from_pretrained(model, str(adapter))
                if merged:
                    model = model.merge_and_unload()
            self._models[key] = model.eval()
        return self._models[key]

    def greedy(
        self, adapter, prompt: list[int], max_new_tokens: int, merged: bool = False
    ) -> list[int]:
        """The greedy new token ids, up to and with EOS (where the engine stops too)."""
        with torch.no_grad():
            out = self.model(adapter, merged).generate(
                input_ids=torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        ids = out[0, len(prompt) :].tolist()
        return ids[: ids.index(EOS) + 1] if EOS in ids else ids

    def logprobs(self, adapter, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab]: the log-probabilities of the token after each position."""
        with torch.no_grad():
            logits = self.model(adapter)(input_ids=torch.tensor([token_ids])).logits[0]
        return logits.float().log_softmax(-1)

    def top2_gap(self, adapter, token_ids: list[int], merged: bool = False) -> float:
        with torch.no_grad():
            logits = self.model(adapter, merged)(input_ids=torch.tensor([token_ids])).logits
        top = torch.topk(logits[0, -1].float(), 2).values
        return float(top[0] - top[1])

    def assert_greedy(
        self,
        adapter,
        prompt: list[int],
        got: list[int],
        max_new_tokens: int | None = None,
        merged: bool = False,
        what: str = "",
    ) -> list[int]:
        """`got` equals the adapter's greedy output (max_new_tokens: len(got)), or first
        differs where the reference's top-2 logits tie within NEAR_TIE. The reference."""
        expected = self.greedy(adapter, prompt, max_new_tokens or len(got), merged)
        if got == expected:
            return expected
        k = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
        assert k is not None, f"{what}: lengths differ: got {got}, expected {expected}"
        gap = self.top2_gap(adapter, prompt + expected[:k], merged)
        assert gap < NEAR_TIE, (
            f"{what}: greedy outputs diverge at step {k} where the reference's top-2 logit "
            f"gap is {gap:.2e} (not a tie): got {got}, expected {expected}"
        )
        return expected
