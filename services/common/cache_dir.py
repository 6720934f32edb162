"""Where pagestream keeps what it builds: converted models, the C++ kernels' builds.

$PAGESTREAM_CACHE, else ~/.cache/pagestream (an empty value counts as unset). Every
reader asks `cache_dir()`, so a shared cache (a container's volume, `make setup`'s
download) is the same folder for the model converter and the kernel build.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PAGESTREAM_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or "~/.cache/pagestream").expanduser()
