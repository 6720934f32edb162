"""The committed gRPC stubs match the .proto files (run `make protos` after editing them)."""

import re

from services.common.proto.generate import OUT, generate

# Version stamps depend on the installed grpcio-tools, not on the .proto files.
_VERSION = re.compile(
    r"^.*(Protobuf Python Version|GRPC_GENERATED_VERSION|_runtime_version"
    r"|\d+,\s*$|'',\s*$|\d+,\s*\d+,\s*\d+).*$\n?",
    re.M,
)


def _normalise(text: str) -> str:
    return _VERSION.sub("", text)


def test_stubs_match_protos(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = OUT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run make protos"
        assert _normalise(committed.read_text()) == _normalise(path.read_text()), (
            f"{committed.name} is out of date with protos/: run make protos"
        )
