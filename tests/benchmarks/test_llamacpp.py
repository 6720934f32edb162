"""benchmarks/llamacpp.py without llama.cpp: the continuous batching loop against a fake
llama.cpp that checks every batch (positions, sequence ids, n_batch, freed KV) and whose
greedy token is a function of the sequence so far; the missing-extra error; the ratios and
the report. Real llama.cpp (the bench extra, not installed in CI, so not tested here: a
test may only be skipped for missing hardware) is checked by every `bench throughput
--llamacpp` run itself: its F32 greedy outputs against pagestream float32's over the whole
workload (64 of 64 equal on the default model), in the report."""

from __future__ import annotations

import ctypes
import sys
import types

import pytest

from benchmarks import llamacpp
from benchmarks.cli import run_bench
from benchmarks.llamacpp import (
    LlamaCppEngine,
    LlamaCppOptions,
    check_agreement,
    check_requests,
    import_llama_cpp,
)
from benchmarks.reports import THROUGHPUT
from benchmarks.results import RunResult
from benchmarks.throughput import ThroughputOptions, _llamacpp_ratios, run_throughput
from benchmarks.workload import BenchRequest
from tests.benchmarks.bench import bench_args

VOCAB = 97


def next_token(history: list[int]) -> int:
    return (sum(history) * 31 + len(history)) % VOCAB


class FakeLlama:
    """The few llama.cpp calls the engine makes; each sequence's KV is its token list."""

    def __init__(self, n_batch: int):
        self.n_batch = n_batch
        self.kv: dict[int, list[int]] = {}
        self.logits: dict[int, ctypes.Array] = {}
        self.max_rows = 0

    def llama_decode(self, ctx, batch) -> int:
        assert 0 < batch.n_tokens <= self.n_batch
        self.max_rows = max(self.max_rows, batch.n_tokens)
        self.logits = {}
        for row in range(batch.n_tokens):
            assert batch.n_seq_id[row] == 1
            history = self.kv.setdefault(batch.seq_id[row][0], [])
            assert batch.pos[row] == len(history)  # contiguous, from 0 after seq_rm
            history.append(batch.token[row])
            if batch.logits[row]:
                scores = (ctypes.c_float * VOCAB)()
                scores[next_token(history)] = 1.0
                self.logits[row] = scores
        return 0

    def llama_get_logits_ith(self, ctx, row):
        return ctypes.cast(self.logits[row], ctypes.POINTER(ctypes.c_float))

    def llama_memory_seq_rm(self, memory, slot, p0, p1) -> bool:
        assert (p0, p1) == (-1, -1)
        del self.kv[slot]
        return True


def fake_engine(n_seq_max: int, n_batch: int) -> tuple[LlamaCppEngine, FakeLlama]:
    engine = LlamaCppEngine.__new__(LlamaCppEngine)  # no model: the loop alone
    fake = FakeLlama(n_batch)
    size = n_batch
    batch = types.SimpleNamespace(
        n_tokens=0,
        token=[0] * size,
        pos=[0] * size,
        n_seq_id=[0] * size,
        seq_id=[[0] for _ in range(size)],
        logits=[0] * size,
    )
    engine.lib, engine.ctx, engine.memory, engine.batch = fake, None, None, batch
    engine.n_seq_max, engine.n_batch, engine.n_vocab, engine.num_steps = (
        n_seq_max,
        n_batch,
        VOCAB,
        0,
    )
    return engine, fake


def expected(request: BenchRequest) -> list[int]:
    history, out = list(request.prompt_token_ids), []
    for _ in range(request.output_len):
        out.append(next_token(history))
        history.append(out[-1])
    return out


