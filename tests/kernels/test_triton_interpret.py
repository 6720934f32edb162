"""The Triton kernels through Triton's interpreter, in a process of their own.

TRITON_INTERPRET must be set before triton defines the kernels, so the cases (interpret_cases.py,
not collected on their own) run in a pytest subprocess with it set; this test fails if that run
fails, skips anything or runs nothing. Also: without the variable, asking for the triton
backend on CPU is a clear error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (a dependency of the project on Linux: make setup installs it)

REPO = Path(__file__).resolve().parents[2]
CASES = Path(__file__).with_name("interpret_cases.py")


def test_kernels_match_references_in_the_interpreter(tmp_path):
    report = tmp_path / "report.xml"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "pytest", str(CASES), "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", f"--basetemp={tmp_path / 'inner'}"]
    run = subprocess.run(
        command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False
    )
    output = run.stdout[-6000:] + run.stderr[-3000:]
    assert run.returncode == 0, output
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 20, (counts, output)
    assert counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, output)


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error():
    if os.environ.get("TRITON_INTERPRET") == "1":  # a setting of this run: no skip
        pytest.fail("this process runs the interpreter; run this test without it", False)
    from services.worker.layers.attention import resolve_attention_backend

    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", torch.device("cpu"))
    assert resolve_attention_backend("auto", torch.device("cpu")).name == "cpu"
