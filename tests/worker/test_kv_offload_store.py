"""KVOffloadStore (services/worker/kv_offload): blocks through the host tier and files
bit-exact, every bad file a load failure with its device block untouched, the background
writer's bound, cancel and flush; driven directly with CacheEngines."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.common import kv_block_file
from services.common.config import CacheConfig, ModelConfig
from services.common.kv_offload_identity import kv_offload_identity
from services.worker.cache_engine import CacheEngine
from services.worker.kv_offload import block_writer
from services.worker.kv_offload.kv_offload_store import KVOffloadStore
from services.worker.models.kv_cache_spec import KVCacheSpec
from services.worker.worker import Worker
from tests.helpers.scheduler_plans import new_req, plan

IDENTITY = b"\x07" * 32
OTHER = b"\x08" * 32


def key(i: int) -> bytes:
    return bytes([i]) * 32


def make_engine(dtype: torch.dtype, seed: int, num_layers: int = 3) -> CacheEngine:
    """A cache full of random bit patterns (NaN payloads included: compared as bits)."""
    engine = CacheEngine(
        KVCacheSpec(num_layers=num_layers, num_kv_heads=2, head_dim=8, dtype=dtype),
        block_size=4,
        num_blocks=10,
        num_cpu_blocks=0,
        device="cpu",
    )
    gen = torch.Generator().manual_seed(seed)
    for cache in engine.kv_caches:
        raw = cache.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    return engine


def block_bits(engine: CacheEngine, block: int) -> list[torch.Tensor]:
    return [cache[:, block].view(torch.uint8).clone() for cache in engine.kv_caches]


def store_for(engines: list[CacheEngine], directory: Path | None, host_bytes: int = 0, **kw):
    caches = [cache for engine in engines for cache in engine.kv_caches]
    return KVOffloadStore(caches, IDENTITY, directory, host_bytes, **kw)


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_disk_round_trip_across_a_restart(tmp_path: Path, dtype: torch.dtype) -> None:
    """Saved blocks (a draft model's engine beside the target's) come back bit-exact in a
    new store over new caches, as after a restart, into other device blocks."""
    target, draft = make_engine(dtype, 0), make_engine(dtype, 1, num_layers=2)
    store = store_for([target, draft], tmp_path)
    store.save([(1, key(1)), (3, key(3)), (5, key(5))])
    store.close()
    assert sorted(k for k, _, _ in kv_block_file.scan(tmp_path, IDENTITY)) == [
        key(1),
        key(3),
        key(5),
    ]
    expected = {b: block_bits(target, b) + block_bits(draft, b) for b in (1, 3, 5)}
    target2, draft2 = make_engine(dtype, 2), make_engine(dtype, 3, num_layers=2)
    store2 = store_for([target2, draft2], tmp_path)
    assert store2.load([(key(5), 0), (key(1), 7), (key(3), 2)]) == []
    for source, block in ((5, 0), (1, 7), (3, 2)):
        assert_same(block_bits(target2, block) + block_bits(draft2, block), expected[source])
    store2.close()


def test_host_tier_round_trip_and_bound(tmp_path: Path) -> None:
    engine = make_engine(torch.bfloat16, 0)
    store = store_for([engine], None, host_bytes=0)
    assert store.host is None
    store = store_for([engine], None, host_bytes=2 * 3 * 2 * 4 * 2 * 8 * 2)  # two blocks
    before = {b: block_bits(engine, b) for b in range(10)}
    store.save([(1, key(1)), (2, key(2))])
    store.save([(4, key(4))])  # pushes key(1) out: the oldest
    assert store.load([(key(4), 8), (key(1), 6), (key(2), 9)]) == [key(1)]
    assert_same(block_bits(engine, 8), before[4])
    assert_same(block_bits(engine, 9), before[2])
    assert_same(block_bits(engine, 6), before[6])  # a failed key's block is untouched
    store.drop([(key(4), "host")])
    assert store.load([(key(4), 3)]) == [key(4)]


def _saved_file(tmp_path: Path, engine: CacheEngine) -> tuple[KVOffloadStore, Path]:
    store = store_for([engine], tmp_path)
    store.save([(2, key(2)), (3, key(3))])
    store.flush()
    return store, kv_block_file.block_path(tmp_path, key(2))


@pytest.mark.parametrize("damage", ["truncated", "flipped", "other identity", "renamed"])
def test_a_bad_file_is_a_load_failure(tmp_path: Path, damage: str) -> None:
    engine = make_engine(torch.float32, 0)
    store, path = _saved_file(tmp_path, engine)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-100])
    elif damage == "flipped":
        flipped = bytearray(data)
        flipped[kv_block_file.HEADER_BYTES + 17] ^= 0x40
        path.write_bytes(bytes(flipped))
    elif damage == "other identity":
        payload = data[kv_block_file.HEADER_BYTES :]
        kv_block_file.write(path, OTHER, key(2), payload)
    else:  # key(3)'s file under key(2)'s name
        path.unlink()
        kv_block_file.block_path(tmp_path, key(3)).rename(path)
    untouched = block_bits(engine, 7)
    good = block_bits(engine, 3)
    expected_failures = [key(2), key(3)] if damage == "renamed" else [key(2)]
    assert store.load([(key(2), 7), (key(3), 8)]) == expected_failures
    assert_same(block_bits(engine, 7), untouched)
    if damage != "renamed":
        assert_same(block_bits(engine, 8), good)
    store.close()


def test_disk_drop_removes_the_file(tmp_path: Path) -> None:
    engine = make_engine(torch.float32, 0)
    store, path = _saved_file(tmp_path, engine)
    store.drop([(key(2), "disk"), (key(9), "disk"), (key(3), "host")])  # absent: no error
    assert not path.exists()
    assert store.load([(key(2), 7)]) == [key(2)]
    store.close()


class BlockedWrites:
    """kv_block_file.write held until release(): the writer thread's queue fills."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        real = kv_block_file.write

        def write(*args, **kwargs):
            self.started.set()
            assert self.gate.wait(30), "the test never released the writer"
            return real(*args, **kwargs)

        monkeypatch.setattr(block_writer.kv_block_file, "write", write)

    def release(self) -> None:
        self.gate.set()


