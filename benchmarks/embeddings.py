"""Embeddings against HF AutoModel on the CPU: `pagestream bench embed`.

pagestream's pooling runner (float32, dtype auto, the GGUF file as it is) against AutoModel
float32 in padded batches, on the default corpus's passages, LAST pooling, normalized;
EmbedDriver runs embedding engines on the A/B driver. The encoder mode: encoders.py.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from benchmarks.ab_driver import ABDriver, ABWorkload, Variant
from benchmarks.results import median, ratio
from benchmarks.workload import Profile, make_workload

HF = "HF AutoModel float32"
POOLING = "LAST"  # the decoder embedding models' default


@dataclass(frozen=True)
class EmbedProfile:
    name: str
    num_inputs: int
    rounds: int
    hf_batch_sizes: tuple[int, ...]  # encoders.py's: sentence-transformers' batch sizes
    single_inputs: int  # one at a time
    concurrencies: tuple[int, ...] = ()  # encoders.py's: llama-server's clients


EMBED_PROFILES = {
    "smoke": EmbedProfile("smoke", 8, 1, (1, 4), 2),
    "quick": EmbedProfile("quick", 64, 3, (1, 16), 16),  # ~2 min a round on 2 cores
    "full": EmbedProfile("full", 256, 5, (1, 16, 64), 32),
}


@dataclass(frozen=True)
class EmbedOptions:
    model: str  # the float weights' folder
    source: str  # the model as given (a GGUF name runs its quantized file too)
    profile: EmbedProfile
    kv_cache_memory: str = "2GiB"


def engine(label: str, start: Callable, group: str | None = None, single=False, **how) -> Variant:
    """A configuration: start(**how) yields (embed(inputs) -> [n, hidden], dtype,
    quantization); `group`: its vs_NAME; `single`: the first inputs one at a time too."""
    opened = functools.partial(start, **how)
    return Variant(label, {"start": opened, "group": group, "single": single})


def per_size(label: str, start: Callable, group: str, sizes, **how) -> list[Variant]:
    """One configuration per size (label.format(size)), the first one at a time too."""
    return [
        engine(label.format(n), start, group, i == 0, size=n, **how) for i, n in enumerate(sizes)
    ]


@contextlib.contextmanager
def pagestream_engine(model: str, dtype: str = "float32", **llm_args):
    from pagestream import LLM

    llm = LLM(model, runner="pooling", dtype=dtype, **llm_args)
    info = llm.engine.model_info
    try:
        yield functools.partial(pagestream_embed, llm), info.dtype, info.quantization
    finally:
        llm.engine.close()


def pagestream_embed(llm, inputs: list) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)], np.float32)


@contextlib.contextmanager
def hf_engine(model: str, size: int):
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    yield functools.partial(hf_embed, model, size=size), "float32", "none"


def hf_embed(model, batch: list[list[int]], size: int | None = None) -> np.ndarray:
    """AutoModel on right-padded batches of `size` (None: one): each row's last real
    position, normalized."""
    import torch

    if size and len(batch) > size:
        chunks = [batch[i : i + size] for i in range(0, len(batch), size)]
        return np.concatenate([hf_embed(model, chunk) for chunk in chunks])
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


def seconds(call, *args) -> tuple[float, object]:
    start = time.perf_counter()
    result = call(*args)
    return time.perf_counter() - start, result


def normalized(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@dataclass
class EmbedDriver(ABDriver):
    """A run embeds the inputs (token ids or texts) after a warm-up on the first `warm`; rows
    against each round's fastest run of each group (vs_NAME: the median ratio) and the
    first group's first configuration's embeddings (cosines)."""

    profile: EmbedProfile | None = None
    warm: int = 2
    groups: dict[str, list[str]] = field(default_factory=dict)  # NAME -> its labels
    tokens: list | None = None  # the inputs' token ids, where the inputs are texts

    @contextlib.contextmanager
    def start(self, variant: Variant):
        with variant.engine["start"]() as opened:
            yield opened
        gc.collect()

    def held(self, engine: tuple) -> dict:
        return {"dtype": engine[1], "quantization": engine[2]}

    def measure(self, engine: tuple, variant, workload, batch) -> dict:
        embed, inputs = engine[0], workload.requests
        embed(inputs[: self.warm])
        elapsed, embeddings = seconds(embed, inputs)
        singles = inputs[: self.profile.single_inputs if variant.engine["single"] else 0]
        single_s = [seconds(embed, [one])[0] for one in singles]
        return {"elapsed_s": elapsed, "embeddings": np.asarray(embeddings), "single_s": single_s}

    def row(self, variant, workload, batch, runs, baseline) -> dict:
        """One configuration's figures (vs_NAME None where the group ran nothing)."""
        count, reference = len(workload.requests), next(iter(self.groups.values()))[0]
        rates = {key[0]: [count / r["elapsed_s"] for r in rs] for key, rs in self.found.items()}
        per_s, vs = rates[variant.label], {}
        for name, labels in self.groups.items():
            best = [max((rates[x][i] for x in labels), default=None) for i in range(len(runs))]
            vs[f"vs_{name}"] = median([ratio(a, b) for a, b in zip(per_s, best, strict=True)])
        tokens = sum(map(len, self.tokens or workload.requests))
        ref = self.found[(reference, workload.name, batch)][0]["embeddings"]
        cosines = (normalized(runs[0]["embeddings"]) * normalized(ref)).sum(axis=1)
        single = [statistics.median(r["single_s"]) * 1000 for r in runs if r["single_s"]]
        return {
            "config": variant.label,
            **self.engines[variant.label],  # dtype, quantization
            "inputs_per_s": median(per_s),
            "tokens_per_s": median([tokens / r["elapsed_s"] for r in runs], 1),
            **vs,
            "single_ms": median(single, 1) if single else None,
            "cosine_min": round(float(cosines.min()), 6),
            "cosine_median": round(float(np.median(cosines)), 6),
        }


