"""Generate the Python gRPC stubs for protos/pagestream/{v1,internal/v1}/*.proto.

    python -m services.common.proto.generate [--out DIR]

pagestream.v1 is the public API; pagestream.internal.v1 is the wire between our own
processes. protoc writes imports such as `from pagestream.v1 import generation_pb2`, which
would resolve against our own `pagestream` package; they are rewritten to absolute imports
under services.common.proto.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = ROOT / "protos"
OUT = Path(__file__).resolve().parent
PACKAGE = "services.common.proto"
# Proto packages, as folders under protos/ (and under the output).
FOLDERS = (Path("pagestream") / "v1", Path("pagestream") / "internal" / "v1")


def proto_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (PROTO_ROOT / folder).glob("*.proto"))


def _rewrite_imports(path: Path) -> None:
    text = re.sub(
        r"^from (pagestream(?:\.\w+)*) import",
        rf"from {PACKAGE}.\1 import",
        path.read_text(),
        flags=re.M,
    )
    path.write_text(text)


def _touch_packages(out: Path) -> None:
    for folder in FOLDERS:
        for depth in range(1, len(folder.parts) + 1):
            (out / Path(*folder.parts[:depth]) / "__init__.py").touch()


def generate(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = sorted(p for folder in FOLDERS for p in (out / folder).glob("*_pb2*.py*"))
    for path in written:
        _rewrite_imports(path)
    _touch_packages(out)
    return written


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=OUT)
    generate(parser.parse_args().out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
