"""A GGUF tensor from the file's map to its packed form: MappedBlocks narrowed and decoded
(equal to decoding the whole tensor, the map's pages handed back after), and a large
tensor packed and de-quantized in row chunks (equal to doing it whole)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagestream_kernels import cpu
from services.common.gguf_file import GGUFFile
from services.worker.layers import linear_weight
from services.worker.layers.quantization import decode_gguf, mapped_blocks
from services.worker.layers.quantization.mapped_blocks import MappedBlocks

Q4_K_BLOCK = (256, 144)


def _raw(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Q4_K rows [n, k]: random bytes with small, finite fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    block, size = Q4_K_BLOCK
    blocks = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = (rng.random((n, k // block, 2)) * 4e-3 + 1e-3).astype(np.float16)
    blocks[..., 0:4] = scales.view(np.uint8)
    return blocks.reshape(n, -1)


def _same(a, b) -> None:
    torch.testing.assert_close(a.dequantize(), b.dequantize(), rtol=0, atol=0)


def test_narrowed_blocks_decode_as_the_whole_tensor_narrowed():
    raw = _raw(12, 768)
    whole = decode_gguf(raw, "Q4_K", 768)
    released = []
    blocks = MappedBlocks(raw, "Q4_K", 768, released.append)
    assert blocks.shape == (12, 768) and blocks.source == "Q4_K" and blocks.nbytes == raw.nbytes
    rows = blocks.narrow_rows(4, 5)
    assert np.shares_memory(rows.raw, raw)  # a view of the map, nothing decoded
    _same(rows.decode(), whole.narrow_rows(4, 5))
    assert len(released) == 1 and released[0].shape == (5, raw.shape[1])
    cols = blocks.narrow_cols(256, 512)  # whole blocks: their bytes
    assert isinstance(cols, MappedBlocks)
    _same(cols.decode(), whole.narrow_cols(256, 512))
    _same(blocks.narrow_cols(32, 64), whole.narrow_cols(32, 64))  # inside a block: decoded
    order = torch.tensor([3, 0, 11, 5])
    _same(blocks.select_rows(order).decode(), decode_gguf(raw[order.numpy()], "Q4_K", 768))


def test_blocks_are_checked_before_anything_is_decoded():
    with pytest.raises(ValueError, match="K = 500"):
        MappedBlocks(_raw(2, 512)[:, :-144], "Q4_K", 500)
    with pytest.raises(ValueError, match="not supported"):
        MappedBlocks(_raw(2, 512), "IQ2_XXS", 512)


def test_released_pages_read_back_the_same(tmp_path):
    from tests.helpers.tiny_gguf import write_tiny_gguf
    from tests.helpers.tiny_models import build_tiny_model

    path = tmp_path / "tiny.Q8_0.gguf"
    write_tiny_gguf(path, build_tiny_model("llama_tied", seed=3, vocab_size=300), "Q8_0")
    gguf = GGUFFile(path)
    tensor = next(t for t in gguf.tensors if t.type_name == "Q8_0")
    raw = gguf.raw(tensor)
    before = raw.copy()
    gguf.release(raw)
    gguf.release(raw[1:2])
    gguf.release(before)  # not the map's: left alone
    assert np.array_equal(raw, before)


@pytest.mark.skipif(cpu.unavailable_reason() is not None, reason="no C++ extension")
def test_a_large_tensor_packs_in_row_chunks_equal_to_one(monkeypatch):
    raw = _raw(1000, 512, seed=1)
    bias = torch.randn(1000)
    x = torch.randn(3, 512)
    whole = linear_weight.pack_quantized(decode_gguf(raw, "Q4_K", 512), bias, False)
    monkeypatch.setattr(mapped_blocks, "CHUNK_BYTES", 256 * raw.shape[1])
    blocks = MappedBlocks(raw, "Q4_K", 512)
    assert mapped_blocks.row_chunks(blocks) == [(0, 256), (256, 256), (512, 256), (768, 232)]
    chunked = linear_weight.pack_quantized(blocks, bias, False)
    assert chunked.format() == "Q4_K" and chunked.out_features() == 1000
    empty = torch.empty(0)
    torch.testing.assert_close(
        chunked.forward(x, empty, 0), whole.forward(x, empty, 0), rtol=0, atol=0
    )
    ids = torch.tensor([0, 255, 256, 999])
    torch.testing.assert_close(chunked.gather_rows(ids), whole.gather_rows(ids), rtol=0, atol=0)
    table = mapped_blocks.dequantized(blocks, torch.float32)  # the torch path's, chunked too
    torch.testing.assert_close(table, decode_gguf(raw, "Q4_K", 512).dequantize(), rtol=0, atol=0)
