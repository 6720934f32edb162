"""Hostile inputs against the engine side: a long prompt's prompt logprobs stay within the
profiled logits, a cancelled add never leaves a request running unread, grammars that
blow up fail fast, and KV events go only to authenticated internal peers."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from types import SimpleNamespace

import grpc
import pytest
import torch

from services.common.config import CacheConfig, SchedulerConfig
from services.common.proto.pagestream.internal.v1 import engine_pb2, engine_pb2_grpc
from services.common.rank_info import RankInfo
from services.common.sampling_params import SamplingParams
from services.common.served_model_info import ServedModelInfo
from services.common.tls import TlsConfig
from services.frontend.frontend import Frontend
from services.frontend.grpc_engine_client import GrpcEngineCoreClient
from services.scheduler.async_engine_core import AsyncEngineCore
from services.scheduler.engine_core import EngineCore
from services.scheduler.engine_core_service import serve_engine_core
from services.scheduler.executor.uni import UniExecutor
from services.scheduler.kv_events_access import KvEventsAccess, is_local_peer
from services.scheduler.scheduler import Scheduler
from services.scheduler.structured_output_manager import GrammarError, StructuredOutputManager
from services.worker.model_runner import ModelRunner
from services.worker.sampler import compute_token_logprobs
from services.worker.step_inputs import PromptLogprobsInputs
from tests.common.certs import make_pki
from tests.helpers.eventually import eventually_async
from tests.helpers.tiny_tokenizer import build_tokenizer
from tests.scheduler.stand_in_worker import EOS_TOKEN_ID, VOCAB_SIZE, StandInWorker, make_request

VOCAB = 97
TIMEOUT_S = 30  # a safety net against hangs, never a timing assertion
NUM_BLOCKS = 1024  # room for a request to run to its 2000 tokens
INFO = ServedModelInfo("stand-in", 2048, VOCAB_SIZE, (EOS_TOKEN_ID,), block_size=4)


class _LogitsRecorder:
    """Stands in for a CausalLM: a fixed projection to the vocabulary, recording how many
    rows each compute_logits call got."""

    def __init__(self) -> None:
        self.weight = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))
        self.rows_seen: list[int] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.rows_seen.append(hidden.shape[0])
        return hidden @ self.weight  # [rows, vocab]


def _spec(num_rows: list[int], ks: list[int]) -> PromptLogprobsInputs:
    total = sum(num_rows)
    return PromptLogprobsInputs(
        request_ids=[f"r{i}" for i in range(len(num_rows))],
        num_rows=num_rows,
        first_positions=[1] * len(num_rows),
        num_logprobs=ks,
        token_indices=torch.arange(total, dtype=torch.int64),
        target_ids=torch.arange(total, dtype=torch.int64) % VOCAB,
    )


def test_prompt_logprobs_of_a_long_chunk_are_computed_in_bounded_slices() -> None:
    """A prefill chunk of prompt-logprob rows never turns into [chunk, vocab] float32 logits
    at once: at most max_num_seqs rows (what the memory profile counted) at a time."""
    model = _LogitsRecorder()
    runner = ModelRunner(model, None, SimpleNamespace(max_num_seqs=4), None, RankInfo())
    hidden = torch.randn(11, 8, generator=torch.Generator().manual_seed(1))  # [tokens, hidden]
    spec = _spec([7, 4], [2, 0])

    result = runner._prompt_logprobs(hidden, spec)

    assert model.rows_seen and max(model.rows_seen) <= 4
    full = compute_token_logprobs(hidden @ model.weight, spec.target_ids, 2)
    first = result["r0"][1:]  # position 0 has no logprob
    assert [e.token_ids for e in first] == full.token_ids[:7, :3].tolist()
    assert [e.ranks for e in result["r1"][1:]] == full.ranks[7:, :1].tolist()
    torch.testing.assert_close(torch.tensor([e.logprobs for e in first]), full.logprobs[:7, :3])


# ---- a client that hangs up while its request is being added --------------------------


class _SlowSend:
    """The frontend's Connect call, its first write held after sending as a send waiting on
    HTTP/2 flow control is; cancelled meanwhile it cancels the call, as grpc.aio does."""

    def __init__(self, call) -> None:
        self.call = call
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    async def write(self, message) -> None:
        await self.call.write(message)
        if self.holding.is_set():
            return
        self.holding.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.call.cancel()
            raise

    def __getattr__(self, name):
        return getattr(self.call, name)


@pytest.fixture
async def grpc_stand_in():
    """A Frontend over GrpcEngineCoreClient over the EngineCore service of a stand-in worker."""
    config = SchedulerConfig(max_model_len=2048, max_num_batched_tokens=32)
    scheduler = Scheduler(config, CacheConfig(block_size=4), num_device_blocks=NUM_BLOCKS)
    worker = StandInWorker(NUM_BLOCKS, 4)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(worker)))
    server = await serve_engine_core(core, INFO)
    client = await GrpcEngineCoreClient.connect(server.address, timeout_s=TIMEOUT_S)
    frontend = Frontend(client, build_tokenizer(), INFO)
    yield SimpleNamespace(frontend=frontend, client=client, scheduler=scheduler, worker=worker)
    await frontend.close()
    await server.stop(0)


async def _run(frontend, request_id: str, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    return [o async for o in frontend.generate(prompt, params, request_id)][-1]


async def test_a_client_gone_during_its_add_leaves_nothing_running(grpc_stand_in):
    """A consumer cancelled while its add is on the way: its request ends in the engine
    core (aborted, blocks freed) and nobody else's request on the same stream fails."""
    frontend, scheduler = grpc_stand_in.frontend, grpc_stand_in.scheduler
    steady = asyncio.create_task(_run(frontend, "steady", 60))
    await eventually_async(lambda: "steady" in scheduler.requests, timeout=TIMEOUT_S)
    slow = _SlowSend(grpc_stand_in.client._call)
    grpc_stand_in.client._call = slow
    victim = asyncio.create_task(_run(frontend, "victim", 2000))
    await asyncio.wait_for(slow.holding.wait(), TIMEOUT_S)
    victim.cancel()
    await asyncio.sleep(0.05)
    slow.release.set()
    with pytest.raises(asyncio.CancelledError):
        await victim

    final = await asyncio.wait_for(steady, TIMEOUT_S)
    assert final.outputs[0].finish_reason == "length"
    assert len(final.outputs[0].token_ids) == 60
    await eventually_async(lambda: not scheduler.requests, timeout=TIMEOUT_S)
    assert scheduler.kv.num_free_blocks == NUM_BLOCKS
    victim_steps = [p for p in grpc_stand_in.worker.plans if "victim" in p.num_scheduled_tokens]
    assert 0 < len(victim_steps) < 1000  # it reached the engine core, and was aborted there
    assert frontend.num_live_requests() == 0
    assert not frontend.output_processor.states


