"""Hypothesis profiles: `ci` replays the same examples on every run (HYPOTHESIS_PROFILE=ci, set
by .ci/run) so a green main stays green; the default explores new random examples each run."""

import os

from hypothesis import settings

# dtype "auto" is bfloat16 on CPUs with native bf16 (services/worker/model_loader.py); the
# tests compare with HF transformers in float32, so here "auto" means float32 (inherited by
# every role process they start). Tests of bf16 ask for dtype="bfloat16" themselves.
os.environ.setdefault("PAGESTREAM_CPU_DTYPE", "float32")

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
