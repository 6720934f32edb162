"""Benchmarks of pagestream beside HF transformers and llama.cpp, all behind `pagestream bench`
(cli.py runs sections.py's sections; report.py writes docs/benchmarks.md). Run modules as
`python -m benchmarks.<name>` (benchmarks/ first on sys.path would shadow `kernels`)."""
