"""PoolerConfig: vLLM's --pooler-config JSON checked by name, filled in from the model's
sentence-transformers files and config; PoolingParams' truncation and normalization."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.common.pooler_config import PoolerConfig
from services.common.pooling_params import PoolingParams


def test_parse_accepts_vllm_json_and_refuses_by_name():
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig(
        pooling_type="MEAN", normalize=False
    )
    assert PoolerConfig.parse(None) == PoolerConfig()
    for bad, words in [
        ('{"pooling_type": "MAX"}', "pooling_type"),
        ('{"normalize": "yes"}', "normalize"),
        ('{"dimensions": 0}', "dimensions"),
        ('{"pool": 1}', "unknown field"),
        ("[1]", "JSON object"),
        ("{", "JSON"),
    ]:
        with pytest.raises(ValueError, match=words):
            PoolerConfig.parse(bad)


def _st_folder(tmp_path, modules, pooling):
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_resolve_reads_sentence_transformers_files(tmp_path):
    modules = [
        {"path": "", "type": "sentence_transformers.models.Transformer"},
        {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    folder = _st_folder(tmp_path, modules, {"pooling_mode_cls_token": True})
    resolved = PoolerConfig().resolve(folder, {"hidden_size": 32})
    assert (resolved.pooling_type, resolved.normalize, resolved.hidden_size) == ("CLS", True, 32)
    # the operator's values win
    mine = PoolerConfig(pooling_type="LAST", normalize=False).resolve(folder, {"hidden_size": 32})
    assert (mine.pooling_type, mine.normalize) == ("LAST", False)


def test_resolve_without_files_is_last_and_normalized(tmp_path):
    resolved = PoolerConfig().resolve(tmp_path, {"hidden_size": 16})
    assert (resolved.pooling_type, resolved.normalize, resolved.is_matryoshka) == (
        "LAST",
        True,
        False,
    )


def test_matryoshka_dimensions_are_checked():
    pooler = PoolerConfig(pooling_type="LAST", normalize=True).resolve(
        None, {"hidden_size": 64, "matryoshka_dimensions": [16, 32, 64]}
    )
    pooler.check_dimensions(32)
    for bad, words in [(20, "matryoshka_dimensions"), (128, "hidden size"), (0, "between")]:
        with pytest.raises(ValueError, match=words):
            pooler.check_dimensions(bad)
    plain = PoolerConfig(pooling_type="LAST", normalize=True).resolve(None, {"hidden_size": 64})
    with pytest.raises(ValueError, match="Matryoshka"):
        plain.check_dimensions(16)
    # an operator who says the model is Matryoshka (a default dimensions) may truncate
    said = PoolerConfig(dimensions=32).resolve(None, {"hidden_size": 64})
    said.check_dimensions(16)


def test_finish_truncates_then_normalizes():
    pooler = PoolerConfig(pooling_type="LAST", normalize=True, hidden_size=4, dimensions=None)
    state = np.array([3.0, 4.0, 12.0, 0.0], np.float32)
    np.testing.assert_allclose(PoolingParams().finish(state, pooler), state / 13.0, rtol=1e-6)
    np.testing.assert_allclose(
        PoolingParams(dimensions=2).finish(state, pooler), [0.6, 0.8], rtol=1e-6
    )
    np.testing.assert_array_equal(PoolingParams(normalize=False).finish(state, pooler), state)
    np.testing.assert_array_equal(PoolingParams(task="encode").finish(state, pooler), state)
    with pytest.raises(ValueError, match="raw pooled state"):
        PoolingParams(task="encode", dimensions=2)
    with pytest.raises(ValueError, match="task"):
        PoolingParams(task="classify")
