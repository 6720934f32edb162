"""LoRA adapters through the offline LLM and the AsyncEngine on the tiny llama, against PEFT.

Three random PEFT adapters made here: q/v at rank 4, every linear at rank 16 with
use_rslora, the MLP at rank 16 (each with lora_alpha != r). Greedy outputs equal PEFT's
(PeftModel in float32; merge_and_unload for one), a divergence only where the reference's
own top-2 logits tie (tests/helpers/peft_reference.py): requests of several adapters and
of the base in the same steps, chunked prefill, prefix hits, preemption by recompute and
by swap, max_loras=1 with three adapters in flight, chat and streaming; prompt
log-probabilities across chunks and those of n > 1 samples are the adapter's. The prefix
cache never shares blocks between two adapters, the base, or two sets of weights under
one name. Bad adapters are refused with a ValueError naming the problem, and the engine
serves the next request as before.

The tests that compute run on both CPU paths: the default (the native C++ step where it
applies) and the torch path (enforce_eager=True). One LLM per configuration and path
for the module."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pagestream import LLM, AsyncEngine, LoRARequest, RequestOutputKind, SamplingParams
from services.common.block_hash import hash_request_tokens
from tests.helpers.parallel import set_preemption_mode
from tests.helpers.peft_reference import ATTENTION, MLP, PeftReference, save_adapter
from tests.helpers.tiny_models import build_tiny_model
from tests.helpers.tiny_tokenizer import VOCAB

LORA = dict(dtype="float32", enable_lora=True, max_lora_rank=16)
ENGINES = {
    # roomy: every adapter of a call in the same steps
    "main": dict(LORA, max_loras=3, kv_cache_memory="8MiB", block_size=4),
    # 12 blocks of 4 tokens (2 layers x 2 KV heads x 16 dims float32: 2 KiB a block),
    # 16-token steps, at most 8 prompt tokens of one request a step
    "tight": dict(
        LORA,
        max_loras=2,
        block_size=4,
        kv_cache_memory=12 * 2048,
        swap_space=0.01,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
    ),
    # one adapter at a time, two kept loaded by the worker (the third is read again)
    "one": dict(LORA, max_loras=1, max_cpu_loras=2, kv_cache_memory="8MiB", block_size=4),
}
PATHS = ["default", "torch"]


@pytest.fixture(scope="module")
def folder(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def peft(folder):
    return PeftReference(folder)


@pytest.fixture(scope="module")
def adapters(folder, tmp_path_factory) -> dict[str, LoRARequest]:
    """name -> the LoRARequest of one of the module's three adapters."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {
        "qv": dict(seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        "all": dict(seed=2, r=16, lora_alpha=8, target_modules=ATTENTION + MLP, use_rslora=True),
        "mlp": dict(seed=3, r=16, lora_alpha=24, target_modules=MLP),
    }
    loras = {}
    for lora_id, (name, spec) in enumerate(specs.items(), start=1):
        path = save_adapter(folder, root / name, **spec)
        loras[name] = LoRARequest(name, lora_id, str(path))
    return loras


@pytest.fixture(scope="module")
def engines(folder):
    """(configuration, path) -> the module's LLM of ENGINES[configuration], built once on
    the default CPU path or the torch one."""
    built: dict[tuple[str, str], LLM] = {}

    def get(kind: str, path: str = "default") -> LLM:
        if (kind, path) not in built:
            llm = LLM(str(folder), enforce_eager=path == "torch", **ENGINES[kind])
            native = llm.engine.worker.model.model.native
            if path == "torch":
                assert native is None
            else:  # float32 on the CPU: the native step runs, with the adapters
                assert native is not None
            built[(kind, path)] = llm
        return built[(kind, path)]

    yield get
    for llm in built.values():
        llm.engine.close()


@pytest.fixture(params=PATHS)
def path(request):
    return request.param


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def _run(llm, prompts, params, loras):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, False, loras)


def _path(lora: LoRARequest | None) -> str | None:
    return None if lora is None else lora.lora_path


