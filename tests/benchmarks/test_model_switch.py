"""benchmarks/model_switch.py on two tiny GGUF files: every timed request under
--models-max 1 finds its model unloaded (a switch), the explicit unload and load are timed
apart, and the ratio puts the switch's TTFT over a fresh LLM's ready time."""

from __future__ import annotations

import pytest

from benchmarks import model_switch
from tests.helpers.tiny_gguf_pair import tiny_gguf_pair


def test_switches_on_two_tiny_files(tmp_path, monkeypatch):
    models = tiny_gguf_pair(tmp_path, monkeypatch)
    options = model_switch.SwitchOptions(
        models=models,
        switches=2,
        load_rounds=1,
        split_rounds=1,
        engine={"max_model_len": 128, "kv_cache_memory": "16MiB"},
    )
    result = model_switch.run_model_switch(options)
    assert [s["model"] for s in result["switches"]] == ["model-a", "model-b"]
    assert result["all_were_switches"]
    assert all(s["completion_tokens"] == options.max_tokens for s in result["switches"])
    assert [load["model"] for load in result["fresh_loads"]] == ["tiny-3.gguf", "tiny-4.gguf"]
    (split,) = result["splits"]
    assert split["model"] == "model-a" and split["load_s"] > 0 and split["unload_s"] >= 0
    assert result["switch_over_fresh_load"] == pytest.approx(
        result["switch_ttft_s"] / result["fresh_load_ready_s"], rel=0.01
    )


def test_engine_arguments_become_serve_flags():
    flags = model_switch.engine_flags({"max_model_len": 2048, "kv_cache_memory": "1GiB"})
    assert flags == ["--max-model-len", "2048", "--kv-cache-memory", "1GiB"]


def test_the_models_directory_names_the_files(tmp_path):
    a, b = tmp_path / "x.gguf", tmp_path / "y.gguf"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    folder = tmp_path / "models"
    folder.mkdir()
    model_switch.models_dir(folder, (str(a), str(b)))
    assert sorted(p.name for p in folder.iterdir()) == ["model-a.gguf", "model-b.gguf"]
    assert (folder / "model-b.gguf").read_bytes() == b"b"


def test_the_server_serves_the_directory_one_model_at_a_time(tmp_path):
    server = model_switch.ModelsServer(tmp_path, {"max_model_len": 64}, threads=2)
    command = server.command()
    assert command[command.index("--models-dir") + 1] == str(tmp_path)
    assert command[command.index("--models-max") + 1] == "1"
    assert server.env == {"OMP_NUM_THREADS": "2"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"switches": 0}, "must be >= 1"),
        ({"split_rounds": -1}, "split_rounds must be >= 0"),
        ({"models": ("a.gguf",)}, "two files"),
    ],
)
def test_options_refuse_empty_runs(bad, message):
    with pytest.raises(ValueError, match=message):
        model_switch.SwitchOptions(**bad)
