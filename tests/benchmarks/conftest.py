"""The benchmarks' tests run on the engine tests' tiny models (HF folders with a tokenizer)."""

from tests.engine.conftest import model_dir  # noqa: F401  (the fixture, shared)