def drive(profile: EmbedProfile, inputs: list, configs: list, groups, **driver) -> list[dict]:
    """The configurations' rows over the profile's rounds, vs each of `groups`."""
    labels = {g: [c.label for c in configs if c.engine["group"] == g] for g in groups}
    workloads = [ABWorkload("inputs", inputs)]
    embed = EmbedDriver("", workloads, profile.rounds, profile=profile, groups=labels, **driver)
    return embed.run(configs)


def run_embed(tokenizer, options: EmbedOptions) -> dict:
    import torch
    from transformers import AutoConfig

    from services.common.model_source import gguf_source

    profile, model = options.profile, options.model
    longest = min(512, getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", 512))
    shapes = Profile("embed", profile.num_inputs, 0, min(128, longest // 2), (8, longest), 1)
    inputs = [r.prompt_token_ids[:longest] for r in make_workload(tokenizer, shapes).requests]
    llm = {
        "kv_cache_memory": options.kv_cache_memory,
        "pooler_config": {"pooling_type": POOLING, "normalize": True},
        "enable_prefix_caching": False,  # rounds repeat the inputs: no hits across them
    }
    configs = [
        engine("pagestream float32", pagestream_engine, None, True, model=model, **llm),
        engine("pagestream dtype auto", pagestream_engine, model=model, dtype="auto", **llm),
    ]
    if gguf_source(options.source) is not None:
        source = {"model": options.source, "dtype": "auto", **llm}
        configs.append(engine("pagestream GGUF (quantized)", pagestream_engine, **source))
    configs += per_size(HF + ", batch {}", hf_engine, "hf", profile.hf_batch_sizes, model=model)
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "threads": torch.get_num_threads(),
        "pooling_type": POOLING,
        "inputs": input_stats(inputs),
        "single_inputs": profile.single_inputs,
        "runs": drive(profile, inputs, configs, ("hf",)),
    }


def input_stats(inputs: list[list[int]]) -> dict:
    n = list(map(len, inputs))  # tokens per input
    return {"count": len(n), "tokens": sum(n), "median": float(np.median(n)), "max": max(n)}