def _assert_all_greedy(peft, prompts, loras, outputs, max_tokens):
    for i, (prompt, lora, out) in enumerate(zip(prompts, loras, outputs, strict=True)):
        name = lora.lora_name if lora else "base"
        got = list(out.outputs[0].token_ids)
        peft.assert_greedy(_path(lora), prompt, got, max_tokens, what=f"prompt {i} ({name})")


def _record_steps(llm, monkeypatch) -> list[tuple[set[str], int]]:
    """Every step's (adapters of its rows, rows without one), as the scheduler plans it."""
    table = llm.engine.scheduler.loras
    steps: list[tuple[set[str], int]] = []
    assign = table.assign

    def recording(scheduled, running):
        rows, slots = assign(scheduled, running)
        assert len(set(rows.values())) <= table.max_loras
        names = {slots[s].lora_name for s in rows.values()}
        steps.append((names, sum(r.lora_request is None for r in scheduled)))
        return rows, slots

    monkeypatch.setattr(table, "assign", recording)
    return steps


def _assert_idle(llm):
    scheduler = llm.engine.scheduler
    assert not llm.engine.has_unfinished_requests()
    assert not scheduler.running and not scheduler.waiting and not scheduler.swapped
    assert scheduler.kv.num_free_blocks == llm.engine.cache_info.num_device_blocks


def test_mixed_steps_equal_peft_and_adapters_change_the_output(
    engines, path, adapters, peft, monkeypatch
):
    """Three adapters and the base in the same steps; the first prompt under each of them
    gives four different outputs (the adapters are applied, each to its own rows)."""
    llm = engines("main", path)
    steps = _record_steps(llm, monkeypatch)
    a, b, c = adapters["qv"], adapters["all"], adapters["mlp"]
    shared, *others = _prompts(1, [13, 5, 22, 9, 17, 30])
    prompts = [shared] * 4 + others
    loras = [a, b, c, None, b, None, a, c, None]
    prompts = prompts + [others[0]] * (len(loras) - len(prompts))
    outputs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=10), loras)
    _assert_all_greedy(peft, prompts, loras, outputs, 10)
    first = [tuple(out.outputs[0].token_ids) for out in outputs[:4]]
    assert len(set(first)) == 4, first
    assert any(len(names) == 3 and base > 0 for names, base in steps), steps
    _assert_idle(llm)


def test_equals_the_merged_model(engines, adapters, peft):
    """PEFT's merge_and_unload (W + scale * B A in one weight) as the reference."""
    llm = engines("main")
    lora = adapters["all"]
    prompts = _prompts(2, [7, 19])
    outputs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=12), lora)
    for prompt, out in zip(prompts, outputs, strict=True):
        got = list(out.outputs[0].token_ids)
        merged = peft.assert_greedy(lora.lora_path, prompt, got, 12, merged=True)
        assert merged != peft.greedy(None, prompt, 12)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_and_preemption(engines, path, adapters, peft, mode):
    """Prompts longer than a step's budget (chunks of at most 8 tokens) under two adapters
    and the base, in 12 blocks: requests are preempted (and a third adapter waits for a
    slot); every output still equals PEFT's."""
    llm = engines("tight", path)
    set_preemption_mode(llm, mode)
    scheduler = llm.engine.scheduler
    preemptions = scheduler.num_preemptions
    prompts = _prompts(3 if mode == "swap" else 4, [20, 23, 18, 21, 19, 22])
    loras = [adapters["qv"], adapters["all"], None, adapters["mlp"], adapters["qv"], None]
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = _run(llm, prompts, params, loras)
    assert scheduler.num_preemptions > preemptions
    _assert_all_greedy(peft, prompts, loras, outputs, 8)
    _assert_idle(llm)


