"""`python -m pagestream_kernels.cpu.build`: build (or find built) the C++ CPU kernels; `make setup`
runs it so that no model load compiles them. Exits 1, saying why, when they cannot be."""

from __future__ import annotations

import logging
import sys
import time

from pagestream_kernels import cpu


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    reason = cpu.unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 1
    print(f"C++ CPU kernels ready ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