def test_pending_writes_serve_loads_and_flush(tmp_path: Path, monkeypatch) -> None:
    blocked = BlockedWrites(monkeypatch)
    engine = make_engine(torch.bfloat16, 0)
    store = store_for([engine], tmp_path)
    before = block_bits(engine, 1), block_bits(engine, 2)
    store.save([(1, key(1)), (2, key(2))])
    assert blocked.started.wait(30)  # key(1) is being written, key(2) queued
    assert store.load([(key(1), 5), (key(2), 6)]) == []
    assert_same(block_bits(engine, 5), before[0])
    assert_same(block_bits(engine, 6), before[1])
    assert kv_block_file.scan(tmp_path, IDENTITY) == []
    blocked.release()
    store.close()  # flushes
    assert sorted(k for k, _, _ in kv_block_file.scan(tmp_path, IDENTITY)) == [key(1), key(2)]


def test_a_full_writer_queue_gives_up_the_oldest(tmp_path: Path, monkeypatch) -> None:
    blocked = BlockedWrites(monkeypatch)
    engine = make_engine(torch.float32, 0)
    block = 2 * 3 * 4 * 2 * 8 * 4
    store = store_for([engine], tmp_path, max_pending_bytes=2 * block)
    store.save([(0, key(10))])
    assert blocked.started.wait(30)  # key(10) is being written: the queue is empty
    store.save([(1, key(11)), (2, key(12)), (3, key(13))])  # one too many: key(11) goes
    assert store.unpersisted() == [key(11)]
    assert store.unpersisted() == []
    blocked.release()
    store.flush()
    on_disk = sorted(k for k, _, _ in kv_block_file.scan(tmp_path, IDENTITY))
    assert on_disk == [key(10), key(12), key(13)]
    assert store.load([(key(11), 5)]) == [key(11)]
    store.close()


def test_a_drop_during_its_write_deletes_the_file(tmp_path: Path, monkeypatch) -> None:
    blocked = BlockedWrites(monkeypatch)
    store = store_for([make_engine(torch.float32, 0)], tmp_path)
    store.save([(0, key(1)), (1, key(2))])
    assert blocked.started.wait(30)
    store.drop([(key(1), "disk"), (key(2), "disk")])  # one being written, one queued
    blocked.release()
    store.close()
    assert kv_block_file.scan(tmp_path, IDENTITY) == []


