"""Embeddings against HF transformers' AutoModel on the CPU: `pagestream bench embed`.

Inputs: `num_inputs` passages of the default corpus (benchmarks/workload.py's seeded
synthetic prompts, lengths lognormal around 128 tokens within 8..512: what a retrieval
pipeline embeds), the same token ids for every configuration. Pooling: the last token's
final hidden state, L2-normalized (LAST, the decoder embedding models' default).

pagestream: `LLM(model, runner="pooling").embed(inputs)` in one call (every input an
engine request, continuous batching, chunked prefill), on the float weights at float32 and
at dtype auto (bfloat16 on CPUs with native bf16), and on the model's GGUF file as it is
(its quantized blocks) when the model is one. HF: `AutoModel` at float32 (eager torch on
the CPU, sdpa attention), the inputs in their order in padded batches of each of
`hf_batch_sizes` (right padding, the attention mask, each row's last real position
pooled), then normalized: what a user writes without an inference server.

One input at a time: the first `single_inputs` inputs embedded one after the other (an
interactive query) by pagestream float32 and HF batch 1: the median milliseconds per input.

Each round runs every configuration once, in an order rotated each round (engines and the
HF model built anew each round, a warm-up before timing: EmbedDriver, the A/B driver of
benchmarks/ab_driver.py on embedding engines); figures are medians over the
rounds, ratios the median of each round's ratio to the same round's HF run at its fastest
batch size. Agreement: every configuration's embeddings against HF float32's (cosine
similarity: the lowest and the median over the inputs).

The encoder mode (`--encoders minilm,bge-base`: random BERT encoders against
sentence-transformers and llama-server) is benchmarks/encoders.py, on this module's
EmbedDriver.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.results import median, ratio
from benchmarks.variant import Variant
from benchmarks.workload import Profile, make_workload

HF = "HF AutoModel float32"


@dataclass(frozen=True)
class EmbedProfile:
    name: str
    num_inputs: int
    rounds: int
    hf_batch_sizes: tuple[int, ...]  # encoders.py's: sentence-transformers' batch sizes
    single_inputs: int  # one at a time
    concurrencies: tuple[int, ...] = ()  # encoders.py's: llama-server's clients


# quick on 2 cores: ~2 min a round (64 inputs, 9k tokens; HF batch 1 is the slowest run)
EMBED_PROFILES = {
    "smoke": EmbedProfile("smoke", 8, 1, (1, 4), 2),
    "quick": EmbedProfile("quick", 64, 3, (1, 16), 16),
    "full": EmbedProfile("full", 256, 5, (1, 16, 64), 32),
}


@dataclass(frozen=True)
class EmbedOptions:
    model: str  # the float weights' folder
    source: str  # the model as given (a GGUF name runs its quantized file too)
    profile: EmbedProfile
    kv_cache_memory: str = "2GiB"
    pooling_type: str = "LAST"


def engine(label: str, kind: str, single: bool = False, **how) -> Variant:
    """A configuration: its engine's kind (pagestream, hf, st, llama) and how it is made
    (model, dtype, llm: LLM arguments, size: HF / sentence-transformers' batch size or
    llama-server's clients); `single`: the first inputs one at a time too."""
    return Variant(label, {"kind": kind, "single": single, **how})


def configurations(options: EmbedOptions, gguf: bool) -> list[Variant]:
    llm = {
        "kv_cache_memory": options.kv_cache_memory,
        "pooler_config": {"pooling_type": options.pooling_type, "normalize": True},
        "enable_prefix_caching": False,  # rounds repeat the inputs: no hits across them
    }
    configs = [
        engine("pagestream float32", "pagestream", True, model=options.model, llm=llm),
        engine("pagestream dtype auto", "pagestream", model=options.model, dtype="auto", llm=llm),
    ]
    if gguf:
        source = {"model": options.source, "dtype": "auto", "llm": llm}
        configs.append(engine("pagestream GGUF (quantized)", "pagestream", **source))
    for size in options.profile.hf_batch_sizes:
        configs.append(
            engine(f"{HF}, batch {size}", "hf", size == 1, model=options.model, size=size)
        )
    return configs


def bench_inputs(tokenizer, profile: EmbedProfile, max_len: int) -> list[list[int]]:
    """The passages, none longer than the model's context (`max_len`)."""
    longest = min(512, max_len)
    shapes = Profile(
        "embed",
        profile.num_inputs,
        prompt_median=min(128, longest // 2),
        prompt_range=(8, longest),
        output_median=1,
    )
    return [r.prompt_token_ids[:longest] for r in make_workload(tokenizer, shapes).requests]


# ---- the engines -----------------------------------------------------------------------
def embedded(llm, prompts) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)], np.float32)


