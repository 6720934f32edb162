"""Every Triton kernel configuration the worker uses compiles for sm_90 (H100/H200) on this
CPU-only machine, without register spills and within the 227 KiB of shared memory a block
may use. The registers / spills / shared memory of each configuration are printed (-s or -rP).
"""

from __future__ import annotations

import pytest
import triton  # noqa: F401  (a dependency of the project on Linux: make setup installs it)

import pagestream_kernels.triton
from pagestream_kernels.triton import aot


@pytest.fixture(scope="module")
def compiled():
    if pagestream_kernels.triton.is_interpreted():  # this run's setting: no skip
        pytest.fail("TRITON_INTERPRET=1: the kernels are interpreted; run without it", False)
    return aot.compile_all()


def test_every_worker_configuration_compiles_for_sm90(compiled):
    configurations = aot.worker_configurations()
    assert [result.label for result in compiled] == list(configurations)
    kernels = {launch.kernel.__name__ for launch in configurations.values()}
    assert kernels == {
        "reshape_and_cache_kernel",
        "unified_attention_kernel",
        "reduce_segments_kernel",
    }
    print()  # the resource table, for the record
    for result in compiled:
        print(result.line())


def test_no_spills_and_shared_memory_fits_sm90(compiled):
    spilling = [result.line() for result in compiled if result.spills]
    assert not spilling, "register spills:\n" + "\n".join(spilling)
    too_big = [r.line() for r in compiled if r.shared_bytes > aot.SM90_MAX_SHARED_BYTES]
    assert not too_big, "more shared memory than sm_90 offers:\n" + "\n".join(too_big)
    for result in compiled:
        assert 0 < result.registers <= 255, result.line()


def test_covers_decode_split_prefill_and_options(compiled):
    labels = " | ".join(result.label for result in compiled)
    for needle in ("prefill", "decode split", "reduce_segments", "window softcap", "fp32", "bs32"):
        assert needle in labels, needle
