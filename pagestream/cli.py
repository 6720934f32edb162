"""The `pagestream` command: generate (offline batches) and serve."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from pagestream import roles, split_layout
from pagestream.cli_flags import FRONTEND_CONFIGS, FRONTEND_ENGINE_FLAGS, RankConfig
from pagestream.engine_args import EngineArgs
from pagestream.models.models_config import ModelsConfig
from pagestream.start_checks import check_start
from services.common.config import DEFAULT_MODEL
from services.common.flags import add_flags, from_flags
from services.common.grpc_server import run
from services.common.sampling_params import SamplingParams
from services.common.tls import TlsConfig

logger = logging.getLogger("pagestream")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--max-tokens", type=int, default=64)
    add("--temperature", type=float, default=0.0)
    add("--top-p", type=float, default=1.0)
    add("--top-k", type=int, default=0)
    add("--min-p", type=float, default=0.0)
    add("--n", type=int, default=1)
    add("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    add("--stop", action="append", default=None, help="a stop string (repeatable)")
    add("--presence-penalty", type=float, default=0.0)
    add("--frequency-penalty", type=float, default=0.0)
    add("--repetition-penalty", type=float, default=1.0)
    add("--min-tokens", type=int, default=0)
    add("--ignore-eos", action="store_true")
    add("--logprobs", type=int, default=None)


def sampling_params_from_args(args: argparse.Namespace, **overrides) -> SamplingParams:
    values = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n=args.n,
        seed=args.sampling_seed,
        stop=args.stop,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    values.update(overrides)
    return SamplingParams(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagestream", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="offline batch: prompts in, JSONL results out")
    gen.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    gen.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    gen.add_argument("--input", help="JSONL: {prompt | prompt_token_ids | messages, ...}")
    gen.add_argument("--output", help="JSONL results (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    add_sampling_args(gen)
    add_flags(gen, EngineArgs)
    gen.set_defaults(max_waiting_requests=0)  # an offline batch queues every prompt
    serve = sub.add_parser("serve", help="all roles on this machine: gRPC and OpenAI HTTP")
    # None: DEFAULT_MODEL, or with --models-dir / --models-preset no model of its own
    serve.add_argument("model", nargs="?", default=None)
    serve.add_argument(
        "--single-process",
        action="store_true",
        help="run the engine core in this process too (for debugging; by default it runs in "
        "a process of its own, so the step never shares an interpreter lock with the frontend)",
    )
    serve.add_argument(
        "--split-services",
        action="store_true",
        help="run the worker rank(s), scheduler and frontend as supervised child processes",
    )
    serve.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="--split-services: restarts of one role within 5 minutes before giving up",
    )
    serve.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine replicas, each with its own worker group and KV cache, behind one "
        "routing frontend (runs the roles as supervised processes, as --split-services)",
    )
    for config in (*FRONTEND_CONFIGS, TlsConfig, EngineArgs, ModelsConfig):
        add_flags(serve, config)
    worker = sub.add_parser("worker", help="the Worker service (runs the model)")
    worker.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    worker.add_argument("--host", default="127.0.0.1")
    worker.add_argument("--port", type=int, default=50061, help="0: any free port")
    for config in (RankConfig, TlsConfig, EngineArgs):
        add_flags(worker, config)
    scheduler = sub.add_parser("scheduler", help="the EngineCore service (scheduler)")
    scheduler.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    scheduler.add_argument(
        "--worker",
        action="append",
        default=[],
        help="a worker address host:port; once per rank, in rank order (pp_rank * tp + "
        "tp_rank). None: the scheduler starts its own workers (--distributed-executor-backend "
        "uni, mp or ray)",
    )
    scheduler.add_argument(
        "--host", default="127.0.0.1", help="address to bind, or unix:PATH for a unix socket"
    )
    scheduler.add_argument("--port", type=int, default=50062)
    for config in (TlsConfig, EngineArgs):
        add_flags(scheduler, config)
    frontend = sub.add_parser("frontend", help="the public gRPC and HTTP APIs")
    frontend.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="for the tokenizer")
    frontend.add_argument(
        "--scheduler",
        action="append",
        required=True,
        help="scheduler address host:port; repeat it for data-parallel replicas",
    )
    add_flags(frontend, EngineArgs, FRONTEND_ENGINE_FLAGS)
    for config in (*FRONTEND_CONFIGS, TlsConfig):
        add_flags(frontend, config)
    bench = sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks vs HF transformers (a source checkout's benchmarks/; bench --help)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    return parser


def _read_items(args: argparse.Namespace) -> list[dict]:
    items = []
    for prompt in args.prompt:
        items.append(
            {"messages": [{"role": "user", "content": prompt}]} if args.chat else {"prompt": prompt}
        )
    if args.input:
        with open(args.input, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    items.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{args.input}:{number}: not JSON: {exc}") from exc
    if not items:
        raise SystemExit("no prompts: give --prompt TEXT or --input FILE.jsonl")
    return items


def run_generate(args: argparse.Namespace) -> int:
    """All prompts in one batch (continuous batching); results in input order."""
    from pagestream.llm import LLM

    items = _read_items(args)
    llm = LLM(**asdict(roles.engine_args(args)))
    prompts = [_prompt_of(llm, item) for item in items]
    params = [sampling_params_from_args(args, **item.get("sampling_params", {})) for item in items]
    results = llm.generate(prompts, params, use_tqdm=args.output is not None)
    lines = "".join(json.dumps(_result_json(r)) + "\n" for r in results)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(lines)
    else:
        sys.stdout.write(lines)
    return 0


def _prompt_of(llm, item: dict) -> dict:
    if "messages" in item:
        text = _chat_prompt(llm.engine, item["messages"])
        ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}
    prompt = {k: item[k] for k in ("prompt", "prompt_token_ids") if k in item}
    if not prompt:
        raise ValueError("each input line needs prompt, prompt_token_ids or messages.")
    return prompt


def _result_json(result) -> dict:
    return {
        "request_id": result.request_id,
        "prompt": result.prompt,
        "prompt_token_ids": result.prompt_token_ids,
        "num_cached_tokens": result.num_cached_tokens,
        "outputs": [
            {
                "index": o.index,
                "text": o.text,
                "token_ids": o.token_ids,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "cumulative_logprob": o.cumulative_logprob,
            }
            for o in result.outputs
        ],
    }


def _chat_prompt(engine, messages) -> str:
    from services.frontend.tokenizer import apply_chat_template

    return apply_chat_template(engine.tokenizer, messages)


def run_bench_checkout(bench_args: list[str], log_level: str) -> int:
    """`pagestream bench ...` runs `python -m benchmarks ...` from the source checkout this
    package lives in (the benchmarks import pagestream, never the other way round)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise SystemExit("pagestream bench needs a source checkout (its benchmarks/ folder).")
    env = dict(os.environ, PAGESTREAM_LOG_LEVEL=log_level)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    return subprocess.call([sys.executable, "-m", "benchmarks", *bench_args], env=env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "bench" in argv:  # everything after it belongs to `python -m benchmarks`
        at = argv.index("bench")
        head = build_parser().parse_args([*argv[:at], "bench"])
        if head.command == "bench":
            return run_bench_checkout(argv[at + 1 :], head.log_level)
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_start(args)
        if args.command == "generate":
            return run_generate(args)
        if args.command == "bench":
            return run_bench_checkout(args.bench_args, args.log_level)
        if args.command == "serve" and from_flags(ModelsConfig, args).enabled:
            from pagestream.models.models_serve import run_models_serve

            run(run_models_serve(args))
            return 0
        if args.command == "serve" and args.model is None:
            args.model = DEFAULT_MODEL
        if args.command == "serve" and (args.split_services or args.data_parallel_size > 1):
            return split_layout.run_split(args)
        runner = {
            "serve": roles.run_serve,
            "worker": roles.run_worker,
            "scheduler": roles.run_scheduler,
            "frontend": roles.run_frontend,
        }[args.command]
        run(runner(args))
        return 0
    except ValueError as exc:
        logger.error("%s", exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
