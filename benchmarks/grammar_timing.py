"""Structured outputs, grammar side (benchmarks/structured.py runs it on the engine's
tokenizer): compile times over a set of grammars (cold: admit -> matcher ready, and its
first mask; cached: the same grammar again) and the bitmask fill per row, serial and in
parallel, replaying the constrained outputs on a StructuredOutputManager of its own."""

from __future__ import annotations

import os
import time

import numpy as np

from benchmarks.embeddings import seconds
from benchmarks.results import percentiles

# The compile set: JSON schemas of growing size over these property kinds, regexes, Lark.
POINT = {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 8}}
FIELD_KINDS = (
    {"type": "string", "maxLength": 32},
    {"type": "integer", "minimum": 0, "maximum": 1000},
    {"type": "number"},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue", "cyan", "magenta"]},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    {"type": "object", "properties": POINT, "required": ["x"]},
)
REGEXES = {
    "email": r"[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,24}\.[a-z]{2,6}",
    "phone": r"\+?[0-9]{1,3}[ -][0-9]{3}[ -][0-9]{3}[ -][0-9]{4}",
    "datetime": r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
}
LARK = {
    "arithmetic": 'start: expr\nexpr: term (("+" | "-") term)*\n'
    'term: factor (("*" | "/") factor)*\nfactor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,6}/',
    "sql": 'start: "SELECT " cols " FROM " NAME (" WHERE " cond)? ";"\n'
    'cols: NAME (", " NAME)*\ncond: NAME " = " (NUMBER | STRING)\n'
    "NAME: /[a-z_][a-z0-9_]{0,15}/\nNUMBER: /[0-9]{1,6}/\nSTRING: /'[a-z ]{0,20}'/",
    "config": 'start: line+\nline: KEY "=" VALUE "\\n"\nKEY: /[a-z][a-z0-9_.]{0,23}/\n'
    "VALUE: /[A-Za-z0-9_.\\/-]{1,32}/",
    "int_list": 'start: "[" (INT ("," INT)*)? "]"\nINT: /-?[0-9]{1,9}/',
}
FILLS = ("serial", "parallel")
EXECUTOR_THREADS = max(2, min(8, os.cpu_count() or 1))  # the parallel fill's


def compile_set(num_schemas: int) -> list[tuple[str, str, dict]]:
    """(kind, name, StructuredOutputsParams arguments) of the grammars timed; schema i has
    2 + i properties of rotating kinds (named afresh), every other one required."""
    grammars = []
    for i in range(num_schemas):
        names = [f"f{i}_{j}" for j in range(2 + i)]
        kinds = {n: FIELD_KINDS[(i + j) % len(FIELD_KINDS)] for j, n in enumerate(names)}
        schema = {"type": "object", "properties": kinds, "required": names[::2]}
        grammars.append(("json", f"schema {i} ({2 + i} properties)", {"json": schema}))
    grammars += [("regex", n, {"regex": r}) for n, r in REGEXES.items()]
    return grammars + [("lark", n, {"grammar": g}) for n, g in LARK.items()]


def admitted(manager, request_id: str, constraint):
    """(a request of `constraint`, admitted; ms from admit until its matcher was ready)."""
    from services.common.sampling_params import SamplingParams
    from services.scheduler.request import Request

    request = Request(request_id, [0], SamplingParams(max_tokens=8, structured_outputs=constraint))
    start = time.perf_counter()
    manager.admit(request)
    request.grammar.future.result()
    assert manager.ready(request)
    return request, round(1e3 * (time.perf_counter() - start), 3)


def admission_ms(manager, request_id: str, constraint) -> tuple[float, float]:
    """Milliseconds from admit until the matcher is ready, then for its first mask."""
    request, ready_ms = admitted(manager, request_id, constraint)
    mask_s, _ = seconds(manager.masks, [request], {request.request_id: request.num_tokens})
    return ready_ms, round(1e3 * mask_s, 3)


def spread(values) -> dict:
    """How many, p50, p99 and the maximum ({"n": 0} where there are none)."""
    values = list(values)
    if not values:
        return {"n": 0}
    return {"n": len(values), **percentiles(values, digits=4), "max": round(max(values), 4)}