# ---- KV events: only to authenticated internal peers ----------------------------------


@pytest.mark.parametrize(
    ("peer", "local"),
    [
        ("ipv4:127.0.0.1:40000", True),
        ("ipv4:127.8.9.10:40000", True),
        ("ipv6:[::1]:40000", True),
        ("ipv6:%5B::1%5D:40000", True),
        ("ipv6:[::ffff:127.0.0.1]:40000", True),
        ("unix:/tmp/pagestream.sock", True),
        ("ipv4:10.0.0.7:40000", False),
        ("ipv6:[fd00::2]:40000", False),
        ("ipv6:[::ffff:10.0.0.7]:40000", False),
        ("ipv4:not-an-address:1", False),
        ("vsock:3:1024", False),
    ],
)
def test_local_peers_are_loopback_and_unix_sockets(peer, local) -> None:
    assert is_local_peer(peer) is local


def test_kv_events_go_to_local_or_certified_peers_only() -> None:
    remote, certified = "ipv4:10.0.0.7:40000", [b"frontend"]
    plain = KvEventsAccess()
    assert plain.refusal("ipv4:127.0.0.1:1", None) is None
    assert "--tls-ca" in plain.refusal(remote, None)
    assert plain.refusal(remote, certified) is not None  # not a port that verifies them
    mtls = KvEventsAccess(mutual_tls=True)
    assert mtls.refusal(remote, certified) is None
    assert mtls.refusal(remote, None) is not None
    assert KvEventsAccess("any").refusal(remote, None) is None
    assert "--kv-events off" in KvEventsAccess("off").refusal("unix:/x", None)
    with pytest.raises(ValueError, match="kv_events must be one of"):
        KvEventsAccess("open")


