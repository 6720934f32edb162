"""Benchmarks against HF transformers: workloads, drivers and the report (`pagestream bench`).

Run modules as `python -m benchmarks.<name>` from the repository root (a script run as
`python benchmarks/<name>.py` puts benchmarks/ first on sys.path, where kernels.py would
shadow the top-level `kernels` package).
"""
