"""The Dockerfile, read statically (no Docker here): the image installs the runtime
dependencies only, at the pinned versions, picks its torch build by a build argument, runs
as an unprivileged user (the one the Kubernetes pods name), and its default command cannot
serve 0.0.0.0 without an API key. The Makefile targets it runs are checked the same way:
every pip install takes constraints.txt, and the runtime install takes no extras."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from pagestream.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
RUNTIME_STAMP = ".venv/.installed-runtime"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def dockerfile() -> list[tuple[str, str]]:
    return instructions((REPO / "Dockerfile").read_text())


def args_of(kind: str) -> list[str]:
    return [rest for word, rest in dockerfile() if word == kind]


def build_args() -> dict[str, str]:
    return dict(a.split("=", 1) for a in args_of("ARG") if "=" in a)


def make_targets(run: str) -> list[str]:
    """The targets of every `make` command in a RUN line (variable assignments dropped)."""
    targets = []
    for command in run.split("&&"):
        words = command.split()
        if words and words[0] == "make":
            targets += [w for w in words[1:] if "=" not in w and not w.startswith("-")]
    return targets


def makefile_recipe(target: str) -> list[str]:
    """The recipe lines of a Makefile rule, its variables ($(NAME), set with a value in the
    Makefile) expanded."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) [:?]?= (.+)$", text, re.MULTILINE))

    def expand(line: str) -> str:
        for _ in range(5):  # nested at most this deep
            line = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), line)
        return line

    rule = next(
        (
            m
            for m in re.finditer(r"^(\S+):[^=\n]*\n((?:\t.*\n)*)", text, re.MULTILINE)
            if expand(m[1]) == target
        ),
        None,
    )
    assert rule is not None, f"no Makefile rule for {target}"
    return [expand(line.strip()) for line in rule[2].splitlines()]


def pip_installs(lines: list[str]) -> list[list[str]]:
    return [shlex.split(line) for line in lines if re.search(r"\bpip install\b", line)]


# ---- what the image installs ---------------------------------------------------------------
def test_the_image_runs_only_the_runtime_targets():
    targets = [t for run in args_of("RUN") for t in make_targets(run)]
    assert targets == [RUNTIME_STAMP, "runtime"]
    text = " ".join(args_of("RUN"))
    for extra in ("[dev]", "[bench]", "[ray]", "pytest"):
        assert extra not in text, extra


def test_the_runtime_install_takes_no_extras_and_every_install_takes_the_pins():
    runtime = pip_installs(makefile_recipe(RUNTIME_STAMP))
    dev = pip_installs(makefile_recipe(".venv/.installed"))
    assert runtime and dev
    for argv in runtime + dev:
        assert argv[argv.index("-c") + 1] == "constraints.txt", argv
    assert runtime[-1][-2:] == ["-e", "."]
    assert not any("[" in word for argv in runtime for word in argv)
    assert dev[-1][-2:] == ["-e", ".[dev]"]
    # `make serve` stops at the runtime install; `make test` adds the dev extras.
    runtime_rule = re.search(r"^runtime:(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert ".installed)" not in runtime_rule[1] and "$(RUNTIME)" in runtime_rule[1]
    serve_rule = re.search(r"^serve:(.*)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert serve_rule[1].split() == ["runtime"]


def test_the_pins_are_in_the_image_before_the_install():
    copied_before = []
    for word, rest in dockerfile():
        if word == "COPY":
            copied_before += rest.split()[:-1]
        if word == "RUN" and RUNTIME_STAMP in make_targets(rest):
            break
    else:
        pytest.fail("no RUN installs the runtime dependencies")
    assert {"constraints.txt", "pyproject.toml", "Makefile"} <= set(copied_before)


def test_torch_comes_from_the_index_of_the_variant_argument():
    args = build_args()
    assert args["TORCH_VARIANT"] == "cpu"
    assert args["TORCH_INDEX"].endswith("/whl/${TORCH_VARIANT}")
    install = next(run for run in args_of("RUN") if RUNTIME_STAMP in make_targets(run))
    assert "TORCH_INDEX=${TORCH_INDEX}" in install
    torch_line = next(line for line in makefile_recipe(RUNTIME_STAMP) if line.endswith(" torch"))
    assert "--extra-index-url $(TORCH_INDEX)" in torch_line


def test_a_gpu_example_runs_a_cuda_build():
    """`docker run --gpus` in the comments names an image built with a CUDA TORCH_VARIANT."""
    lines = (REPO / "Dockerfile").read_text().splitlines()
    comments = [line for line in lines if line.startswith("#")]
    variant_of = {}
    for line in comments:
        build = re.search(r"docker build (.*)-t (\S+)", line)
        if build:
            variant = re.search(r"TORCH_VARIANT=(\S+)", build[1])
            variant_of[build[2]] = variant[1] if variant else "cpu"
    gpu_runs = [line for line in comments if "docker run" in line and "--gpus" in line]
    assert gpu_runs
    for line in gpu_runs:
        image = line.split()[-1]
        assert variant_of[image].startswith("cu"), line


# ---- who runs it, and how it serves -------------------------------------------------------
def image_uid() -> int:
    (user,) = args_of("USER")[-1:]
    uid = user.split(":")[0].replace("${APP_UID}", build_args()["APP_UID"])
    return int(uid)


def test_the_image_runs_as_an_unprivileged_user():
    assert image_uid() >= 1000
    user_line = next(run for run in args_of("RUN") if "useradd" in run)
    assert "--uid ${APP_UID}" in user_line


def test_the_pods_run_as_the_image_user():
    documents = [
        doc
        for path in KUBERNETES.rglob("*.yaml")
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] in ("Deployment", "StatefulSet")
    ]
    assert len(documents) == 8
    for doc in documents:
        pod = doc["spec"]["template"]["spec"]
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["runAsUser"] == context["runAsGroup"] == image_uid()
        assert context["fsGroup"] == image_uid()  # the model-cache volume is writable to it
        (container,) = pod["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_the_default_command_needs_an_api_key(monkeypatch):
    from pagestream.start_checks import check_start

    (cmd,) = args_of("CMD")
    argv = yaml.safe_load(cmd)
    assert argv[:2] == ["pagestream", "serve"] and "0.0.0.0" in argv
    assert "--allow-unauthenticated" not in argv and "--api-key" not in argv
    monkeypatch.delenv("PAGESTREAM_API_KEY", raising=False)
    with pytest.raises(ValueError, match="no API key"):
        check_start(build_parser().parse_args(argv[1:]))
    monkeypatch.setenv("PAGESTREAM_API_KEY", "from the operator")
    check_start(build_parser().parse_args(argv[1:]))