def timed(embed, inputs: list, profile: EmbedProfile, single: bool, warm: int = 2) -> dict:
    """embed(inputs) after a warm-up on the first `warm`, then (`single`) the first inputs
    one at a time."""
    embed(inputs[:warm])
    start = time.perf_counter()
    embeddings = embed(inputs)
    elapsed = time.perf_counter() - start
    single_s = []
    for one in inputs[: profile.single_inputs if single else 0]:
        start = time.perf_counter()
        embed([one])
        single_s.append(time.perf_counter() - start)
    return {"elapsed_s": elapsed, "embeddings": np.asarray(embeddings), "single_s": single_s}


# ---- HF -------------------------------------------------------------------------------
def hf_embed(model, batch: list[list[int]]) -> np.ndarray:
    """One padded batch through AutoModel: each row's last real position, normalized."""
    import torch

    width = max(map(len, batch))
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, tokens in enumerate(batch):
        ids[row, : len(tokens)] = torch.tensor(tokens)
        mask[row, : len(tokens)] = 1
    with torch.no_grad():
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, W, H]
    last = hidden[torch.arange(len(batch)), mask.sum(dim=1) - 1].float()  # [B, H]
    return torch.nn.functional.normalize(last, dim=-1).numpy()


def hf_batches(model, size: int, inputs: list[list[int]]) -> np.ndarray:
    return np.concatenate(
        [hf_embed(model, inputs[i : i + size]) for i in range(0, len(inputs), size)]
    )


# ---- the run ---------------------------------------------------------------------------
def _cosines(got: np.ndarray, reference: np.ndarray) -> np.ndarray:
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    reference = reference / np.linalg.norm(reference, axis=1, keepdims=True)
    return (got * reference).sum(axis=1)


def summarize(
    config, runs: list[dict], held: dict, bests: dict[str, list], reference, inputs
) -> dict:
    """One configuration's figures; `bests`: vs_NAME's per-round baselines (None: absent)."""
    tokens = sum(map(len, inputs))
    per_s = [len(inputs) / r["elapsed_s"] for r in runs]
    cosines = _cosines(runs[0]["embeddings"], reference)
    single = [statistics.median(r["single_s"]) * 1000 for r in runs if r["single_s"]]
    return {
        "config": config.label,  # the row schema's variant
        "dtype": held["dtype"],
        "quantization": held["quantization"],
        "inputs_per_s": median(per_s),
        "tokens_per_s": median([tokens / r["elapsed_s"] for r in runs], 1),
        **{
            f"vs_{name}": median([ratio(a, b) for a, b in zip(per_s, best, strict=True)])
            for name, best in bests.items()
        },
        "single_ms": median(single, 1) if single else None,
        "cosine_min": round(float(cosines.min()), 6),
        "cosine_median": round(float(np.median(cosines)), 6),
    }


