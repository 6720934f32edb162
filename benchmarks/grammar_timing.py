"""Structured outputs, grammar side (benchmarks/structured.py runs it): compile times
(cold: a grammar never seen, admit -> matcher ready; cached: a copy of the cached matcher)
over JSON schemas of growing size, regexes and Lark grammars, and the mask fill per row,
the constrained outputs replayed in lockstep (serial, and with llguidance's LLExecutor)."""

from __future__ import annotations

import time

import numpy as np

from benchmarks.results import percentiles

# ---- grammar compile times ---------------------------------------------------------------
FIELD_KINDS = (
    {"type": "string", "maxLength": 32},
    {"type": "integer", "minimum": 0, "maximum": 1000},
    {"type": "number"},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue", "cyan", "magenta"]},
    {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
    {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "string", "maxLength": 8}},
        "required": ["x"],
    },
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


def growing_schema(index: int) -> dict:
    """Schema `index`: 2 + index properties of rotating kinds, every other one required
    (property names differ between schemas, so every one compiles afresh)."""
    names = [f"f{index}_{j}" for j in range(2 + index)]
    properties = {n: FIELD_KINDS[(index + j) % len(FIELD_KINDS)] for j, n in enumerate(names)}
    return {"type": "object", "properties": properties, "required": names[::2]}


def compile_set(num_schemas: int) -> list[tuple[str, str, object]]:
    """(kind, name, StructuredOutputsParams) for the compile-time measurements."""
    from services.common.structured_outputs import StructuredOutputsParams

    grammars = [
        (
            "json",
            f"schema {i} ({2 + i} properties)",
            StructuredOutputsParams(json=growing_schema(i)),
        )
        for i in range(num_schemas)
    ]
    grammars += [("regex", n, StructuredOutputsParams(regex=r)) for n, r in REGEXES.items()]
    grammars += [("lark", n, StructuredOutputsParams(grammar=g)) for n, g in LARK.items()]
    return grammars


def _request(request_id: str, constraint):
    from services.common.sampling_params import SamplingParams
    from services.scheduler.request import Request

    params = SamplingParams(max_tokens=8, structured_outputs=constraint)
    return Request(request_id, [0], params)


def _time_admission(manager, request) -> tuple[float, float]:
    """Seconds from admit until the request's matcher is ready, then for its first mask."""
    start = time.perf_counter()
    manager.admit(request)
    request.grammar.future.result()
    assert manager.ready(request)
    ready = time.perf_counter()
    manager.masks([request], {request.request_id: request.num_tokens})
    return ready - start, time.perf_counter() - ready


def measure_compile(manager, num_schemas: int, cached_repeats: int) -> dict:
    """Tokenizer build, then cold and cached admissions of every grammar of the set."""
    start = time.perf_counter()
    manager.tokenizer()
    tokenizer_s = time.perf_counter() - start
    grammars = []
    for index, (kind, name, constraint) in enumerate(compile_set(num_schemas)):
        cold = _time_admission(manager, _request(f"cold-{index}", constraint))
        cached = [
            _time_admission(manager, _request(f"cached-{index}-{k}", constraint))
            for k in range(cached_repeats)
        ]
        grammars.append(
            {
                "kind": kind,
                "name": name,
                "grammar_chars": len(constraint.grammar_text),
                "cold_ms": round(1e3 * cold[0], 3),
                "cold_first_mask_ms": round(1e3 * cold[1], 3),
                "cached_ms": [round(1e3 * c[0], 3) for c in cached],
                "cached_first_mask_ms": [round(1e3 * c[1], 3) for c in cached],
            }
        )
    return {
        "tokenizer_build_s": round(tokenizer_s, 3),
        "vocab_size": manager.vocab_size,
        "grammars": grammars,
        "summary": _compile_summary(grammars),
    }


def _compile_summary(grammars: list[dict]) -> dict:
    def flat(key):
        return [v for g in grammars for v in (g[key] if isinstance(g[key], list) else [g[key]])]

    out = {}
    for key in ("cold_ms", "cold_first_mask_ms", "cached_ms", "cached_first_mask_ms"):
        out[key] = spread(flat(key))
    by_kind = {}
    for kind in sorted({g["kind"] for g in grammars}):
        cold = [g["cold_ms"] for g in grammars if g["kind"] == kind]
        by_kind[kind] = {"count": len(cold), "cold_ms": spread(cold)}
    out["by_kind"] = by_kind
    return out


