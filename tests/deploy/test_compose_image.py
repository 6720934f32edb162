"""The compose files, read statically: every service builds the image with a torch build
that fits it (CUDA where a GPU is reserved, CPU under compose.cpu.yaml), and the public
frontend takes its API key from api-key.env (it listens on 0.0.0.0, so it would refuse to
start without one) and never opts out of it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pagestream.cli import build_parser
from pagestream.start_checks import check_start

REPO = Path(__file__).resolve().parents[2]
COMPLETE = ("compose.yaml", "compose.tp2.yaml", "compose.dp2.yaml")


class _Loader(yaml.SafeLoader):
    """YAML with compose's `!reset` tag (an override that removes a key)."""


_Loader.add_constructor("!reset", lambda loader, node: None)


def services(name: str) -> dict[str, dict]:
    return yaml.load((REPO / name).read_text(), _Loader)["services"]


def dockerfile_args() -> set[str]:
    lines = (REPO / "Dockerfile").read_text().splitlines()
    return {line.split()[1].split("=")[0] for line in lines if line.startswith("ARG ")}


def reserves_gpu(service: dict) -> bool:
    devices = (service.get("deploy") or {}).get("resources", {}).get("reservations", {})
    return any("gpu" in d.get("capabilities", []) for d in devices.get("devices", []))


@pytest.mark.parametrize("name", COMPLETE)
def test_every_service_builds_a_torch_that_fits_it(name):
    found = services(name)
    for service_name, service in found.items():
        args = service["build"]["args"]
        assert set(args) <= dockerfile_args(), service_name
        assert args["TORCH_VARIANT"] == "cu128", service_name
    assert any(reserves_gpu(s) for s in found.values())


def test_the_cpu_override_builds_the_cpu_torch_for_every_service():
    base, cpu = services("compose.yaml"), services("compose.cpu.yaml")
    assert set(cpu) == set(base)
    for service in cpu.values():
        assert service["build"]["args"]["TORCH_VARIANT"] == "cpu"
        assert not reserves_gpu(service)


@pytest.mark.parametrize("name", COMPLETE)
def test_the_frontend_takes_its_key_from_the_env_file(name, monkeypatch):
    frontend = services(name)["frontend"]
    assert frontend["env_file"] == "api-key.env"
    argv = frontend["command"].split()
    assert "--allow-unauthenticated" not in argv and "--api-key" not in argv
    monkeypatch.delenv("PAGESTREAM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):
        check_start(build_parser().parse_args(argv[1:]))


def test_the_key_file_is_never_committed():
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "api-key.env" in ignored
