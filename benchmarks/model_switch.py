"""Switching models under `--models-max 1`: two 1.5B-shaped GGUF files in a models
directory, alternating chat requests A, B, A, B...; each request's time to first token
includes unloading the other model and loading its own. Against it: a fresh
`LLM(model=file)`'s construction-to-ready time, in a fresh process (issue 52's target:
TTFT after a switch within 1.5x of it).

    python -m benchmarks.model_switch --out model_switch_results.json
    # the models: $PAGESTREAM_CACHE/full_size/qwen2.5-1.5b.random-Q4_K_M.gguf and
    # its seed-1 twin .seed1.gguf beside it (benchmarks.random_gguf's writer, made once);
    # --models A.gguf B.gguf: two other files

Parts, in order: fresh loads (--load-rounds per file, alternating files, each in a new
process); the served switches (one warm-up request to each model, then --switches requests
alternating, each a switch); the split (--split-rounds times: POST /models/unload of the
loaded model, POST /models/load of the other, both answered when done, then a chat to it:
its TTFT on a loaded model).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.child_call import child_call
from benchmarks.load_clients import ChildServer, free_port, http_healthy
from benchmarks.results import median, ratio
from benchmarks.run_header import run_main
from benchmarks.timed_stream import chat_body, get_json, post_json, timed_stream

logger = logging.getLogger(__name__)

SHAPE = "qwen2.5-1.5b"
SECOND_SEED = 1  # the second file: the same shape, other random blocks
TARGET = 1.5  # switch TTFT over a fresh load's ready time, at most
NAMES = ("model-a", "model-b")  # the files' names in the models directory
PROMPT = "Say something short."
# Every model's engine flags, the same for the served models and the fresh LLMs.
ENGINE = {"max_model_len": 2048, "kv_cache_memory": "1GiB"}


@dataclass(frozen=True)
class SwitchOptions:
    models: tuple[str, str] | None = None  # None: the random 1.5B-shaped pair
    switches: int = 8
    load_rounds: int = 3
    split_rounds: int = 2
    max_tokens: int = 4
    threads: int = 2
    engine: dict = field(default_factory=lambda: dict(ENGINE))

    def __post_init__(self) -> None:
        if min(self.switches, self.load_rounds, self.max_tokens, self.threads) < 1:
            raise ValueError("switches, load_rounds, max_tokens and threads must be >= 1.")
        if self.split_rounds < 0:
            raise ValueError(f"split_rounds must be >= 0, got {self.split_rounds}.")
        if self.models is not None and len(self.models) != 2:
            raise ValueError(f"models: two files, got {len(self.models)}.")


def engine_flags(engine: dict) -> list[str]:
    """`engine`'s keyword arguments as serve's flags."""
    return [f for key, value in engine.items() for f in ("--" + key.replace("_", "-"), str(value))]


def check_models_support() -> None:
    """ValueError where this build's serve has no --models-dir."""
    try:
        from pagestream.models.models_config import ModelsConfig
    except ImportError as exc:
        raise ValueError("serve --models-dir not supported by this build.") from exc
    if "models_max" not in ModelsConfig.__dataclass_fields__:
        raise ValueError("serve --models-max not supported by this build.")


def default_models() -> tuple[str, str]:
    """The random 1.5B-shaped Q4_K_M file and its twin of another seed, written once."""
    from benchmarks.full_size import full_config
    from benchmarks.random_gguf import random_gguf, write_random_gguf

    first = random_gguf(SHAPE)
    second = first.with_name(first.name.replace(".gguf", f".seed{SECOND_SEED}.gguf"))
    if not second.is_file():
        config = full_config(SHAPE)
        config.setdefault("tie_word_embeddings", False)
        tmp = second.with_name(second.name + ".tmp")
        write_random_gguf(tmp, config, seed=SECOND_SEED)
        tmp.rename(second)
    return str(first), str(second)


def models_dir(folder: Path, models: tuple[str, str]) -> Path:
    """`folder` holding links named NAMES to the two files (the served models' names)."""
    for name, path in zip(NAMES, models, strict=True):
        (folder / f"{name}.gguf").symlink_to(Path(path).resolve())
    return folder


def fresh_load(model: str, engine: dict) -> dict:
    """A fresh LLM's construction to ready (run in its own process), then one short greedy
    generate."""
    from pagestream import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model, **engine)
    ready = time.perf_counter()
    llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    first = time.perf_counter()
    llm.engine.close()
    return {"ready_s": round(ready - start, 3), "first_token_s": round(first - ready, 3)}


@dataclass
class ModelsServer(ChildServer):
    """`pagestream serve --models-dir DIR --models-max 1` with the engine flags."""

    folder: Path
    engine: dict
    threads: int
    port: int = field(default_factory=free_port)
    startup_timeout_s: float = 300.0
    what = "pagestream serve --models-dir"

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"OMP_NUM_THREADS": str(self.threads)}

    def ready(self) -> bool:
        return http_healthy(f"{self.url}/health")

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "pagestream.cli", "--log-level", "WARNING", "serve"]
        command += ["--models-dir", str(self.folder), "--models-max", "1"]
        command += ["--port", str(self.port), *engine_flags(self.engine)]
        return command


def states(url: str) -> dict[str, str]:
    """Each model's state from /v1/models (loaded, unloaded, ...)."""
    return {card["id"]: card["status"]["value"] for card in get_json(url, "/v1/models")["data"]}