def spread(values) -> dict:
    """How many, p50, p99 and the maximum ({"n": 0} where there are none)."""
    values = list(values)
    if not values:
        return {"n": 0}
    return {"n": len(values), **percentiles(values, digits=4), "max": round(max(values), 4)}


# ---- mask fill per row --------------------------------------------------------------------
FILLS = ("serial", "parallel")


def measure_mask_fill(
    make_manager, token_ids: list[list[int]], json_constraint: dict, threads: int
) -> dict:
    """The constrained outputs replayed in lockstep: at each position, the rows still going
    filled by `masks` (one row after another) or by an LLExecutor (in parallel). Each fill
    gets a fresh manager (`make_manager()`: llguidance keeps caches per tokenizer, per
    compiled grammar and per matcher state): a cold replay, then a warm one on new copies
    of the same grammar, as an engine has after some requests with that schema."""
    from llguidance import LLExecutor

    from services.common.structured_outputs import StructuredOutputsParams

    constraint = StructuredOutputsParams(**json_constraint)
    executor = LLExecutor(num_threads=threads)
    found, masks, rejected = {}, {}, 0
    for kind in FILLS:
        manager = make_manager()
        try:
            fill = _fill(kind, manager, executor)
            for state in ("cold", "warm"):
                steps, masks[kind, state], bad = _replay(manager, constraint, token_ids, fill)
                found[f"{kind}_{state}"] = _fill_summary(steps)
                rejected += bad
        finally:
            manager.close()
    first = masks[FILLS[0], "cold"]
    mismatches = sum(a != b for other in masks.values() for a, b in zip(first, other, strict=True))
    rows = [n for n, _ in steps]
    return {
        "positions": len(rows),
        "rows": int(sum(rows)),
        "rows_per_step": spread(rows),
        "parallel_threads": threads,
        "fills": found,
        "parallel_speedup": {
            state: round(
                found[f"serial_{state}"]["total_s"] / found[f"parallel_{state}"]["total_s"], 2
            )
            for state in ("cold", "warm")
        },
        "bitmask_mismatches": mismatches,
        "tokens_rejected": rejected,
    }


def _fill(kind: str, manager, executor):
    """rows (requests) -> their packed bitmask bytes, as the scheduler ships them."""
    from llguidance.numpy import fill_next_token_bitmask_par

    def serial(rows) -> bytes:
        return manager.masks(rows, {r.request_id: r.num_tokens for r in rows}).bitmask

    def parallel(rows) -> bytes:
        bitmask = np.zeros((len(rows), manager.words), dtype=np.int32)
        matchers = [(r.grammar.matcher, i) for i, r in enumerate(rows)]
        fill_next_token_bitmask_par(executor, matchers, bitmask)
        return bitmask.astype("<i4").tobytes()

    return serial if kind == "serial" else parallel


def _replay(manager, constraint, token_ids: list[list[int]], fill):
    """[(rows, seconds)] and the bitmask of every position, and the tokens rejected."""
    requests = [_request(f"replay-{i}", constraint) for i in range(len(token_ids))]
    for request in requests:
        manager.admit(request)
        request.grammar.future.result()
        manager.ready(request)
    steps, masks, rejected = [], [], 0
    for position in range(max(map(len, token_ids), default=0)):
        live = [
            (r, ids[position])
            for r, ids in zip(requests, token_ids, strict=True)
            if position < len(ids) and not r.grammar.matcher.is_stopped()
        ]
        if not live:
            break
        start = time.perf_counter()
        masks.append(fill([r for r, _ in live]))
        steps.append((len(live), time.perf_counter() - start))
        for request, token in live:
            rejected += not request.grammar.matcher.consume_token(token)
    return steps, masks, rejected


def _fill_summary(steps: list[tuple[int, float]]) -> dict:
    return {
        "us_per_row": spread(1e6 * s / n for n, s in steps),
        "ms_per_step": spread(1e3 * s for _, s in steps),
        "total_s": round(sum(s for _, s in steps), 5),
    }
