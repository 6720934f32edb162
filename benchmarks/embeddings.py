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

Encoder mode (`--encoders minilm,bge-base`): random BERT encoders of real shapes
(ENCODER_SHAPES) as sentence-transformers folders, made once under
$PAGESTREAM_CACHE/encoder_bench/ with a WordPiece tokenizer trained on the corpus (padded
with unreachable [unusedN] pieces to BERT's 30522). The same passages as text for every
engine, 16..256 tokens with [CLS] and [SEP]: pagestream's `LLM(folder, runner="pooling",
dtype=D).embed(texts)` at float32 and at dtype auto, sentence-transformers'
`encode(texts, batch_size=B)` at each of `hf_batch_sizes`, and llama-server `--embedding
-np C` (the GGUF by llama.cpp's own converter, f32) with C clients posting one text each
to /v1/embeddings, for each C of `concurrencies`. Ratios against each round's fastest
sentence-transformers batch size and llama-server C; cosines against sentence-
transformers'. Each run warms up on the first WARM_UP inputs. A llama-server that fails
is left out, its error recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import logging
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.ab_driver import ABDriver
from benchmarks.ab_workload import ABWorkload
from benchmarks.results import median, ratio
from benchmarks.variant import Variant
from benchmarks.workload import CORPUS_PATH, Profile, make_workload

logger = logging.getLogger(__name__)

HF = "HF AutoModel float32"
ST = "sentence-transformers float32"
LLAMA = "llama-server"


@dataclass(frozen=True)
class EmbedProfile:
    name: str
    num_inputs: int
    rounds: int
    hf_batch_sizes: tuple[int, ...]  # the encoder mode: sentence-transformers' batch sizes
    single_inputs: int  # one at a time
    concurrencies: tuple[int, ...] = ()  # the encoder mode: llama-server's clients


# quick on 2 cores: ~2 min a round (64 inputs, 9k tokens; HF batch 1 is the slowest run)
EMBED_PROFILES = {
    "smoke": EmbedProfile("smoke", 8, 1, (1, 4), 2),
    "quick": EmbedProfile("quick", 64, 3, (1, 16), 16),
    "full": EmbedProfile("full", 256, 5, (1, 16, 64), 32),
}
ENCODER_PROFILES = {
    "smoke": EmbedProfile("smoke", 12, 1, (4,), 2, (2,)),
    "quick": EmbedProfile("quick", 128, 3, (8, 32, 128), 16, (4, 16)),
    "full": EmbedProfile("full", 256, 5, (8, 32, 128), 32, (4, 16)),
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
    pagestream's pooling runner, HF AutoModel, sentence-transformers or llama-server; a run
    embeds the workload's inputs (token ids or texts) after a warm-up on the first `warm`,
    the first inputs one at a time where the variant says `single`; rows against each
    round's fastest run of each group (vs_NAME) and the reference's embeddings (cosine)."""

    profile: EmbedProfile | None = None
    warm: int = 2
    groups: dict[str, list[str]] = field(default_factory=dict)  # NAME -> its labels
    reference: str = HF  # the label whose first round's embeddings the cosines compare with
    folder: Path | None = None  # the encoder's (sentence-transformers, llama-server)
    llama: dict = field(default_factory=dict)  # llama_setup's
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
        elif how["kind"] == "st":
            from sentence_transformers import SentenceTransformer

            model = SentenceTransformer(str(self.folder), device="cpu")
            encode = functools.partial(model.encode, show_progress_bar=False)
            yield functools.partial(encode, batch_size=how["size"]), "float32", "none"
        else:
            gguf, size = Path(self.llama["gguf"]), how["size"]
            with embedding_server(self.llama["binary"], gguf, size) as server:
                yield functools.partial(llama_embed, server.url, clients=size), "F32 GGUF", "none"
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


# ---- the encoder mode ------------------------------------------------------------------
VOCAB = 30522  # BERT's uncased WordPiece vocabulary
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4, as BERT's
# Warm-up inputs: 2 left pagestream's first engine in a process 10x slower on its first
# full call (tiny shape, 12 inputs: 0.25 s, then 0.025 s); 8 did not.
WARM_UP = 16


@dataclass(frozen=True)
class EncoderShape:
    layers: int
    hidden: int
    heads: int
    intermediate: int
    pooling: str  # 1_Pooling's: mean or cls (then Normalize)
    max_seq_length: int  # sentence_bert_config.json's


ENCODER_SHAPES = {
    "minilm": EncoderShape(6, 384, 12, 1536, "mean", 256),  # all-MiniLM-L6-v2
    "bge-base": EncoderShape(12, 768, 12, 3072, "cls", 512),  # bge-base-en-v1.5
    "tiny": EncoderShape(2, 64, 4, 128, "mean", 256),  # tests and smoke runs
}


@dataclass(frozen=True)
class EncoderOptions:
    shapes: tuple[str, ...]
    profile: EmbedProfile
    llamacpp: bool = True
    llama_server: str | None = None  # the binary (else $LLAMA_SERVER, else on PATH)
    # An encoder keeps no KV cache, but the engine sizes a block pool by this: at the
    # default (4 GiB) the tiny shape took 41 s and 7 GB to start (2 cores; not timed).
    kv_cache_memory: str = "64MiB"

    def __post_init__(self) -> None:
        if unknown := set(self.shapes) - set(ENCODER_SHAPES):
            raise ValueError(f"unknown encoder shapes {sorted(unknown)}: {list(ENCODER_SHAPES)}")


def wordpiece_vocab() -> list[str]:
    """BERT's layout: the specials, the corpus's lower-cased WordPiece pieces, [unusedN]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=SPECIALS)
    tokenizer.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer)
    words = sorted(vocab := tokenizer.get_vocab(), key=vocab.get)
    return words + [f"[unused{i}]" for i in range(VOCAB - len(words))]


def encoder_folder(name: str) -> Path:
    """`name`'s random sentence-transformers folder, made once (renamed into place whole)."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from services.common.model_source import cache_dir

    shape, out = ENCODER_SHAPES[name], cache_dir() / "encoder_bench" / name
    if out.is_dir():
        return out
    tmp = out.with_name(name + ".tmp")
    torch.manual_seed(0)
    config = BertConfig(  # 512 positions, BERT's default
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
    )
    BertModel(config).save_pretrained(tmp)
    words = wordpiece_vocab()
    BertTokenizerFast(vocab={w: i for i, w in enumerate(words)}).save_pretrained(tmp)
    (tmp / "vocab.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
    modules = [("", "Transformer"), ("1_Pooling", "Pooling"), ("2_Normalize", "Normalize")]
    files = {
        "modules.json": [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (path, kind) in enumerate(modules)
        ],
        "1_Pooling/config.json": {
            "word_embedding_dimension": shape.hidden,
            "pooling_mode_cls_token": shape.pooling == "cls",
            "pooling_mode_mean_tokens": shape.pooling == "mean",
        },
        "sentence_bert_config.json": {"max_seq_length": shape.max_seq_length},
    }
    for path, _ in modules[1:]:
        (tmp / path).mkdir()
    for file, content in files.items():
        (tmp / file).write_text(json.dumps(content), encoding="utf-8")
    tmp.rename(out)
    return out


def encoder_gguf(folder: Path) -> Path:
    """The folder's F32 GGUF file by llama.cpp's own converter ($LLAMA_CPP_DIR), made once."""
    from benchmarks.full_size import converter_command

    out = folder.with_name(f"{folder.name}.f32.gguf")
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        command = converter_command(folder, tmp, "f32", "bert-bge")
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed: {done.stderr[-2000:]}")
        tmp.rename(out)
    return out


def embedding_server(binary: str, gguf: Path, slots: int):
    """llama-server --embedding (benchmarks/serve_peer.py's) with `slots` slots of 512
    positions, on pagestream's threads."""
    import torch

    from benchmarks.serve_peer import LlamaServer

    threads = str(torch.get_num_threads())

    class EmbeddingServer(LlamaServer):
        def command(self) -> list[str]:
            return [
                *(self.binary, "-m", str(self.gguf), "--embedding", "-t", threads, "-tb", threads),
                *("-np", str(self.slots), "-c", str(self.slots * 512), "--no-webui"),
                *("--host", "127.0.0.1", "--port", str(self.port)),
            ]

    return EmbeddingServer(binary, gguf, slots, options=None)


def llama_embed(url: str, texts: list[str], clients: int) -> np.ndarray:
    """`clients` clients posting one text each to /v1/embeddings, in input order."""

    def post(text: str) -> list[float]:
        body = json.dumps({"input": text}).encode()
        request = urllib.request.Request(url + "/v1/embeddings", body, JSON)
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.load(reply)["data"][0]["embedding"]

    with ThreadPoolExecutor(clients) as pool:
        return np.array(list(pool.map(post, texts)), np.float32)


JSON = {"Content-Type": "application/json"}


def llama_setup(folder: Path, options: EncoderOptions) -> dict:
    """The GGUF file and llama-server, checked on one input; {"error": ...} where either
    fails (with what llama-server printed, where it did not start)."""
    from benchmarks.serve_peer import llama_server_binary, llama_server_version

    if not options.llamacpp:
        return {"error": "not run (--no-llamacpp)"}
    try:
        binary = llama_server_binary(options)
        with (server := embedding_server(binary, encoder_gguf(folder), 1)):
            llama_embed(server.url, ["a check"], 1)
    except (OSError, RuntimeError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        if "exited before it was ready" in error:  # run again, for what it printed
            done = subprocess.run(server.command(), capture_output=True, text=True, timeout=120)
            error += f"; it printed: {(done.stdout + done.stderr).strip()[-1500:]}"
        logger.warning("llama-server left out: %s", error)
        return {"error": error}
    return {"binary": binary, "version": llama_server_version(binary), "gguf": str(server.gguf)}


def encoder_texts(tokenizer, profile: EmbedProfile) -> list[str]:
    """The passages as text: 14..254 pieces (16..256 tokens with [CLS] and [SEP])."""
    shapes = Profile("embed", profile.num_inputs, prompt_median=126, prompt_range=(14, 254))
    requests = make_workload(tokenizer, shapes).requests
    return [tokenizer.decode(r.prompt_token_ids).lstrip("# ") for r in requests]  # no ##x first


def encoder_configs(profile: EmbedProfile, llama: bool, options: EncoderOptions) -> list[Variant]:
    llm = {"kv_cache_memory": options.kv_cache_memory}
    configs = [
        engine("pagestream float32", "pagestream", True, llm=llm),
        engine("pagestream dtype auto", "pagestream", True, dtype="auto", llm=llm),
    ]
    for i, size in enumerate(profile.hf_batch_sizes):
        configs.append(engine(f"{ST}, batch {size}", "st", i == 0, size=size))
    for i, size in enumerate(profile.concurrencies if llama else ()):
        configs.append(engine(f"{LLAMA} F32, {size} clients", "llama", i == 0, size=size))
    return configs


def run_encoder(name: str, options: EncoderOptions) -> dict:
    """One shape, every configuration over the rounds."""
    from transformers import AutoTokenizer

    profile, folder = options.profile, encoder_folder(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = encoder_texts(tokenizer, profile)
    token_ids = tokenizer(texts).input_ids
    llama = llama_setup(folder, options)
    configs = encoder_configs(profile, "error" not in llama, options)
    groups = {k: [c.label for c in configs if c.engine["kind"] == k] for k in ("st", "llama")}
    driver = EmbedDriver(
        str(folder),
        [ABWorkload("inputs", texts)],
        profile.rounds,
        profile=profile,
        warm=WARM_UP,
        groups=groups,
        reference=groups["st"][0],
        folder=folder,
        llama=llama,
        tokens=token_ids,
    )
    runs = driver.run(configs)
    shape = dataclasses.asdict(ENCODER_SHAPES[name])
    inputs = input_stats(token_ids)
    return {"shape": name, **shape, "inputs": inputs, "llama_server": llama, "runs": runs}


def run_encoders(options: EncoderOptions) -> dict:
    import torch

    return {
        "profile": options.profile.name,
        "rounds": options.profile.rounds,
        "threads": torch.get_num_threads(),
        "single_inputs": options.profile.single_inputs,
        "shapes": [run_encoder(name, options) for name in options.shapes],
    }
