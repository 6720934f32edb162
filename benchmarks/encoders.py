"""Encoders against sentence-transformers and llama-server on the CPU: `pagestream bench
embed --encoders minilm,bge-base`.

Random BERT encoders of real shapes as sentence-transformers folders; pagestream's pooling
runner, sentence-transformers' encode and llama-server --embedding (llama.cpp's own F32
GGUF; left out, its error recorded, where it fails) on the same texts, on EmbedDriver.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import subprocess
import urllib.request
from collections import namedtuple
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.embeddings import (
    EmbedProfile,
    drive,
    engine,
    input_stats,
    pagestream_engine,
    per_size,
)
from benchmarks.serve_peer import LlamaServer
from benchmarks.workload import CORPUS_PATH, Profile, make_workload

logger = logging.getLogger(__name__)

ST = "sentence-transformers float32"
ENCODER_PROFILES = {
    "smoke": EmbedProfile("smoke", 12, 1, (4,), 2, (2,)),
    "quick": EmbedProfile("quick", 128, 3, (8, 32, 128), 16, (4, 16)),
    "full": EmbedProfile("full", 256, 5, (8, 32, 128), 32, (4, 16)),
}
VOCAB = 30522  # BERT's uncased WordPiece vocabulary
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # ids 0..4, as BERT's
LLAMA = "llama-server F32, {} clients"
JSON = {"Content-Type": "application/json"}
WARM_UP = 16  # inputs; a process's first full call is slow until its engine has warmed up


# pooling: 1_Pooling's, mean or cls (then Normalize); max_seq_length: sentence_bert_config.json's
EncoderShape = namedtuple("EncoderShape", "layers hidden heads intermediate pooling max_seq_length")
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
    kv_cache_memory: str = "64MiB"  # no KV cache, but the block pool is sized by it

    def __post_init__(self) -> None:
        if unknown := set(self.shapes) - set(ENCODER_SHAPES):
            raise ValueError(f"unknown encoder shapes {sorted(unknown)}: {list(ENCODER_SHAPES)}")


def encoder_folder(name: str) -> Path:
    """`name`'s random sentence-transformers folder, made once (renamed into place whole)."""
    import torch
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, BertTokenizerFast

    from services.common.cache_dir import cache_dir

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
    # BERT's layout: the specials, the corpus's lower-cased WordPiece pieces, [unusedN]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB, special_tokens=SPECIALS)
    tokenizer.train_from_iterator(CORPUS_PATH.read_text(encoding="utf-8").splitlines(), trainer)
    words = sorted(vocab := tokenizer.get_vocab(), key=vocab.get)
    words += [f"[unused{i}]" for i in range(VOCAB - len(words))]
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


class EmbeddingServer(LlamaServer):
    """llama-server --embedding: `slots` slots of 512 positions, on pagestream's threads."""

    def command(self) -> list[str]:
        import torch

        threads = str(torch.get_num_threads())
        return [
            *(self.binary, "-m", str(self.gguf), "--embedding", "-t", threads, "-tb", threads),
            *("-np", str(self.slots), "-c", str(self.slots * 512), "--no-webui"),
            *("--host", "127.0.0.1", "--port", str(self.port)),
        ]


def llama_embed(url: str, texts: list[str], clients: int) -> np.ndarray:
    """`clients` clients posting one text each to /v1/embeddings, in input order."""

    def post(text: str) -> list[float]:
        body = json.dumps({"input": text}).encode()
        request = urllib.request.Request(url + "/v1/embeddings", body, JSON)
        with urllib.request.urlopen(request, timeout=600) as reply:
            return json.load(reply)["data"][0]["embedding"]

    with ThreadPoolExecutor(clients) as pool:
        return np.array(list(pool.map(post, texts)), np.float32)


def llama_setup(folder: Path, options: EncoderOptions) -> dict:
    """The folder's F32 GGUF file by llama.cpp's own converter ($LLAMA_CPP_DIR; made once) and
    llama-server, checked on one input; {"error": ...} where either fails (with what
    llama-server printed, where it did not start)."""
    from benchmarks.full_size import converter_command
    from benchmarks.serve_peer import llama_server_binary, llama_server_version

    if not options.llamacpp:
        return {"error": "not run (--no-llamacpp)"}
    gguf = folder.with_name(f"{folder.name}.f32.gguf")
    try:
        binary = llama_server_binary(options)
        if not gguf.is_file():
            tmp = gguf.with_name(gguf.name + ".tmp")
            command = converter_command(folder, tmp, "f32", "bert-bge")
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"convert_hf_to_gguf.py failed: {done.stderr[-2000:]}")
            tmp.rename(gguf)
        with (server := EmbeddingServer(binary, gguf, 1, None)):
            llama_embed(server.url, ["a check"], 1)
    except (OSError, RuntimeError, TimeoutError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        if "exited before it was ready" in error:  # run again, for what it printed
            done = subprocess.run(server.command(), capture_output=True, text=True, timeout=120)
            error += f"; it printed: {(done.stdout + done.stderr).strip()[-1500:]}"
        logger.warning("llama-server left out: %s", error)
        return {"error": error}
    return {"binary": binary, "version": llama_server_version(binary), "gguf": str(server.gguf)}


@contextlib.contextmanager
def st_engine(folder: Path, size: int):
    from sentence_transformers import SentenceTransformer

    encode = SentenceTransformer(str(folder), device="cpu").encode
    yield functools.partial(encode, batch_size=size, show_progress_bar=False), "float32", "none"


@contextlib.contextmanager
def llama_engine(llama: dict, size: int):
    with EmbeddingServer(llama["binary"], Path(llama["gguf"]), size, None) as server:
        yield functools.partial(llama_embed, server.url, clients=size), "F32 GGUF", "none"


def run_encoders(options: EncoderOptions) -> dict:
    """Every shape, every configuration over the rounds."""
    import torch
    from transformers import AutoTokenizer

    profile, threads, shapes = options.profile, torch.get_num_threads(), []
    for name in options.shapes:
        folder = encoder_folder(name)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        lengths = Profile("embed", profile.num_inputs, 0, 126, (14, 254))  # + [CLS], [SEP]
        requests = make_workload(tokenizer, lengths).requests
        texts = [tokenizer.decode(r.prompt_token_ids).lstrip("# ") for r in requests]  # no ##x
        token_ids = tokenizer(texts).input_ids
        llama = llama_setup(folder, options)
        ours = {"model": str(folder), "kv_cache_memory": options.kv_cache_memory}
        clients = () if "error" in llama else profile.concurrencies
        configs = [
            engine("pagestream float32", pagestream_engine, None, True, **ours),
            engine("pagestream dtype auto", pagestream_engine, None, True, dtype="auto", **ours),
            *per_size(ST + ", batch {}", st_engine, "st", profile.hf_batch_sizes, folder=folder),
            *per_size(LLAMA, llama_engine, "llama", clients, llama=llama),
        ]
        runs = drive(profile, texts, configs, ("st", "llama"), warm=WARM_UP, tokens=token_ids)
        stats = input_stats(token_ids)
        shape = {"shape": name, **ENCODER_SHAPES[name]._asdict(), "inputs": stats}
        shapes.append({**shape, "llama_server": llama, "runs": runs})
    return {
        "profile": profile.name,
        "rounds": profile.rounds,
        "threads": threads,
        "single_inputs": profile.single_inputs,
        "shapes": shapes,
    }
