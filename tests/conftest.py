"""Hypothesis profiles: `ci` replays the same examples on every run (HYPOTHESIS_PROFILE=ci, set
by .ci/run) so a green main stays green; the default explores new random examples each run."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
