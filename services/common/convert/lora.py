"""LoRARequest <-> the internal LoRAAdapter (lora.proto), the public card, and a step's
LoRA columns.

Between the services an adapter travels with its path (the workers read its files); to
clients (GetModelInfo) it is generation.proto's card, which has no path field: where the
server keeps its files is not theirs to know."""

from __future__ import annotations

from services.common.lora_request import LoRARequest
from services.common.proto.pagestream.internal.v1 import lora_pb2
from services.common.proto.pagestream.v1 import generation_pb2


def lora_to_pb(lora: LoRARequest) -> lora_pb2.LoRAAdapter:
    return lora_pb2.LoRAAdapter(
        name=lora.lora_name,
        id=lora.lora_int_id,
        path=lora.lora_path,
        digest=lora.digest,
        base_model_name=lora.base_model_name,
    )


def lora_card_to_pb(lora: LoRARequest) -> generation_pb2.LoRAAdapter:
    """The adapter as a client sees it: name, id, digest and base."""
    return generation_pb2.LoRAAdapter(
        name=lora.lora_name,
        id=lora.lora_int_id,
        digest=lora.digest,
        base_model_name=lora.base_model_name or "",
    )


def lora_from_pb(message: lora_pb2.LoRAAdapter) -> LoRARequest:
    """Raises ValueError naming the field of a bad adapter."""
    return LoRARequest(
        lora_name=message.name,
        lora_int_id=message.id,
        lora_path=message.path,
        base_model_name=message.base_model_name if message.HasField("base_model_name") else None,
        digest=message.digest,
    )


def lora_columns_to_pb(slots: dict[str, int], adapters: dict[int, LoRARequest]) -> dict:
    """A plan's lora_slots / lora_adapters as the lora_* columns of a StepPlan."""
    return {
        "lora_request_ids": list(slots),
        "lora_request_slots": list(slots.values()),
        "lora_slots": list(adapters),
        "lora_adapters": [lora_to_pb(lora) for lora in adapters.values()],
    }


def lora_columns_from_pb(message) -> tuple[dict[str, int], dict[int, LoRARequest]]:
    if len(message.lora_request_ids) != len(message.lora_request_slots):
        raise ValueError("lora_request_ids and lora_request_slots differ in length")
    if len(message.lora_slots) != len(message.lora_adapters):
        raise ValueError("lora_slots and lora_adapters differ in length")
    slots = dict(zip(message.lora_request_ids, message.lora_request_slots, strict=True))
    adapters = {
        slot: lora_from_pb(adapter)
        for slot, adapter in zip(message.lora_slots, message.lora_adapters, strict=True)
    }
    return slots, adapters
