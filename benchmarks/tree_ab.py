"""Two source trees of pagestream, run alternately on one model: load, memory and speed.

    git worktree add /tmp/base <rev>
    python -m benchmarks.tree_ab --base /tmp/base --new . --model FILE.gguf --rounds 4

Each run is a fresh process importing one tree (PYTHONPATH), the order rotated each round:
ready time, peak and settled RSS, batch-1 ms per token (64 tokens) and batch-8 tok/s (8
prompts x 64 tokens), medians per tree, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = """
import json, sys, time
start = time.perf_counter()
from pagestream import LLM, SamplingParams
llm = LLM(max_model_len=4096, **({"model": sys.argv[1]} if sys.argv[1] else {}))
ready = time.perf_counter() - start
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
def timed(prompts, n):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in outs]
timed(["Hello"], 4)
one, _ = timed(["Write a story about a fox."], 1)
many, tokens = timed(["Write a story about a fox."], 65)
batch, _ = timed([f"Tell me fact number {i} about the ocean." for i in range(8)], 64)
print("RESULT " + json.dumps({"ready_s": ready, "peak_rss": status("VmHWM:"),
    "rss": status("VmRSS:"), "ms_per_token": 1000 * (many - one) / 64,
    "batch8_tok_s": 8 * 64 / batch, "tokens": tokens[0]}))
"""

FIELDS = ("ready_s", "peak_rss", "rss", "ms_per_token", "batch8_tok_s")


def run_once(tree: Path, model: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, model],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def compare(base: Path, new: Path, model: str, rounds: int) -> dict:
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for i in range(rounds):
        order = (("base", base), ("new", new)) if i % 2 == 0 else (("new", new), ("base", base))
        for name, tree in order:
            runs[name].append(run_once(tree, model))
    medians = {
        name: {k: statistics.median(r[k] for r in rs) for k in FIELDS} for name, rs in runs.items()
    }
    first = runs["base"][0]["tokens"]
    agree = all(r["tokens"] == first for rs in runs.values() for r in rs)
    return {"medians": medians, "runs": runs, "greedy_tokens_agree": agree}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the old tree")
    parser.add_argument("--new", type=Path, default=Path.cwd(), help="the new tree")
    parser.add_argument("--model", default="", help="a model folder or file (default: ours)")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    found = compare(args.base.resolve(), args.new.resolve(), args.model, args.rounds)
    print(json.dumps({k: v for k, v in found.items() if k != "runs"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
