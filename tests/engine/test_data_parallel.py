"""Two data-parallel replicas (a worker and a scheduler each, over loopback gRPC in this
process) behind one routing Frontend: the cache-aware router keeps conversations on the
replica that holds their prefix (a hit rate far above round robin on the same requests),
unrelated prompts spread over both, greedy outputs do not depend on the replica, and a
replica that loses its worker fails only its own requests while the other serves on."""

import asyncio
import random
from dataclasses import dataclass

import pytest

from pagestream import LLM
from pagestream.engine_args import EngineArgs
from services.common.engine_errors import EngineUnavailableError
from services.common.sampling_params import SamplingParams
from services.frontend.dp_engine_client import DataParallelClient
from services.frontend.frontend import Frontend
from services.frontend.frontend_server import connect_frontend
from services.frontend.router import RouterConfig
from services.frontend.tokenizer import load_tokenizer
from services.scheduler.engine_core_service import serve_scheduler
from services.worker.worker_service import load_worker, serve_worker, start_worker_server

TIMEOUT_S = 60
BLOCK = 16
# 24 blocks of KV cache per replica: room for two conversations' prefixes, not four.
ENGINE = {"dtype": "float32", "block_size": BLOCK, "swap_space": 0.01}
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@dataclass
class Replica:
    worker: object
    scheduler: object


class Cluster:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.replicas: list[Replica] = []

    async def start(self, count: int) -> None:
        for _ in range(count):
            worker = await serve_worker(self.args.model_config(), self.args.cache_config())
            scheduler = await serve_scheduler(worker.address, self.args, worker_timeout_s=60)
            self.replicas.append(Replica(worker, scheduler))

    @property
    def addresses(self) -> list[str]:
        return [r.scheduler.address for r in self.replicas]

    async def stop(self) -> None:
        for replica in self.replicas:
            await replica.scheduler.stop(0)
            await replica.worker.stop(0)


def _kv_bytes_for(folder, blocks: int) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    return blocks * BLOCK * per_token


@pytest.fixture
async def cluster(model_dir):
    folder = model_dir("llama")
    kv = _kv_bytes_for(folder, 24)
    args = EngineArgs(model=str(folder), kv_cache_memory=kv, **ENGINE)
    cluster = Cluster(args)
    try:
        await cluster.start(2)
        yield cluster
    finally:
        await cluster.stop()


async def _frontend(cluster: Cluster, folder, policy: str) -> Frontend:
    tokenizer = load_tokenizer(folder)
    router = RouterConfig(policy=policy)
    frontend = await connect_frontend(
        cluster.addresses, tokenizer, timeout_s=TIMEOUT_S, router=router
    )
    assert isinstance(frontend.client, DataParallelClient)
    await _wait_for_block_sizes(frontend.client)
    return frontend


async def _wait_for_block_sizes(client: DataParallelClient) -> None:
    """The routers know each replica's block size once its KV event snapshot arrived."""
    for _ in range(200):
        if all(r.block_size == BLOCK for r in client.replicas):
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no KV event snapshot from the replicas")


async def _run(frontend: Frontend, prompt: list[int], request_id: str, params=GREEDY):
    outputs = [o async for o in frontend.generate({"prompt_token_ids": prompt}, params, request_id)]
    return outputs[-1].outputs[0]


def _conversations(count: int = 4, turns: int = 5, seed: int = 0):
    """`count` conversations, each a 160-token system prompt (10 blocks) plus a short
    question per turn, in a shuffled order (so round robin cannot keep them apart)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 500) for _ in range(160)] for _ in range(count)]
    requests = [
        (c, t, [*systems[c], *[rng.randrange(3, 500) for _ in range(8)]])
        for c in range(count)
        for t in range(turns)
    ]
    rng.shuffle(requests)
    return requests


async def _hit_rate(frontend: Frontend) -> float:
    stats = (await frontend.engine_stats()).values()
    return sum(s.prefix_cache_hits for s in stats) / sum(s.prefix_cache_queries for s in stats)


@pytest.fixture(scope="module")
def expected(model_dir):
    """Each conversation request's greedy tokens from one offline engine (no routing)."""
    folder = model_dir("llama")
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="16MiB")
    requests = _conversations()
    prompts = [{"prompt_token_ids": p} for _, _, p in requests]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return {
        tuple(p): o.outputs[0].token_ids for (_, _, p), o in zip(requests, outputs, strict=True)
    }


async def _serve_conversations(frontend: Frontend, expected) -> dict[int, set[str]]:
    """Send every request (one at a time); check its tokens; where each conversation went."""
    client: DataParallelClient = frontend.client
    placed: dict[int, set[str]] = {}
    for i, (conversation, _turn, prompt) in enumerate(_conversations()):
        rid = f"c{conversation}-{i}"
        stream = frontend.generate({"prompt_token_ids": prompt}, GREEDY, rid)
        first = await asyncio.wait_for(anext(stream), TIMEOUT_S)
        placed.setdefault(conversation, set()).add(client.owner_of(rid))
        outputs = [first] + [o async for o in stream]
        assert outputs[-1].outputs[0].token_ids == expected[tuple(prompt)]
    return placed


