"""LoRA adapters on the wire: the internal LoRAAdapter carries the path, the public card
does not."""

from __future__ import annotations

from dataclasses import replace

from services.common.convert.engine_io import engine_request_from_pb, engine_request_to_pb
from services.common.convert.lora import lora_card_to_pb, lora_from_pb, lora_to_pb
from services.common.engine_request import EngineCoreRequest
from services.common.lora_request import LoRARequest
from services.common.proto.pagestream.internal.v1 import lora_pb2
from services.common.proto.pagestream.v1 import generation_pb2
from services.common.sampling_params import SamplingParams


def _wire(message):
    return type(message).FromString(message.SerializeToString())


def test_an_adapter_round_trips_with_and_without_a_base():
    for base in ("base", None):
        lora = LoRARequest("a", 3, "/adapters/a", base, digest="0123456789abcdef")
        message = _wire(lora_to_pb(lora))
        assert isinstance(message, lora_pb2.LoRAAdapter)
        assert message.HasField("base_model_name") == (base is not None)
        assert lora_from_pb(message) == lora


def test_an_add_request_carries_its_adapter():
    lora = LoRARequest("a", 3, "/adapters/a", digest="0123456789abcdef")
    request = EngineCoreRequest("r", [1, 2], SamplingParams(), lora_request=lora)
    back = engine_request_from_pb(_wire(engine_request_to_pb(request)))
    assert back == replace(request, arrival_time=back.arrival_time)


def test_the_public_card_is_generation_protos_and_pathless():
    lora = LoRARequest("a", 3, "/adapters/a", digest="0123456789abcdef")
    card = lora_card_to_pb(lora)
    assert isinstance(card, generation_pb2.LoRAAdapter)
    assert (card.name, card.id, card.digest, card.base_model_name) == ("a", 3, lora.digest, "")
    assert "path" not in generation_pb2.LoRAAdapter.DESCRIPTOR.fields_by_name
