"""How a model runs, decided once by the loader before the model is built
(services/worker/model_loader.py `plan_forward`); the model is constructed in that form
and never switches after."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ForwardPlan:
    # "native": the decoder stack runs as one C++ call per step (NativeLlamaModel);
    # "torch": the torch modules run it (every model that is not a native decoder)
    decoder: Literal["torch", "native"] = "torch"
    # "bidirectional": each row attends to its whole prompt and the paged cache is never
    # read (an encoder, or a decoder family read as one); "causal": over the paged cache
    attention: Literal["causal", "bidirectional"] = "causal"
    triton_experts: bool = False  # the torch decoder's mixtures of experts on Triton kernels
    reason: str = ""  # why the decoder is what it is (logged)

    def __post_init__(self) -> None:
        if self.native and self.bidirectional:
            raise ValueError("the native step attends causally over the paged cache")

    @property
    def native(self) -> bool:
        return self.decoder == "native"

    @property
    def bidirectional(self) -> bool:
        return self.attention == "bidirectional"


TORCH_CAUSAL = ForwardPlan()  # a decoder built without a loader's plan (tests, tools)