def measure_compile(manager, num_schemas: int, cached_repeats: int) -> dict:
    """Tokenizer build, then cold and cached admissions of every grammar of the set."""
    from services.common.structured_outputs import StructuredOutputsParams

    tokenizer_s, _ = seconds(manager.tokenizer)
    grammars = []
    for index, (kind, name, args) in enumerate(compile_set(num_schemas)):
        constraint = StructuredOutputsParams(**args)
        cold = admission_ms(manager, f"cold-{index}", constraint)
        cached = [
            admission_ms(manager, f"cached-{index}-{k}", constraint) for k in range(cached_repeats)
        ]
        grammar = {"kind": kind, "name": name, "grammar_chars": len(constraint.grammar_text)}
        grammar |= {"cold_ms": cold[0], "cold_first_mask_ms": cold[1]}
        grammar["cached_ms"] = [c[0] for c in cached]
        grammar["cached_first_mask_ms"] = [c[1] for c in cached]
        grammars.append(grammar)
    keys = ("cold_ms", "cold_first_mask_ms", "cached_ms", "cached_first_mask_ms")
    summary = {k: spread(np.ravel([g[k] for g in grammars]).tolist()) for k in keys}
    kinds = sorted({g["kind"] for g in grammars})
    cold = {k: [g["cold_ms"] for g in grammars if g["kind"] == k] for k in kinds}
    summary["by_kind"] = {k: {"count": len(ms), "cold_ms": spread(ms)} for k, ms in cold.items()}
    return {
        "tokenizer_build_s": round(tokenizer_s, 3),
        "vocab_size": manager.vocab_size,
        "grammars": grammars,
        "summary": summary,
    }


def replay(manager, constraint, token_ids: list[list[int]], executor) -> tuple[list, list, int]:
    """[(rows, seconds)] and the packed bitmask of every position, the tokens rejected;
    the rows filled by `executor` (an LLExecutor; None: `masks`, one row after another)."""
    from llguidance.numpy import fill_next_token_bitmask_par

    requests = [admitted(manager, f"replay-{i}", constraint)[0] for i in range(len(token_ids))]
    steps, masks, rejected = [], [], 0
    for position in range(max(map(len, token_ids), default=0)):
        live = [
            (r, ids[position])
            for r, ids in zip(requests, token_ids, strict=True)
            if position < len(ids) and not r.grammar.matcher.is_stopped()
        ]
        if not live:
            break
        rows, start = [r for r, _ in live], time.perf_counter()
        if executor:
            bitmask = np.zeros((len(rows), manager.words), dtype=np.int32)
            matchers = [(r.grammar.matcher, i) for i, r in enumerate(rows)]
            fill_next_token_bitmask_par(executor, matchers, bitmask)
            masks.append(bitmask.astype("<i4").tobytes())
        else:
            masks.append(manager.masks(rows, {r.request_id: r.num_tokens for r in rows}).bitmask)
        steps.append((len(rows), time.perf_counter() - start))
        rejected += sum(not r.grammar.matcher.consume_token(token) for r, token in live)
    return steps, masks, rejected


def measure_mask_fill(make_manager, token_ids: list[list[int]], constraint, threads: int) -> dict:
    """Each fill on a fresh manager (llguidance caches per tokenizer, grammar and matcher
    state): a cold replay, then a warm one on new copies of the same grammar."""
    from llguidance import LLExecutor

    executor = LLExecutor(num_threads=threads)
    fills, masks, rejected = {}, [], 0
    for kind in FILLS:
        with make_manager() as manager:
            for state in ("cold", "warm"):
                fill = executor if kind == "parallel" else None
                steps, filled, bad = replay(manager, constraint, token_ids, fill)
                fills[f"{kind}_{state}"] = {
                    "us_per_row": spread(1e6 * s / n for n, s in steps),
                    "ms_per_step": spread(1e3 * s for _, s in steps),
                    "total_s": round(sum(s for _, s in steps), 5),
                }
                masks.append(filled)
                rejected += bad
    rows = [n for n, _ in steps]
    total = {k: f["total_s"] for k, f in fills.items()}
    speedup = {s: total[f"serial_{s}"] / total[f"parallel_{s}"] for s in ("cold", "warm")}
    return {
        "positions": len(rows),
        "rows": int(sum(rows)),
        "rows_per_step": spread(rows),
        "parallel_threads": threads,
        "fills": fills,
        "parallel_speedup": {s: round(x, 2) for s, x in speedup.items()},
        "bitmask_mismatches": sum(a != b for m in masks for a, b in zip(masks[0], m, strict=True)),
        "tokens_rejected": rejected,
    }