@dataclass
class EmbedDriver(ABDriver):
    """The A/B driver (benchmarks/ab_driver.py) on embedding engines: a variant's engine is
    pagestream's pooling runner or HF AutoModel (benchmarks/encoders.py's EncoderDriver adds
    sentence-transformers and llama-server); a run embeds the workload's inputs (token ids
    or texts) after a warm-up on the first `warm`, the first inputs one at a time where the
    variant says `single`; rows against each round's fastest run of each group (vs_NAME)
    and the reference's embeddings (cosine)."""

    profile: EmbedProfile | None = None
    warm: int = 2
    groups: dict[str, list[str]] = field(default_factory=dict)  # NAME -> its labels
    reference: str = HF  # the label whose first round's embeddings the cosines compare with
    folder: Path | None = None  # the model of variants that name none (encoders.py's)
    tokens: list | None = None  # the inputs' token ids, where the inputs are texts

    @contextlib.contextmanager
    def start(self, variant: Variant) -> Iterator[tuple]:
        """(embed(inputs) -> [n, hidden], dtype, quantization) of the variant's engine."""
        how = variant.engine
        if how["kind"] == "pagestream":
            from pagestream import LLM

            model = how.get("model") or str(self.folder)
            llm = LLM(model, runner="pooling", dtype=how.get("dtype", "float32"), **how["llm"])
            info = llm.engine.model_info
            try:
                yield functools.partial(embedded, llm), info.dtype, info.quantization
            finally:
                llm.engine.close()
        elif how["kind"] == "hf":
            import torch
            from transformers import AutoModel

            model = AutoModel.from_pretrained(how["model"], dtype=torch.float32).eval()
            yield functools.partial(hf_batches, model, how["size"]), "float32", "none"
        else:
            raise ValueError(f"{variant.label}: no {how['kind']!r} engine here (encoders.py's)")
        gc.collect()

    def held(self, engine: tuple) -> dict:
        return {"dtype": engine[1], "quantization": engine[2]}

    def measure(self, engine: tuple, variant, workload, batch) -> dict:
        single = variant.engine["single"]
        return timed(engine[0], workload.requests, self.profile, single, self.warm)

    def row(self, variant, workload, batch, runs, baseline) -> dict:
        inputs = workload.requests
        bests = {
            name: fastest(self.found, labels, workload.name, len(inputs), self.rounds)
            for name, labels in self.groups.items()
        }
        reference = self.found[(self.reference, workload.name, batch)][0]["embeddings"]
        tokens = self.tokens if self.tokens is not None else inputs
        return summarize(variant, runs, self.engines[variant.label], bests, reference, tokens)


def run_embed(tokenizer, options: EmbedOptions) -> dict:
    import torch
    from transformers import AutoConfig

    from services.common.model_source import gguf_source

    profile = options.profile
    config = AutoConfig.from_pretrained(options.model)
    inputs = bench_inputs(tokenizer, profile, getattr(config, "max_position_embeddings", 512))
    configs = configurations(options, gguf_source(options.source) is not None)
    hf_labels = [c.label for c in configs if c.engine["kind"] == "hf"]
    driver = EmbedDriver(
        options.model,
        [ABWorkload("inputs", inputs)],
        profile.rounds,
        profile=profile,
        groups={"hf": hf_labels},
        reference=hf_labels[0],
    )
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "threads": torch.get_num_threads(),
        "pooling_type": options.pooling_type,
        "inputs": input_stats(inputs),
        "single_inputs": profile.single_inputs,
        "runs": driver.run(configs),
    }


def fastest(found: dict, labels: list[str], workload: str, count: int, rounds: int) -> list:
    """Each round's inputs/s of the fastest of `labels` (None: no such run)."""
    return [
        max(
            (count / found[(label, workload, None)][i]["elapsed_s"] for label in labels),
            default=None,
        )
        for i in range(rounds)
    ]


def input_stats(inputs: list[list[int]]) -> dict:
    lengths = [len(ids) for ids in inputs]
    return {
        "count": len(lengths),
        "tokens": sum(lengths),
        "median": float(np.median(lengths)),
        "max": max(lengths),
    }


def with_profile(profile: EmbedProfile, num_inputs: int | None, rounds: int | None):
    changes = {"num_inputs": num_inputs, "rounds": rounds}
    return dataclasses.replace(profile, **{k: v for k, v in changes.items() if v})
