"""LoRAManager: a worker's adapters: a host LRU of loaded ones and the device slots.

The scheduler decides which adapter sits in which slot (SchedulerOutput.lora_adapters:
every slot a step uses, with its adapter) and which slot each request's rows use
(lora_slots); `prepare` loads what a step's slots lack (from the host LRU of
max_cpu_loras adapters, or the adapter's folder) and sets the step's rows by slot.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from services.common.lora_adapter import LoRAAdapterError, inspect_adapter
from services.common.lora_config import LoRAConfig, LoRATargets
from services.common.lora_request import LoRARequest
from services.common.scheduler_output import SchedulerOutput
from services.worker.lora.adapter_weights import AdapterWeights
from services.worker.lora.lora_layout import model_modules
from services.worker.lora.lora_slots import LoRASlots
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.registry import NATIVE_MODELS

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device) -> None:
        if not isinstance(model, LlamaForCausalLM):
            raise ValueError(
                "LoRA adapters are served over the Llama-family models "
                f"({', '.join(NATIVE_MODELS)}); {type(model).__name__} runs through the "
                "transformers fallback, without them."
            )
        text = model.text_config
        self.config = config
        self.targets = LoRATargets(model_modules(text), int(text.num_hidden_layers))
        self.slots = LoRASlots(model, self.config, device)
        self._layouts = self.slots.layouts()
        self.host: OrderedDict[str, AdapterWeights] = OrderedDict()
        native = getattr(model.model, "native", None)
        if native is not None:
            native.bind_lora(self.slots)

    def adapter(self, lora: LoRARequest) -> AdapterWeights:
        """The adapter from the host LRU, else loaded from its folder (checked again)."""
        weights = self.host.get(lora.identity)
        if weights is not None:
            self.host.move_to_end(lora.identity)
            return weights
        spec = inspect_adapter(lora.lora_path, self.config, self.targets)
        if lora.digest and spec.digest != lora.digest:
            raise LoRAAdapterError(
                f"the files in {lora.lora_path} changed since the adapter was checked; "
                "load it again (a new id) to serve the new weights"
            )
        weights = AdapterWeights.load(lora, spec, self._layouts)
        self.host[lora.identity] = weights
        while len(self.host) > self.config.num_cpu_loras:
            evicted, _ = self.host.popitem(last=False)
            logger.debug("LoRA adapter %s left the host cache", evicted)
        logger.info("LoRA adapter %s loaded (rank %d)", lora.lora_name, spec.rank)
        return weights

    def prepare(
        self, plan: SchedulerOutput, request_ids: list[str], starts: list[int]
    ) -> dict[str, str]:
        """Slots filled as the plan says, and the step's rows by slot (`request_ids` in row
        order, `starts` [S + 1] their first rows). An adapter that will not load (its folder
        changed or went away since it was checked) fails only its requests: their rows run
        without it and come back as errors (request id -> why)."""
        failed: dict[int, str] = {}
        for slot, lora in plan.lora_adapters.items():
            if self.slots.identities[slot] == lora.identity:
                continue
            try:
                self.slots.load(slot, self.adapter(lora))
            except (OSError, ValueError) as exc:
                logger.warning("LoRA adapter %s would not load: %s", lora.lora_name, exc)
                self.slots.clear(slot)
                failed[slot] = f"the LoRA adapter {lora.lora_name!r} could not be loaded: {exc}"
        if not plan.lora_slots:
            self.slots.set_batch(None)
            return {}
        per_request = [plan.lora_slots.get(rid, -1) for rid in request_ids]
        token_slots = np.repeat(np.asarray(per_request, dtype=np.int32), np.diff(starts))
        self.slots.set_batch(token_slots)
        return {rid: failed[slot] for rid, slot in plan.lora_slots.items() if slot in failed}