def switch_round(url: str, name: str, max_tokens: int) -> dict:
    """One chat to `name`, with the states before it: a switch where it was not loaded."""
    before = states(url)
    reply = timed_stream(url, chat_body(name, PROMPT, max_tokens))
    return {"model": name, "state_before": before[name], **_timing(reply)}


def split_round(url: str, loaded: str, other: str, max_tokens: int) -> dict:
    """The switch in steps: unload `loaded`, load `other` (each POST answered when done),
    then a chat to `other`, loaded already."""
    start = time.perf_counter()
    post_json(url, "/models/unload", {"model": loaded})
    unloaded = time.perf_counter()
    post_json(url, "/models/load", {"model": other})
    done = time.perf_counter()
    reply = timed_stream(url, chat_body(other, PROMPT, max_tokens))
    return {
        "model": other,
        "unload_s": round(unloaded - start, 3),
        "load_s": round(done - unloaded, 3),
        "loaded_ttft_s": reply["ttft_s"],
    }


def _timing(reply: dict) -> dict:
    return {k: reply[k] for k in ("ttft_s", "seconds", "completion_tokens")}


def run_fresh_loads(options: SwitchOptions, models: tuple[str, str]) -> list[dict]:
    """--load-rounds fresh LLMs per file, the files alternating."""
    loads = []
    for index in range(options.load_rounds * 2):
        model = models[index % 2]
        load = child_call(
            "benchmarks.model_switch:fresh_load",
            options.threads,
            model=model,
            engine=options.engine,
        )
        logger.info("fresh load %s: %s", Path(model).name, load)
        loads.append({"model": Path(model).name, **load})
    return loads


def run_served(options: SwitchOptions, models: tuple[str, str]) -> dict:
    """The warm-up requests, the switches and the split, on one server."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = models_dir(Path(tmp), models)
        with ModelsServer(folder, options.engine, options.threads) as server:
            warmup = [switch_round(server.url, name, options.max_tokens) for name in NAMES]
            logger.info("warm-up: %s", warmup)
            switches = []
            for index in range(options.switches):
                switches.append(switch_round(server.url, NAMES[index % 2], options.max_tokens))
                logger.info("switch: %s", switches[-1])
            splits = []
            loaded = NAMES[(options.switches - 1) % 2]
            for _ in range(options.split_rounds):
                other = NAMES[1 - NAMES.index(loaded)]
                splits.append(split_round(server.url, loaded, other, options.max_tokens))
                logger.info("split: %s", splits[-1])
                loaded = other
    return {"warmup": warmup, "switches": switches, "splits": splits}


def summarize(loads: list[dict], served: dict) -> dict:
    """The medians, the switch-over-load ratio and the target."""
    switches = served["switches"]
    switch_ttft = median(s["ttft_s"] for s in switches)
    ready = median(load["ready_s"] for load in loads)
    over = ratio(switch_ttft, ready)
    splits = served["splits"]
    return {
        "fresh_load_ready_s": ready,
        "fresh_load_first_token_s": median(load["first_token_s"] for load in loads),
        "switch_ttft_s": switch_ttft,
        "all_were_switches": all(s["state_before"] != "loaded" for s in switches),
        "switch_over_fresh_load": over,
        "split": {
            "unload_s": median(s["unload_s"] for s in splits),
            "load_s": median(s["load_s"] for s in splits),
            "loaded_ttft_s": median(s["loaded_ttft_s"] for s in splits),
        },
        "targets_met": {f"switch_over_fresh_load <= {TARGET}": over is not None and over <= TARGET},
        "fresh_loads": loads,
        **served,
    }


def run_model_switch(options: SwitchOptions) -> dict:
    check_models_support()
    models = options.models or default_models()
    loads = run_fresh_loads(options, models)
    served = run_served(options, models)
    return {"models": list(models), "engine": options.engine} | summarize(loads, served)


def parse_options(argv: list[str]) -> tuple[SwitchOptions, Path | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs=2, help="two GGUF files (default: the random pair)")
    parser.add_argument("--switches", type=int, default=8, help="alternating requests timed")
    parser.add_argument("--load-rounds", type=int, default=3, help="fresh LLM loads per file")
    parser.add_argument("--split-rounds", type=int, default=2, help="explicit unload + load")
    parser.add_argument("--max-tokens", type=int, default=4, help="each chat's tokens")
    parser.add_argument("--threads", type=int, default=2, help="every process's threads")
    parser.add_argument("--max-model-len", type=int, default=ENGINE["max_model_len"])
    parser.add_argument("--kv-cache-memory", default=ENGINE["kv_cache_memory"])
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    args = parser.parse_args(argv)
    engine = {"max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory}
    options = SwitchOptions(
        models=tuple(args.models) if args.models else None,
        switches=args.switches,
        load_rounds=args.load_rounds,
        split_rounds=args.split_rounds,
        max_tokens=args.max_tokens,
        threads=args.threads,
        engine=engine,
    )
    return options, args.out


def _summary(result: dict) -> dict:
    keys = ("switch_ttft_s", "fresh_load_ready_s", "switch_over_fresh_load", "targets_met")
    return {k: result[k] for k in keys}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_main("benchmarks.model_switch", argv, parse_options, run_model_switch, _summary)


if __name__ == "__main__":
    raise SystemExit(main())