async def _watch(address: str) -> grpc.StatusCode | None:
    """The first KV-event batch over a plain channel, as anyone who reaches the port would
    ask for it: None when one came, else the call's status code."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineCoreStub(channel)
        call = stub.WatchKvEvents(engine_pb2.WatchKvEventsRequest(), timeout=TIMEOUT_S)
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            call.cancel()
    return None


def _host_address() -> str | None:
    """This host's address on its default route, when it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent: it only picks a route
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


@pytest.fixture
async def exposed_engine_core():
    """An engine core on every interface, plaintext (as `scheduler --host 0.0.0.0`)."""
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=32)
    scheduler = Scheduler(config, CacheConfig(block_size=4), num_device_blocks=16)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(StandInWorker(16, 4))))
    server = await serve_engine_core(core, INFO, "0.0.0.0", 0)
    yield server
    await server.stop(0)


async def test_kv_events_are_refused_to_a_remote_plaintext_peer(exposed_engine_core):
    host = _host_address()
    if host is None:
        pytest.skip("this host has no address but loopback to connect from")
    assert await _watch(f"127.0.0.1:{exposed_engine_core.port}") is None
    refused = await _watch(f"{host}:{exposed_engine_core.port}")
    assert refused == grpc.StatusCode.PERMISSION_DENIED


async def test_kv_events_off_refuses_everyone():
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=32)
    scheduler = Scheduler(config, CacheConfig(block_size=4), num_device_blocks=16)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(StandInWorker(16, 4))))
    server = await serve_engine_core(core, INFO, kv_events="off")
    try:
        assert await _watch(server.address) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await server.stop(0)


async def test_kv_events_reach_a_remote_peer_with_a_client_certificate(tmp_path):
    """Mutual TLS on every interface: a remote frontend with a certificate from --tls-ca
    watches (grpc's peer_identities hold its verified certificate)."""
    host = _host_address()
    if host is None:
        pytest.skip("this host has no address but loopback to connect from")
    pki = make_pki(tmp_path)
    config = SchedulerConfig(max_model_len=256, max_num_batched_tokens=32)
    scheduler = Scheduler(config, CacheConfig(block_size=4), num_device_blocks=16)
    core = AsyncEngineCore(EngineCore(scheduler, UniExecutor(StandInWorker(16, 4))))
    tls = TlsConfig(pki.server.cert, pki.server.key, pki.ca)
    server = await serve_engine_core(core, INFO, "0.0.0.0", 0, tls)
    client = TlsConfig(pki.client.cert, pki.client.key, pki.ca).channel_credentials()
    options = [("grpc.ssl_target_name_override", "localhost")]  # the leaf names localhost
    try:
        async with grpc.aio.secure_channel(f"{host}:{server.port}", client, options) as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            call = stub.WatchKvEvents(engine_pb2.WatchKvEventsRequest(), timeout=TIMEOUT_S)
            batch = await call.read()
            call.cancel()
        assert batch.reset
    finally:
        await server.stop(0)


# ---- grammars whose compile blows up ----------------------------------------------------


def _all_of_any_of(depth: int) -> dict:
    """A small JSON schema whose grammar doubles per level: allOf over anyOf, through
    $defs, so the text stays linear while the intersection llguidance must build does not."""
    defs = {"l0": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3)}}}
    for level in range(1, depth + 1):
        previous = {"$ref": f"#/$defs/l{level - 1}"}
        other = [{"type": "object", "properties": {f"x{j}": {"type": "integer"}}} for j in range(2)]
        defs[f"l{level}"] = {"allOf": [{"anyOf": [previous, o]} for o in other]}
    return {"$defs": defs, "$ref": f"#/$defs/l{depth}"}


def test_a_grammar_that_blows_up_fails_by_itself_long_before_the_timeout():
    """llguidance bounds a compile's work (grammar size, lexer fuel): the compile ends with
    an error naming the problem, its thread free again, however long the timeout is."""
    tokenizer_json = build_tokenizer().backend_tokenizer.to_str()
    manager = StructuredOutputManager(
        lambda: tokenizer_json, VOCAB_SIZE, [EOS_TOKEN_ID], compile_timeout_s=3600
    )
    request = make_request("blowup", [5, 6, 7], structured_outputs={"json": _all_of_any_of(12)})
    try:
        manager.admit(request)
        with pytest.raises(GrammarError, match="too large"):
            request.grammar.future.result(timeout=TIMEOUT_S)
        with pytest.raises(GrammarError, match="too large"):
            manager.ready(request)
    finally:
        manager.close()