@pytest.mark.parametrize(("n_seq_max", "n_batch"), [(1, 32), (3, 16), (7, 7)])
def test_continuous_batching_gives_each_request_its_own_greedy_tokens(n_seq_max, n_batch):
    requests = [
        BenchRequest([(i * 7 + j) % VOCAB for j in range(3 + 5 * i)], 1 + (i * 3) % 9)
        for i in range(10)
    ]
    engine, fake = fake_engine(n_seq_max, n_batch)
    outputs = engine.generate(requests)
    assert outputs == [expected(r) for r in requests]
    assert fake.kv == {}  # every finished sequence's KV was dropped
    assert fake.max_rows == n_batch  # prompt chunks fill the batch (prompts up to 48)
    forward = sum(r.prompt_len + r.output_len - 1 for r in requests)
    assert engine.num_steps >= -(-forward // n_batch)
    assert len(set(map(len, outputs))) > 1
    with pytest.raises(ValueError, match="n_batch"):
        fake_engine(n_batch + 1, n_batch)[0].generate(requests)


def test_missing_llama_cpp_names_the_extra_before_anything_runs(monkeypatch, model_dir, tmp_path):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'pagestream\[bench\]'"):
        import_llama_cpp()
    argv = ["throughput", "--llamacpp", "--profile", "smoke", "--no-hf"]
    args = bench_args(tmp_path, *argv, "--model", str(model_dir("llama")))
    with pytest.raises(SystemExit, match=r"pagestream\[bench\]"):
        run_bench(args)
    assert not (tmp_path / "benchmarks" / "results.json").exists()


def test_options_are_checked_and_check_requests_are_short():
    with pytest.raises(ValueError, match="seqs"):
        LlamaCppOptions(model="m", seqs=(0,))
    with pytest.raises(ValueError, match="dtypes"):
        LlamaCppOptions(model="m", dtypes=("Q4_0",))
    with pytest.raises(ValueError, match="flash_attn"):
        LlamaCppOptions(model="m", flash_attn="maybe")
    requests = [BenchRequest([1, 2, 3], 50) for _ in range(6)]
    checks = check_requests(requests, LlamaCppOptions(model="m", check_prompts=4))
    assert len(checks) == 4 and {r.output_len for r in checks} == {32}
    a = check_agreement([[1, 2, 3], [1, 5, 3]], [[1, 2, 3], [1, 2, 3]])
    assert (a["equal"], a["first_differences"], a["mean_first_difference"]) == (1, [3, 1], 2.0)


def _run(name: str, tok_s: float, **extra) -> RunResult:
    tokens = int(tok_s * 10)
    return RunResult(name, 10.0, 4, 400, tokens, tokens, {"num_steps": 5, **extra})


def test_ratios_use_the_fastest_llamacpp_run_of_each_dtype_and_the_report_shows_them():
    runs = [
        _run("pagestream LLM.generate (float32)", 150.0),
        _run("pagestream LLM.generate (bfloat16)", 200.0),
        _run("llama.cpp F32 (16 seqs)", 100.0, load_average={"start": 1.5, "end": 2.5}),
        _run("llama.cpp F32 (32 seqs)", 120.0),
        _run("llama.cpp BF16 (16 seqs)", 160.0),
    ]
    ratios = _llamacpp_ratios(runs)
    assert ratios["vs_llamacpp_f32"]["baseline"] == "llama.cpp F32 (32 seqs)"
    assert ratios["vs_llamacpp_f32"]["output_tokens_per_s"] == 1.25
    assert ratios["vs_llamacpp_bf16"]["ours"] == "pagestream LLM.generate (bfloat16)"
    assert ratios["vs_llamacpp_bf16"]["output_tokens_per_s"] == 1.25
    assert _llamacpp_ratios(runs[:1] + runs[2:]).keys() == {"vs_llamacpp_f32"}
    a = check_agreement([[1, 2], [3, 4]], [[1, 2], [3, 5]])
    tp = {
        "runs": [r.as_dict() for r in runs],
        "ratios": ratios,
        "llamacpp": {
            "llama_cpp_python": "0.3.36",
            "source_gguf": "m.Q4_1.gguf",
            "seqs": [16, 32],
            "n_batch": 2048,
            "kv_unified": False,
            "flash_attn": "off",
            "runs": [r.name for r in runs[2:]],
            "agreement": {"F32": a},
        },
    }
    text = "\n".join(THROUGHPUT.render(tp))
    assert (
        "| llama.cpp F32 (16 seqs) | 10.0 | 4 | 400 | 1000 | 1000 | 0.4 | 100.0 | 140.0 | 5 | "
        "1.5 | 2.5 |" in text
    )
    assert "| vs_llamacpp_f32 | llama.cpp F32 (32 seqs) | 1.0 | 1.25 | 1.19 | pagestream" in text
    assert "- llamacpp · agreement · F32: requests 2; equal 1;" in text and "flash attn off" in text
    assert "first differences 2, 1" in text


class ZeroEngine:
    """LlamaCppEngine for the short check: token 0 all the way."""

    def __init__(self, path, dtype, options, max_len, n_seq_max):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def generate(self, requests):
        return [[0] * r.output_len for r in requests]


def test_full_agreement_compares_the_timed_runs_with_pagestream_float32(
    monkeypatch, model_dir, tmp_path
):
    """run_throughput keeps pagestream's tokens; each llama.cpp dtype's first run (here a
    fake: F32 = pagestream float32's tokens, BF16 = the same but two changed) against them
    over every request and its full output length, and the report's line per run."""
    from benchmarks import gguf_export, throughput
    from benchmarks.ceiling import Ceiling

    monkeypatch.setattr(llamacpp, "import_llama_cpp", lambda: None)
    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "0.3.36")
    monkeypatch.setattr(gguf_export, "source_gguf", lambda model: tmp_path / "m.Q8_0.gguf")
    monkeypatch.setattr(gguf_export, "export_gguf", lambda source, dtype: tmp_path / dtype)
    monkeypatch.setattr(
        throughput,
        "measure_matmul_ceiling",
        lambda shapes, dtype: Ceiling(100.0, [], 256, str(dtype), 1),
    )
    kept = {}
    real_run_pagestream = throughput.run_pagestream

    def run_pagestream(llm, requests, name="pagestream"):
        kept[name] = real_run_pagestream(llm, requests, name)
        return kept[name]

    def run_llamacpp(requests, path, dtype, n_seq_max, options):
        tokens = [list(t) for t in kept["pagestream LLM.generate (float32)"].token_ids]
        if dtype == "BF16":
            tokens[1][3] = tokens[0][5] = -1  # request 0: first difference 5, request 1: 3
        return _run(f"llama.cpp {dtype} ({n_seq_max} seqs)", 100.0), tokens

    monkeypatch.setattr(throughput, "run_pagestream", run_pagestream)
    monkeypatch.setattr(llamacpp, "run_llamacpp", run_llamacpp)
    requests = [BenchRequest([3 + i, 17, 40, 9 * i + 1, 250][: 2 + i], 6 + 2 * i) for i in range(4)]
    options = ThroughputOptions(
        model=str(model_dir("llama")),
        hf_batch_sizes=(),
        hf_continuous=False,
        kv_cache_memory="16MiB",
        extra_dtypes=("bfloat16",),
        llamacpp=LlamaCppOptions(model="m", dtypes=("F32", "BF16"), seqs=(2, 4)),
    )
    monkeypatch.setattr(llamacpp, "LlamaCppEngine", ZeroEngine)
    tp = run_throughput(requests, options)
    assert tp["llamacpp"]["agreement"]["BF16"]["equal"] == 0  # the short check still runs
    fp32 = kept["pagestream LLM.generate (float32)"].token_ids
    assert [len(t) for t in fp32] == [r.output_len for r in requests]
    assert "token_ids" not in tp["runs"][0]
    full = tp["llamacpp"]["agreement_full"]
    assert full["F32"] == {
        "run": "llama.cpp F32 (2 seqs)",
        "requests": 4,
        "equal": 4,
        "mean_first_difference": 9.0,
        "mean_output_len": 9.0,
    }
    assert full["BF16"]["run"] == "llama.cpp BF16 (2 seqs)"
    assert (full["BF16"]["equal"], full["BF16"]["mean_first_difference"]) == (2, 7.5)
    assert full["pagestream bfloat16"]["run"] == "pagestream LLM.generate (bfloat16)"
    assert full["pagestream bfloat16"]["requests"] == 4
    text = "\n".join(THROUGHPUT.render(tp))
    assert "| BF16 | llama.cpp BF16 (2 seqs) | 4 | 2 | 7.5 | 9 |" in text
