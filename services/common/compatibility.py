"""Which engine arguments go together, checked in two places only: `check_compatibility`
when the arguments are parsed (nothing has started), `check_with_model` once the workers
describe their model (before any cache is laid out). Each rule is a predicate and the
message that names the flags (RULES / MODEL_RULES); `args` is anything with EngineArgs'
fields. What only a loaded model can tell is refused where it loads, what one request
asks where it is admitted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.common.speculative_config import SpeculativeConfig


@dataclass(frozen=True)
class Rule:
    refuses: Callable  # (args[, model]) -> True when the combination is refused
    message: str


def _runner(args) -> str:
    return "pooling" if args.convert == "embed" and args.runner != "generate" else args.runner


def _speculative(args) -> SpeculativeConfig | None:
    return SpeculativeConfig.parse(args.speculative_config)


def _world_size(args) -> int:
    return int(args.tensor_parallel_size) * int(args.pipeline_parallel_size)


RULES = (
    Rule(
        lambda a: a.convert == "embed" and a.runner == "generate",
        "--convert embed makes an embedding model: use --runner pooling.",
    ),
    Rule(
        lambda a: _runner(a) == "pooling" and _speculative(a) is not None,
        "--runner pooling samples nothing: --speculative-config does not apply.",
    ),
    Rule(
        lambda a: _runner(a) == "pooling" and a.enable_lora,
        "--runner pooling does not serve LoRA adapters (--enable-lora).",
    ),
    Rule(
        lambda a: (
            (s := _speculative(a)) is not None and s.method == "draft_model" and _world_size(a) > 1
        ),
        "--speculative-config method draft_model runs on a single worker; with "
        "--tensor-parallel-size or --pipeline-parallel-size above 1 use the ngram method.",
    ),
)

MODEL_RULES = (
    Rule(
        lambda a, m: m.capabilities.pooler is not None and m.capabilities.speculative is not None,
        "the model runs the pooling runner (an embedding model: --runner auto chose it), "
        "which samples nothing: --speculative-config does not apply.",
    ),
    Rule(
        lambda a, m: m.capabilities.pooler is not None and m.capabilities.lora is not None,
        "the model runs the pooling runner (an embedding model: --runner auto chose it), "
        "which does not serve LoRA adapters (--enable-lora).",
    ),
)


def check_compatibility(args) -> None:
    """ValueError naming the flags of the first refused combination."""
    for rule in RULES:
        if rule.refuses(args):
            raise ValueError(rule.message)


def check_with_model(args, model) -> None:
    """ValueError naming the flags the described model (a ModelInfo) refuses."""
    for rule in MODEL_RULES:
        if rule.refuses(args, model):
            raise ValueError(rule.message)
