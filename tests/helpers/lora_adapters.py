"""Real PEFT LoRA folders made in the test over a tiny base model, and PEFT's own greedy
output as the reference an adapter served by the engine must give.

`save_adapter` builds the adapter with peft itself (`init_lora_weights=False`: random A
and B, so the adapter changes what the model says), from a seed, and saves it with
save_pretrained. `peft_greedy` runs the base with that adapter through PeftModel in
float32 (the tests' dtype), the same greedy search as tests/conftest.py's `hf_greedy`.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, PreTrainedModel

# Attention and MLP, both fused sides of each (q/v of qkv, up of gate_up) and both
# row-parallel linears (o, down), so every kind of slice a slot holds is exercised.
TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def save_adapter(
    base: Path | str | PreTrainedModel,
    folder: Path | str,
    *,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules=TARGETS,
    seed: int = 0,
    safe_serialization: bool = True,
    save_embedding_layers: bool | str = "auto",
    **lora_config,
) -> Path:
    """A PEFT LoRA adapter of `base` (a model folder, or a model, which peft changes in
    place) with random weights from `seed`, saved to `folder` (`save_embedding_layers`:
    peft's; "auto" saves the base embeddings beside LoRA weights on them)."""
    model = base
    if not isinstance(base, PreTrainedModel):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=list(target_modules),
        init_lora_weights=False,
        **lora_config,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    folder = Path(folder)
    peft_model.save_pretrained(
        folder,
        safe_serialization=safe_serialization,
        save_embedding_layers=save_embedding_layers,
    )
    return folder


@cache
def _peft_model(base: str, adapter: str | None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32, attn_implementation="eager"
    )
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def peft_greedy(
    base: Path | str, adapter: Path | str | None, prompt_ids: list[int], max_new_tokens: int
) -> list[int]:
    """PEFT's greedy new token ids for the base with `adapter` (None: the base alone).
    An adapter folder is read once: give new weights a folder of their own."""
    model = _peft_model(str(base), None if adapter is None else str(adapter))
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def peft_logprobs(base: Path | str, adapter: Path | str | None, token_ids: list[int]):
    """[len(token_ids), vocab] float32: PEFT's log-probabilities of the token after each
    position."""
    model = _peft_model(str(base), None if adapter is None else str(adapter))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)
