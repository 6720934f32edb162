"""LoRARequest: which LoRA adapter a request runs with (vLLM's names).

`lora_int_id` (>= 1) tells the adapters of one engine apart; `identity` is what the prefix
cache and the workers' adapter caches key on: the name, the id and a digest of the
adapter's files, so a reload under the same name with other weights is a new identity and
never reads blocks that the old weights computed.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    # A digest of the adapter's files, set when the adapter is checked
    # (services/common/lora_adapter.py); part of the identity.
    digest: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_request.lora_name must be a non-empty string.")
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(
                f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}."
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request {self.lora_name!r}: lora_path must name a folder.")

    @property
    def identity(self) -> str:
        return f"{self.lora_name}#{self.lora_int_id}#{self.digest}"