def test_prompt_logprobs_across_chunks_are_the_adapters(engines, path, adapters, peft):
    """Prompt log-probabilities of prompts split into chunks (two adapters and the base in
    the same steps): every position's are PEFT's with the request's adapter."""
    llm = engines("tight", path)
    prompts = _prompts(14, [19, 13, 17])
    loras = [adapters["all"], None, adapters["mlp"]]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = _run(llm, prompts, params, loras)
    for prompt, lora, out in zip(prompts, loras, outputs, strict=True):
        reference = peft.logprobs(_path(lora), prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for position in range(1, len(prompt)):
            token = prompt[position]
            got = out.prompt_logprobs[position][token].logprob
            expected = float(reference[position - 1, token])
            assert got == pytest.approx(expected, abs=1e-4), (lora, position)


def test_prefix_hits_stay_within_the_adapter(engines, path, adapters, peft):
    """The same long prompt twice under one adapter: the second run reads the first's
    blocks and gives the same (PEFT's) output; a prompt sharing its first blocks too."""
    llm = engines("main", path)
    lora = adapters["all"]
    prompt, tail = _prompts(5, [26, 6])
    params = SamplingParams(temperature=0, max_tokens=8)
    first = _run(llm, [prompt], params, lora)[0]
    again, longer = _run(llm, [prompt, prompt[:16] + tail], params, lora)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 24 and longer.num_cached_tokens == 16
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    _assert_all_greedy(
        peft, [prompt, prompt, prompt[:16] + tail], [lora] * 3, [first, again, longer], 8
    )


def test_max_loras_1_serves_three_adapters_in_turn(engines, path, adapters, peft, monkeypatch):
    """Three adapters and the base in one call with one slot: no step holds two adapters,
    base rows join any step, and the worker (two adapters kept loaded) reads the third
    again when it comes back."""
    llm = engines("one", path)
    steps = _record_steps(llm, monkeypatch)
    a, b, c = adapters["qv"], adapters["all"], adapters["mlp"]
    prompts = _prompts(6, [9, 14, 11, 6, 17, 8, 12])
    loras = [a, b, c, None, c, b, a]
    params = SamplingParams(temperature=0, max_tokens=8)
    for _ in range(2):
        outputs = _run(llm, prompts, params, loras)
        _assert_all_greedy(peft, prompts, loras, outputs, 8)
    assert all(len(names) <= 1 for names, _ in steps)
    assert {name for names, _ in steps for name in names} == {"qv", "all", "mlp"}
    assert any(names and base for names, base in steps)  # base rows beside an adapter's
    _assert_idle(llm)


def test_identities_never_share_blocks(engines, adapters, peft):
    """A prompt of six blocks under A, B, the base, then A again: only A's second run (and
    the base's second) reads cached blocks."""
    llm = engines("main")
    a, b = adapters["qv"], adapters["mlp"]
    prompt = _prompts(7, [24])[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    runs = [(lora, _run(llm, [prompt], params, lora)[0]) for lora in (a, b, None, a, None)]
    assert [out.num_cached_tokens for _, out in runs] == [0, 0, 0, 20, 20]
    for lora, out in runs:
        peft.assert_greedy(_path(lora), prompt, list(out.outputs[0].token_ids), 6)
    assert runs[0][1].outputs[0].token_ids == runs[3][1].outputs[0].token_ids
    assert len({tuple(out.outputs[0].token_ids) for _, out in runs[:3]}) == 3


def test_new_weights_under_the_same_name_are_a_new_identity(engines, folder, peft, tmp_path):
    """The folder rewritten with other weights and asked for with a new LoRARequest (same
    name, a new id, as vLLM users reload), and other weights in another folder under the
    same name and id: each set of weights gives its own output, with no block of another."""
    llm = engines("main")
    targets = ["q_proj", "o_proj", "down_proj"]
    first = save_adapter(
        folder, tmp_path / "first", seed=20, r=4, lora_alpha=16, target_modules=targets
    )
    prompt = _prompts(8, [20])[0]
    params = SamplingParams(temperature=0, max_tokens=8)

    def run(lora):
        out = _run(llm, [prompt], params, lora)[0]
        got = list(out.outputs[0].token_ids)
        return out.num_cached_tokens, tuple(peft.assert_greedy(lora.lora_path, prompt, got, 8))

    old = LoRARequest("reloaded", 40, str(first))
    cached, old_ids = run(old)
    assert cached == 0
    save_adapter(folder, first, seed=21, r=4, lora_alpha=16, target_modules=targets)
    cached, new_ids = run(LoRARequest("reloaded", 41, str(first)))
    assert cached == 0 and new_ids != old_ids
    second = save_adapter(
        folder, tmp_path / "second", seed=22, r=4, lora_alpha=16, target_modules=targets
    )
    cached, other_ids = run(LoRARequest("reloaded", 41, str(second)))
    assert cached == 0 and other_ids not in (old_ids, new_ids)
    cached, again = run(LoRARequest("reloaded", 41, str(first)))
    assert cached == 16 and again == new_ids


def test_n_samples_keep_the_adapter(engines, path, adapters, peft):
    """n = 3 seeded samples under one adapter (beside a greedy request of another): each
    sample's log-probabilities are PEFT's with that adapter, not the base's."""
    llm = engines("main", path)
    lora, other = adapters["all"], adapters["qv"]
    prompt, greedy_prompt = _prompts(9, [13, 10])
    sampled = SamplingParams(
        n=3, temperature=0.9, seed=5, max_tokens=8, logprobs=1, ignore_eos=True
    )
    greedy = SamplingParams(temperature=0, max_tokens=8)
    out, plain = _run(llm, [prompt, greedy_prompt], [sampled, greedy], [lora, other])
    peft.assert_greedy(other.lora_path, greedy_prompt, list(plain.outputs[0].token_ids), 8)
    assert len(out.outputs) == 3
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # really three samples
    largest_from_base = 0.0
    for sample in out.outputs:
        ids = list(sample.token_ids)
        assert len(ids) == 8
        reference = peft.logprobs(lora.lora_path, prompt + ids)[len(prompt) - 1 : -1]
        base = peft.logprobs(None, prompt + ids)[len(prompt) - 1 : -1]
        for step, (token, entry) in enumerate(zip(ids, sample.logprobs, strict=True)):
            got = entry[token].logprob
            assert got == pytest.approx(float(reference[step, token]), abs=1e-4), (
                sample.index,
                step,
            )
            largest_from_base = max(largest_from_base, abs(got - float(base[step, token])))
    assert largest_from_base > 0.1  # the check could tell the base from the adapter


def test_chat_with_an_adapter(engines, adapters, peft):
    llm = engines("main")
    lora = adapters["mlp"]
    params = SamplingParams(temperature=0, max_tokens=8)
    conversations = [
        [{"role": "user", "content": "The quick brown fox"}],
        [{"role": "user", "content": "def main():"}],
    ]
    outputs = llm.chat(conversations, params, use_tqdm=False, lora_request=[lora, None])
    alone = llm.chat(conversations[0], params, use_tqdm=False, lora_request=lora)[0]
    assert alone.outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for out, which in zip(outputs, (lora, None), strict=True):
        assert out.prompt_token_ids[0] == 1 and out.outputs[0].text  # the template's <s>
        peft.assert_greedy(_path(which), out.prompt_token_ids, list(out.outputs[0].token_ids), 8)
    base = peft.greedy(None, outputs[0].prompt_token_ids, 8)
    assert list(outputs[0].outputs[0].token_ids) != base


# ---- refusals ---------------------------------------------------------------------------


def _bad_adapter(kind: str, folder: Path, good: LoRARequest, root: Path) -> tuple[str, str]:
    """(its folder, what the error names) for one kind of bad adapter."""
    targets = ["q_proj", "v_proj"]
    path = root / kind
    if kind == "missing folder":
        return str(path), "does not exist"
    if kind == "missing adapter_config.json":
        shutil.copytree(good.lora_path, path)
        (path / "adapter_config.json").unlink()
        return str(path), "adapter_config.json is missing"
    if kind == "rank over max_lora_rank":
        save_adapter(folder, path, seed=30, r=32, lora_alpha=32, target_modules=targets)
        return str(path), "rank 32 is over max_lora_rank"
    if kind in ("lm_head", "embed_tokens"):
        save_adapter(folder, path, seed=31, r=4, lora_alpha=8, target_modules=[*targets, kind])
        return str(path), kind
    if kind == "a module the model lacks":  # PEFT's keys renamed: o_proj -> c_proj
        save_adapter(folder, path, seed=32, r=4, lora_alpha=8, target_modules=["o_proj"])
        file = path / "adapter_model.safetensors"
        tensors = {k.replace("o_proj", "c_proj"): v for k, v in load_file(file).items()}
        save_file(tensors, file)
        return str(path), "targets 'c_proj', which the model does not have"
    if kind == "another hidden size":
        other = build_tiny_model("llama", vocab_size=VOCAB, hidden_size=32)
        save_adapter(other, path, seed=33, r=4, lora_alpha=8, target_modules=targets)
        return str(path), r"q_proj\.lora_A has shape \[4, 32\], the base model needs \[4, 64\]"
    if kind == "more layers":
        other = build_tiny_model("llama", vocab_size=VOCAB, num_hidden_layers=3)
        save_adapter(other, path, seed=34, r=4, lora_alpha=8, target_modules=targets)
        return str(path), "is for layer 2; the model has 2 layers"
    raise KeyError(kind)


BAD = [
    "missing folder",
    "missing adapter_config.json",
    "rank over max_lora_rank",
    "lm_head",
    "embed_tokens",
    "a module the model lacks",
    "another hidden size",
    "more layers",
]


@pytest.mark.parametrize("kind", BAD)
def test_bad_adapters_are_refused_by_name(engines, folder, adapters, peft, tmp_path, kind):
    """generate refuses the whole call (a good request given before the bad one is
    withdrawn); the engine serves the next call as before and is left idle."""
    llm = engines("main")
    good = adapters["qv"]
    bad_path, names = _bad_adapter(kind, folder, good, tmp_path)
    bad = LoRARequest(f"bad-{kind}", 90, bad_path)
    prompt = _prompts(10, [9])[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    with pytest.raises(ValueError, match=names):
        _run(llm, [prompt, prompt], params, [good, bad])
    # the withdrawn request's final output (an abort) comes with the next step: the next
    # call's outputs are its own
    outputs = _run(llm, [prompt], params, good)
    assert len(outputs) == 1
    out = outputs[0]
    peft.assert_greedy(good.lora_path, prompt, list(out.outputs[0].token_ids), 6)
    _assert_idle(llm)


def test_lora_is_refused_when_not_enabled(llm, adapters, hf_greedy, folder):
    """tests/conftest.py's llm: the tiny llama without enable_lora."""
    prompt = _prompts(11, [9])[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        _run(llm, [prompt], params, adapters["qv"])
    assert not llm.engine.has_unfinished_requests()
    out = _run(llm, [prompt], params, None)[0]
    assert list(out.outputs[0].token_ids) == hf_greedy(folder, prompt, 6)


# ---- AsyncEngine ------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["in-process", "engine-core-process"])
async def lora_engine(folder, request):
    engine = AsyncEngine.from_args(
        str(folder), engine_core_process=request.param, **ENGINES["main"]
    )
    yield engine
    await engine.shutdown()


async def test_async_engine_streams_with_adapters(lora_engine, adapters, peft):
    """Concurrent delta streams under two adapters and the base (the engine core in this
    process and in its own); a bad adapter ends only its own stream, with the ValueError."""
    import asyncio

    prompt = _prompts(12, [11])[0]
    params = SamplingParams(temperature=0, max_tokens=10, output_kind=RequestOutputKind.DELTA)
    loras = [adapters["qv"], adapters["all"], None]

    async def stream(lora):
        chunks = []
        async for out in lora_engine.generate(
            {"prompt_token_ids": prompt}, params, lora_request=lora
        ):
            chunks.append(list(out.outputs[0].token_ids))
        return chunks

    results = await asyncio.gather(*(stream(lora) for lora in loras))
    ids = []
    for lora, chunks in zip(loras, results, strict=True):
        assert len(chunks) > 1  # it streamed
        got = [t for chunk in chunks for t in chunk]
        peft.assert_greedy(_path(lora), prompt, got, 10, what=lora.lora_name if lora else "base")
        ids.append(tuple(got))
    assert len(set(ids)) == 3
    with pytest.raises(ValueError, match="does not exist"):
        await stream(LoRARequest("nowhere", 91, "/nonexistent/adapter"))
    again = await stream(loras[0])
    assert tuple(t for chunk in again for t in chunk) == ids[0]


def test_a_folder_rewritten_in_place_never_mixes_weights(folder, adapters, peft, tmp_path):
    """The same LoRARequest (name, id, path) asked for again after its folder was rewritten
    with other weights and the worker let the old weights go (max_cpu_loras=1): the output
    is the old weights' (one identity, one set of weights) or the new weights' (a new
    identity, then no block of the old weights is read), never a mix of both."""
    llm = LLM(str(folder), **dict(ENGINES["one"], max_cpu_loras=1))
    targets = ["q_proj", "v_proj"]
    path = save_adapter(folder, tmp_path / "x", seed=40, r=4, lora_alpha=8, target_modules=targets)
    old_copy = shutil.copytree(path, tmp_path / "x-old")
    prompt = _prompts(13, [24])[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    first = _run(llm, [prompt], params, LoRARequest("rewritten", 60, str(path)))[0]
    old = peft.assert_greedy(old_copy, prompt, list(first.outputs[0].token_ids), 6)
    save_adapter(folder, path, seed=41, r=4, lora_alpha=8, target_modules=targets)
    new = peft.greedy(path, prompt, 6)
    assert new != old
    _run(llm, [prompt], params, adapters["qv"])  # another adapter takes the slot and host
    out = _run(llm, [prompt], params, LoRARequest("rewritten", 60, str(path)))[0]
    got = list(out.outputs[0].token_ids)
    llm.engine.close()
    assert got == old or (got == new and out.num_cached_tokens == 0), (
        f"got {got} with {out.num_cached_tokens} cached tokens; the old weights give {old}, "
        f"the new ones {new}"
    )


def test_an_adapter_that_will_not_load_on_the_worker_fails_only_its_request(
    engines, adapters, tmp_path
):
    """The frontend checked the adapter, then its folder went away before a worker loaded
    it: that request ends with finish reason "error" naming the adapter, its blocks leave
    the prefix cache, and the engine serves on (base and other adapters)."""
    llm = engines("main")
    folder = shutil.copytree(adapters["qv"].lora_path, tmp_path / "vanishing")
    lora = llm.engine.input_processor.loras.check(LoRARequest("vanishing", 99, str(folder)))
    shutil.rmtree(folder)
    prompt = _prompts(7, [40])[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    processor = llm.engine.input_processor
    request, state = processor.make_request(None, {"prompt_token_ids": prompt}, params)
    request = dataclasses.replace(request, lora_request=lora)  # past the frontend's check
    llm.engine.output_processor.add(state)
    llm.engine.core.add_request(request)
    final = None
    while llm.engine.has_unfinished_requests():
        for output in llm.engine.step():
            if output.request_id == request.request_id and output.finished:
                final = output
    assert final is not None and final.outputs[0].finish_reason == "error"
    pool = llm.engine.scheduler.kv.pool
    hashes = hash_request_tokens(prompt, 4, lora_identity=lora.identity)
    assert hashes and not any(h in pool.cached_block_hash_to_block for h in hashes)
    for other in (None, adapters["qv"]):  # the base and other adapters still run
        assert _run(llm, [prompt], params, [other])[0].outputs[0].finish_reason == "length"
