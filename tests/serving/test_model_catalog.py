"""What a models directory and a preset file name (pagestream/models/model_catalog.py), and
the layouts `serve --models-dir` refuses: no model loads here."""

from __future__ import annotations

import json

import pytest

from pagestream.cli import build_parser
from pagestream.models.model_catalog import build_specs, scan_models_dir
from pagestream.models.models_config import ModelsConfig
from pagestream.models.models_serve import check_models_serve
from services.common.flags import from_flags


def _ns(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def _specs(*argv: str):
    ns = _ns(*argv)
    return build_specs(ns, from_flags(ModelsConfig, ns))


@pytest.fixture
def models(tmp_path):
    """chat/ (HF folder), coder.gguf, vlm.gguf + mmproj-vlm.gguf, pair/ (one GGUF + its
    projector), two/ (two GGUFs: not a model), notes.txt and .hidden/."""
    (tmp_path / "chat").mkdir()
    (tmp_path / "chat" / "config.json").write_text("{}")
    (tmp_path / "chat" / "model.safetensors").write_bytes(b"x" * 100)
    for name in ("coder.gguf", "vlm.gguf", "mmproj-vlm.gguf", "notes.txt"):
        (tmp_path / name).write_bytes(b"GGUF")
    for folder, files in {
        "pair": ("m.gguf", "mmproj-f16.gguf"),
        "two": ("a.gguf", "b.gguf"),
    }.items():
        (tmp_path / folder).mkdir()
        for name in files:
            (tmp_path / folder / name).write_bytes(b"GGUF")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "config.json").write_text("{}")
    return tmp_path


def test_a_models_dir_names_folders_files_and_pairs(models):
    found = scan_models_dir(models)
    assert sorted(found) == ["chat", "coder", "pair", "vlm"]
    assert found["chat"] == {"model": str(models / "chat")}
    assert found["coder"] == {"model": str(models / "coder.gguf")}
    assert found["vlm"] == {
        "model": str(models / "vlm.gguf"),
        "mmproj": str(models / "mmproj-vlm.gguf"),
    }
    assert found["pair"]["mmproj"] == str(models / "pair" / "mmproj-f16.gguf")


def test_specs_take_serves_engine_flags_and_name_themselves(models):
    specs = _specs("--models-dir", str(models), "--dtype", "float32", "--max-model-len", "64")
    assert [s.name for s in specs] == ["chat", "coder", "pair", "vlm"]  # the first: default
    assert all(s.args.dtype == "float32" and s.args.max_model_len == 64 for s in specs)
    assert all(s.args.served_model_name == s.name and not s.pinned for s in specs)
    vlm = next(s for s in specs if s.name == "vlm")
    assert vlm.mmproj == str(models / "mmproj-vlm.gguf") and vlm.args.mmproj is None


def test_a_preset_adjusts_entries_adds_models_and_comes_first(models, tmp_path_factory):
    preset = tmp_path_factory.mktemp("preset") / "models.toml"
    preset.write_text(
        f"[coder]\nmax-model-len = 128\npinned = true\nenable_prefix_caching = false\n\n"
        f'[extra]\nmodel = "{models / "chat"}"\nkv_cache_memory = "64MiB"\n'
    )
    specs = _specs("--models-dir", str(models), "--models-preset", str(preset))
    by_name = {s.name: s for s in specs}
    assert [s.name for s in specs][:2] == ["coder", "extra"]
    assert by_name["coder"].pinned and by_name["coder"].args.max_model_len == 128
    assert by_name["coder"].args.enable_prefix_caching is False
    assert by_name["coder"].args.model == str(models / "coder.gguf")
    assert by_name["extra"].args.kv_cache_memory == "64MiB"
    assert by_name["chat"].args.max_model_len is None  # the others keep serve's flags


def test_a_json_preset_and_a_model_positional_that_is_pinned_and_default(models, tmp_path):
    preset = tmp_path / "p.json"
    preset.write_text(json.dumps({"small": {"model": "chat", "dtype": "float32"}}))
    specs = _specs(str(models / "coder.gguf"), "--models-preset", str(preset))
    assert [(s.name, s.pinned) for s in specs] == [("coder", True), ("small", False)]
    assert specs[1].args.model == str(tmp_path / "chat")  # relative to the preset


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('[a]\nmodel = "x"\nfrobnicate = 1\n', "unknown keys frobnicate"),
        ('[a]\nmodel = "x"\nmax_model_len = "lots"\n', "model 'a': argument --max-model-len"),
        ('[a]\nmodel = "x"\ndtype = "float8"\n', "invalid choice"),
        ('[a]\nmodel = "x"\npinned = "yes"\n', "pinned must be true or false"),
        ('[a]\ndtype = "float32"\n', "no `model` path"),
        ('["bad/name"]\nmodel = "x"\n', "model name 'bad/name'"),
        ('[a]\nmodel = "x"\nserved_model_name = "b"\n', "unknown keys served_model_name"),
        ("[a\n", "models.toml"),
    ],
)
def test_bad_preset_entries_are_refused_by_name(tmp_path, table, message):
    preset = tmp_path / "models.toml"
    preset.write_text(table)
    with pytest.raises(ValueError, match=message):
        _specs("--models-preset", str(preset))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--single-process"], "--single-process serves one model"),
        (["--split-services"], "--split-services serves one model"),
        (["-dp", "2"], "--data-parallel-size serves one model"),
        (["--port", "-1"], "--port"),
        (["--models-max", "-1"], "--models-max must be >= 0"),
        (["--models-memory", "lots"], "models_memory must be a byte count"),
    ],
)
def test_layouts_that_serve_one_model_are_refused(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        check_models_serve(_ns("--models-dir", str(tmp_path), *argv))


def test_an_empty_or_missing_dir_is_refused(tmp_path):
    with pytest.raises(ValueError, match="name no models"):
        _specs("--models-dir", str(tmp_path))
    with pytest.raises(ValueError, match="not a directory"):
        _specs("--models-dir", str(tmp_path / "nope"))


def test_serve_without_models_flags_keeps_its_default_model():
    assert _ns().model is None  # cli.main fills in DEFAULT_MODEL for the one-model serve
    assert not from_flags(ModelsConfig, _ns()).enabled
