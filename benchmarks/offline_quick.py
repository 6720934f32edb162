"""Quick offline throughput check: pagestream LLM.generate vs HF generate (static padded
batches) on the same prompts and output lengths, measured side by side in one run.

    .venv/bin/python benchmarks/offline_quick.py [--num-prompts 16] [--max-tokens 64]

Prints output tokens/s of both and the ratio (median of --repeats runs each).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagestream import LLM, SamplingParams
from services.worker.models.gguf_weights import dequantized_folder

TOPICS = ["the sea", "a paged cache", "trains", "bread", "the moon", "rivers", "music", "chess"]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]}, part {i}." for i in range(n)]


def run_ours(llm: LLM, texts: list[str], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(texts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def run_hf(model, tokenizer, texts: list[str], max_tokens: int, batch: int) -> float:
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    start, total = time.perf_counter(), 0
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i : i + batch], return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
        total += (out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0]
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hf-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    texts = prompts(args.num_prompts)
    folder = dequantized_folder("smollm2-135m-instruct")
    llm = LLM(kv_cache_memory="1GiB")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ours, hf = [], []
    for _ in range(args.repeats):  # interleaved, so both see the same machine load
        ours.append(run_ours(llm, texts, args.max_tokens))
        hf.append(run_hf(model, tokenizer, texts, args.max_tokens, args.hf_batch))
    o, h = statistics.median(ours), statistics.median(hf)
    print(f"torch threads: {torch.get_num_threads()}")
    print(f"pagestream: {o:.1f} output tok/s   HF static batch {args.hf_batch}: {h:.1f} tok/s")
    print(f"ratio: {o / h:.2f}x")


if __name__ == "__main__":
    main()