def test_bad_commands_are_value_errors(tmp_path: Path) -> None:
    engine = make_engine(torch.float32, 0)
    store = store_for([engine], tmp_path)
    before = block_bits(engine, 0)
    with pytest.raises(ValueError, match="out of range"):
        store.load([(key(1), 10)])
    with pytest.raises(ValueError, match="out of range"):
        store.save([(-1, key(1))])
    with pytest.raises(ValueError, match="32 bytes"):
        store.save([(0, b"short")])
    with pytest.raises(ValueError, match="tier"):
        store.drop([(key(1), "gpu")])
    with pytest.raises(ValueError, match="twice"):
        store.load([(key(1), 0), (key(2), 0)])
    store.close()
    assert_same(block_bits(engine, 0), before)
    assert kv_block_file.scan(tmp_path, IDENTITY) == []


# -- the hook: a Worker's steps run the plan's kv_drops / kv_loads / kv_saves -------------


def _worker(folder: Path, offload_dir: Path, **cache: object) -> Worker:
    worker = Worker(
        # the torch attention path: what the hook does is the same on every path
        ModelConfig(
            model=str(folder),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            enforce_eager=True,
        ),
        CacheConfig(
            block_size=4, kv_cache_memory=1 << 20, kv_offload_dir=str(offload_dir), **cache
        ),
    )
    worker.initialize_cache(64, 4, 64)
    return worker


def test_a_restarted_worker_reads_its_prefix_back(tiny_model_dir, tmp_path: Path) -> None:
    """Worker one prefills 12 tokens and saves its two full blocks; a second worker (a
    restart) loads them into other blocks, computes only the last 4 tokens and samples
    the token the first did; a corrupted file fails its key and leaves its block alone."""
    folder = tiny_model_dir("llama")
    prompt = list(range(3, 15))
    first = _worker(folder, tmp_path)
    step = plan({"a": 12}, new=[new_req("a", prompt, [0, 1, 2], max_tokens=4)])
    whole = first.execute(replace(step, kv_saves=[(0, key(1)), (1, key(2))]))
    saved = block_bits(first.runner.cache_engine, 0) + block_bits(first.runner.cache_engine, 1)
    first.close()  # the files written
    assert not whole.kv_load_failures

    second = _worker(folder, tmp_path)
    step = plan({"b": 4}, new=[new_req("b", prompt, [5, 6, 7], computed=8, max_tokens=4)])
    resumed = second.execute(replace(step, kv_loads=[(key(1), 5), (key(2), 6)]))
    engine = second.runner.cache_engine
    assert resumed.kv_load_failures == []
    assert_same(block_bits(engine, 5) + block_bits(engine, 6), saved)
    assert resumed.sampled_token_ids == whole.sampled_token_ids
    second.close()

    # where the scheduler's index finds them: the same identity from the same inputs
    identity = kv_offload_identity(first.model_config, first.cache_config, first.describe())
    directory = identity.directory(tmp_path)
    assert sorted(k for k, _, _ in kv_block_file.scan(directory, identity.digest)) == [
        key(1),
        key(2),
    ]
    path = kv_block_file.block_path(directory, key(2))
    path.write_bytes(path.read_bytes()[:-1])
    third = _worker(folder, tmp_path)
    untouched = block_bits(third.runner.cache_engine, 6)
    step = plan({"c": 4}, new=[new_req("c", prompt, [5, 6, 7], computed=8, max_tokens=4)])
    failed = third.execute(replace(step, kv_loads=[(key(1), 5), (key(2), 6)]))
    assert failed.kv_load_failures == [key(2)]  # the scheduler discards this step's output
    layers = len(third.runner.cache_engine.kv_caches)
    assert_same(block_bits(third.runner.cache_engine, 5), saved[:layers])
    assert_same(block_bits(third.runner.cache_engine, 6), untouched)
    third.close()


def test_the_plan_saves_after_the_forward(tiny_model_dir, tmp_path: Path) -> None:
    """kv_saves in the plan copy the blocks its own forward filled (host tier only)."""
    worker = _worker(
        tiny_model_dir("llama"), tmp_path, kv_offload_bytes=0, kv_offload_host_bytes=1 << 20
    )
    step = plan({"a": 8}, new=[new_req("a", list(range(3, 11)), [0, 1, 2], max_tokens=4)])
    worker.execute(replace(step, kv_saves=[(0, key(1)), (1, key(2))]))
    engine = worker.runner.cache_engine
    filled = block_bits(engine, 0) + block_bits(engine, 1)
    step = replace(plan({}, finished={"a"}), kv_loads=[(key(1), 8), (key(2), 9)])
    assert worker.execute(step).kv_load_failures == []
    assert_same(block_bits(engine, 8) + block_bits(engine, 9), filled)
    assert not any(p.suffix == ".kv" for p in tmp_path.rglob("*"))  # no disk tier
    worker.close()
