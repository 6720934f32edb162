"""Row: the one row schema of every A/B benchmark (benchmarks/ab_driver.py) and of its report
table (benchmarks/section_report.py): a variant on a workload at a batch, against the same
rounds' baseline: output tok/s, TPOT, their ratios, the greedy outputs' agreement, and what
else the feature counts (its extras)."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.results import agreement, median, ratio


@dataclass(frozen=True)
class Row:
    variant: str
    workload: str
    batch: int | None  # requests per generate call (None: all of them in one)
    requests: int
    output_tokens: int
    output_tok_s: float | None  # median over the rounds
    output_tok_s_per_round: list[float]
    tpot_ms: float | None  # the median request's, median over the rounds
    tpot_ms_per_round: list[float | None]
    vs_baseline: float | None  # median of each round's ratio to that round's baseline
    tpot_vs_baseline: float | None
    equal_outputs: int  # requests whose greedy tokens equal the baseline's (worst round)
    differing_outputs: int
    mean_first_difference: float
    extras: dict = field(default_factory=dict)  # what the variant is, what the feature counts

    @classmethod
    def of(cls, variant: str, workload: str, batch, runs: list[dict], baseline: list[dict],
           extras: dict | None = None) -> Row:  # fmt: skip
        """Round i's run against the baseline's round i (each run: elapsed_s, output_tokens,
        tpot_ms, token_ids); agreement with the baseline's first round, the round that
        agrees least."""
        tok_s = [r["output_tokens"] / r["elapsed_s"] for r in runs]
        base_tok_s = [r["output_tokens"] / r["elapsed_s"] for r in baseline]
        tpot = [r["tpot_ms"] for r in runs]
        reference = baseline[0]["token_ids"]
        same = min((agreement(r["token_ids"], reference) for r in runs), key=lambda a: a["equal"])
        pairs = list(zip(runs, baseline, strict=True))
        return cls(
            variant=variant,
            workload=workload,
            batch=batch,
            requests=same["requests"],
            output_tokens=runs[0]["output_tokens"],
            output_tok_s=median(tok_s, 2),
            output_tok_s_per_round=[round(x, 2) for x in tok_s],
            tpot_ms=median(tpot, 2),
            tpot_ms_per_round=[None if t is None else round(t, 2) for t in tpot],
            vs_baseline=median([ratio(a, b) for a, b in zip(tok_s, base_tok_s, strict=True)]),
            tpot_vs_baseline=median([ratio(r["tpot_ms"], b["tpot_ms"]) for r, b in pairs]),
            equal_outputs=same["equal"],
            differing_outputs=same["requests"] - same["equal"],
            mean_first_difference=same["mean_first_difference"],
            extras=extras or {},
        )

    def as_dict(self) -> dict:
        fields = {k: v for k, v in self.__dict__.items() if k != "extras"}
        return {**fields, **self.extras}