async def test_cache_aware_routing_keeps_conversations_together(cluster, model_dir, expected):
    folder = model_dir("llama")
    frontend = await _frontend(cluster, folder, "cache_aware")
    try:
        placed = await _serve_conversations(frontend, expected)
        cache_aware = await _hit_rate(frontend)
        counts = frontend.routing_counts()
    finally:
        await frontend.close()
    assert all(len(replicas) == 1 for replicas in placed.values()), placed
    used = {next(iter(r)) for r in placed.values()}
    assert used == {"0", "1"}  # the four conversations spread over both replicas
    assert sum(n for (_, reason), n in counts.items() if reason == "cache_hit") == 16
    assert cache_aware > 0.7, cache_aware


async def test_round_robin_on_the_same_requests_hits_far_less(cluster, model_dir, expected):
    folder = model_dir("llama")
    frontend = await _frontend(cluster, folder, "round_robin")
    try:
        placed = await _serve_conversations(frontend, expected)
        round_robin = await _hit_rate(frontend)
    finally:
        await frontend.close()
    assert any(len(replicas) == 2 for replicas in placed.values())
    # Every replica sees all four prefixes, more than its cache holds: they evict each other.
    assert round_robin < 0.45, round_robin


async def _owned_by(frontend: Frontend, name: str, params, tag: str):
    """Start streams until one runs on replica `name`; (its stream, the others)."""
    client: DataParallelClient = frontend.client
    others = []
    for i in range(4):
        rid = f"{tag}-{i}"
        stream = frontend.generate({"prompt_token_ids": [5 + i, 17, 33, 99] * 4}, params, rid)
        await asyncio.wait_for(anext(stream), TIMEOUT_S)
        if client.owner_of(rid) == name:
            return stream, others
        others.append(stream)
    raise AssertionError(f"no request landed on replica {name}")


async def _drain(stream):
    return [o async for o in stream]


async def test_a_lost_replica_fails_only_its_requests_and_comes_back(cluster, model_dir):
    folder = model_dir("llama")
    frontend = await _frontend(cluster, folder, "cache_aware")
    client: DataParallelClient = frontend.client
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    try:
        doomed, others = await _owned_by(frontend, "0", long, "doomed")
        survivor, more = await _owned_by(frontend, "1", long, "survivor")
        others += more
        lost = cluster.replicas[0]
        port = lost.worker.port
        await lost.worker.stop(0)  # replica 0's worker dies mid-stream
        with pytest.raises(EngineUnavailableError, match="workers"):
            await asyncio.wait_for(_drain(doomed), TIMEOUT_S)
        finished = await asyncio.wait_for(_drain(survivor), TIMEOUT_S)
        assert finished[-1].outputs[0].finish_reason == "length"
        for stream in others:  # replica 0's ended with the error, replica 1's run on
            await stream.aclose()
        for _ in range(200):  # replica 0 reports NOT_SERVING: no longer routable
            if not client.replicas[0].routable:
                break
            await asyncio.sleep(0.05)
        assert not client.replicas[0].routable and frontend.is_ready
        before = frontend.routing_counts()
        for i in range(3):  # meanwhile every request goes to replica 1 and succeeds
            out = await asyncio.wait_for(_run(frontend, [40 + i] * 20, f"during-{i}"), TIMEOUT_S)
            assert out.finish_reason == "length"
        during = frontend.routing_counts()
        assert _sent_to(during, "0") == _sent_to(before, "0")

        lost.worker = await start_worker_server("127.0.0.1", port)
        await load_worker(lost.worker, cluster.args.model_config(), cluster.args.cache_config())
        for _ in range(400):
            if client.replicas[0].routable:
                break
            await asyncio.sleep(0.05)
        assert client.replicas[0].routable
        # The recovered replica is idle with an empty cache: new prompts go there again.
        for i in range(4):
            await asyncio.wait_for(_run(frontend, [60 + i] * 20, f"after-{i}"), TIMEOUT_S)
        assert _sent_to(frontend.routing_counts(), "0") > _sent_to(during, "0")
    finally:
        await frontend.close()


def _sent_to(counts: dict, engine: str) -> int:
    return sum(n for (name, _), n in counts.items() if name == engine)


async def test_an_n_3_group_is_served_by_one_replica_like_one_engine(cluster, model_dir):
    folder = model_dir("llama")
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    offline = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    frontend = await _frontend(cluster, folder, "cache_aware")
    client: DataParallelClient = frontend.client
    try:
        stream = frontend.generate({"prompt_token_ids": prompt}, params, "group")
        outputs = [await asyncio.wait_for(anext(stream), TIMEOUT_S)]
        owner = client.owner_of("group")
        other = client.replicas[1 - int(owner)]
        outputs += [o async for o in stream]
        untouched = (await other.client.stats()).prefix_cache_queries == 0
    finally:
        await frontend.close()
    final = outputs[-1]
    assert [o.token_ids for o in final.outputs] == [o.token_ids for o in offline.outputs]
    assert other.in_flight == set() and untouched  # no sequence of the group went there
