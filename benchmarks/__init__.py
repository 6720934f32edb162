"""Benchmarks of pagestream side by side with its peers (HF transformers, llama.cpp through
llama-cpp-python and llama-server), all behind `pagestream bench` (benchmarks/cli.py):

- sections.py: every section of the report (what runs it, where its results go, its
  SectionReport); cli.py parses the command line and runs them, or one of its TOOLS;
- workload.py: the seeded requests; results.py: the results model (RunResult, percentiles,
  ratios, agreement, the machine, results.json); report.py: the one report writer, every
  section rendered by section_report.py's SectionReport (old records through
  migration.py), plots.py its figures, markdown.py the tables;
- the drivers: ab_driver.py, the one offline A/B driver (Variants over ABWorkloads, Rows of
  one schema: speculative, lora, precision, quantized, latency; embeddings.py's EmbedDriver
  runs its embedding engines on it, encoders.py's EncoderDriver the encoders' peers too,
  structured.py's StructuredDriver its variants on one engine), offline.py (`LLM.generate`
  timed), serving.py with server_process.py and load_clients.py (servers under load over
  HTTP / gRPC), micro.py (interleaved timed calls); the peers: hf_baselines.py,
  llamacpp.py, serve_peer.py (llama-server), gguf_export.py (their weights);
- what the other sections measure with them: throughput.py, memory.py, parallel.py,
  routing.py, structured.py, and the tools.

Run modules as `python -m benchmarks.<name>` from the repository root (a script run as
`python benchmarks/<name>.py` puts benchmarks/ first on sys.path, where kernels.py would
shadow the top-level `kernels` package).
"""
