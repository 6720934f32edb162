"""RequestOptions: what one request asks for besides its prompt and its sampling or pooling
parameters, carried whole from every front door (LLM, AsyncEngine, HTTP, gRPC) to the
InputProcessor that builds the engine request.

`priority`: lower runs first under --scheduling-policy priority; `cache_salt`: prefix-cache
isolation (only requests with the same salt share cached blocks); `add_special_tokens`:
whether a text prompt gets the tokenizer's BOS / [CLS] (chat prompts already carry theirs);
`lora_request`: the LoRA adapter to run (None: the base model).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.lora_request import LoRARequest


@dataclass(frozen=True)
class RequestOptions:
    priority: int = 0
    cache_salt: str | None = None
    add_special_tokens: bool = True
    lora_request: LoRARequest | None = None


DEFAULT_OPTIONS = RequestOptions()
