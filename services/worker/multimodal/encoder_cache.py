"""EncoderCache: each image's encoder output, kept while a request still has span positions
of it to prefill, shared by the requests that show the same image (keyed by its content
hash). An entry goes when its last holder is done with it or dropped, so the cache never
holds more than the images of the requests in prefill."""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.common.image_input import ImageInput


class EncoderCache:
    def __init__(self) -> None:
        self._outputs: dict[str, torch.Tensor] = {}  # hash -> [num_embeds, hidden]
        self._holders: dict[str, set[str]] = {}  # hash -> request ids
        self._held: dict[str, set[str]] = {}  # request id -> hashes
        self.num_encoded = 0  # images run through the encoder (the rest were shared)

    def __len__(self) -> int:
        return len(self._outputs)

    def get(
        self,
        request_id: str,
        image: ImageInput,
        encode: Callable[[ImageInput], torch.Tensor],
    ) -> torch.Tensor:
        """The image's output [num_embeds, hidden], encoded now if no request holds it."""
        key = image.content_hash
        output = self._outputs.get(key)
        if output is None:
            output = encode(image)
            self._outputs[key] = output
            self.num_encoded += 1
        self._holders.setdefault(key, set()).add(request_id)
        self._held.setdefault(request_id, set()).add(key)
        return output

    def release(self, request_id: str, content_hash: str) -> None:
        """The request needs this image's output no more."""
        self._held.get(request_id, set()).discard(content_hash)
        holders = self._holders.get(content_hash)
        if holders is None:
            return
        holders.discard(request_id)
        if not holders:
            del self._holders[content_hash]
            self._outputs.pop(content_hash, None)

    def drop(self, request_id: str) -> None:
        """The request left the worker (finished, aborted, preempted)."""
        for key in self._held.pop(request_id, set()):
            self.release(request_id, key)
