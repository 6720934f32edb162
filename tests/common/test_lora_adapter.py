"""LoRA's common pieces: inspect_adapter over real PEFT folders made here (accepted ones
give PEFT's rank, scale and targets and a digest of their files; refused ones name the
problem), LoRAConfig and LoRARequest validation, --lora-modules parsing, and block 0's
extra keys (an adapter's blocks can never be spelled by a cache salt, and without an
adapter the hashes are those of before)."""

from __future__ import annotations

import json
import math
import shutil
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagestream.cli import build_parser
from pagestream.cli_flags import role_argv
from pagestream.engine_args import EngineArgs
from services.common.block_hash import first_block_keys, hash_block_tokens, hash_request_tokens
from services.common.convert.capabilities import capabilities_from_pb, capabilities_to_pb
from services.common.flags import from_flags
from services.common.lora_adapter import LoRAAdapterError, inspect_adapter
from services.common.lora_config import TARGET_MODULES, LoRAConfig, LoRATargets
from services.common.lora_request import LoRARequest
from services.common.model_capabilities import ModelCapabilities
from services.frontend.lora_options import LoRAModule, LoRAServerOptions, parse_lora_module

# The tiny llama of tests/helpers/tiny_models.py: hidden 64, 4 heads and 2 KV heads of 16,
# intermediate 96, 2 layers; [in_features, out_features] of each target.
MODULES = {
    "q_proj": [64, 64],
    "k_proj": [64, 32],
    "v_proj": [64, 32],
    "o_proj": [64, 64],
    "gate_proj": [64, 96],
    "up_proj": [64, 96],
    "down_proj": [96, 64],
}
CONFIG = LoRAConfig(max_loras=2, max_lora_rank=16)
TARGETS = LoRATargets(MODULES, 2)  # the base model's linears, as the worker finds them
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.fixture(scope="module")
def base(model_dir):
    return model_dir("llama")


@pytest.fixture(scope="module")
def make(base, tmp_path_factory):
    """make(base=None, folder=None, **save_adapter's arguments) -> a new adapter folder."""
    from tests.helpers.lora_adapters import save_adapter  # torch and peft: only here

    def _make(model=None, folder=None, **kwargs):
        folder = folder or tmp_path_factory.mktemp("adapter")
        return save_adapter(model if model is not None else base, folder, **kwargs)

    return _make


@pytest.fixture(scope="module")
def good(make):
    return make(r=8, lora_alpha=16, target_modules=(*ATTENTION, "down_proj"))


def _copy(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / "copy")


def _refused(path, match: str, targets: LoRATargets = TARGETS) -> str:
    with pytest.raises(LoRAAdapterError, match=match) as err:
        inspect_adapter(str(path), CONFIG, targets)
    assert isinstance(err.value, ValueError)
    return str(err.value)


def _tiny_llama(**changes):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**config, **changes}))


# ---- accepted adapters -------------------------------------------------------------------
def test_the_worker_reads_the_same_target_shapes(base):
    from transformers import AutoConfig

    from services.worker.lora.lora_layout import model_modules

    assert model_modules(AutoConfig.from_pretrained(base)) == MODULES
    assert set(MODULES) == set(TARGET_MODULES)


def test_a_peft_adapter_gives_its_rank_scale_and_targets(good):
    spec = inspect_adapter(str(good), CONFIG, TARGETS)
    assert (spec.rank, spec.scale, spec.path) == (8, 2.0, str(good))
    modules = {*ATTENTION, "down_proj"}
    assert spec.targets == {(layer, m) for layer in (0, 1) for m in modules}
    assert spec.modules == modules
    assert len(spec.digest) == 16 and int(spec.digest, 16) >= 0


@pytest.mark.parametrize(
    ("r", "alpha", "rslora", "scale"),
    [
        (4, 8, False, 2.0),
        (4, 8, True, 4.0),
        (16, 8, False, 0.5),
        (9, 6, True, 2.0),
        (2, 3, False, 1.5),
    ],
)
def test_the_scale_is_peft_s(make, r, alpha, rslora, scale):
    folder = make(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=("v_proj",))
    spec = inspect_adapter(str(folder), CONFIG, TARGETS)
    assert spec.rank == r and math.isclose(spec.scale, scale)
    assert spec.targets == {(0, "v_proj"), (1, "v_proj")}


def test_every_target_at_the_largest_rank(make):
    folder = make(r=16, target_modules=TARGET_MODULES)
    spec = inspect_adapter(str(folder), CONFIG, TARGETS)
    assert spec.rank == 16 and spec.modules == set(TARGET_MODULES)


def test_the_digest_is_of_the_files(make, good, tmp_path):
    again = make(folder=tmp_path / "same", r=8, target_modules=(*ATTENTION, "down_proj"))
    before = inspect_adapter(str(again), CONFIG, TARGETS).digest
    assert before == inspect_adapter(str(good), CONFIG, TARGETS).digest
    # new weights saved over the same folder (a reload under the same path)
    make(folder=again, r=8, target_modules=(*ATTENTION, "down_proj"), seed=1)
    after = inspect_adapter(str(again), CONFIG, TARGETS)
    assert after.digest != before and after.rank == 8
    # the config counts too
    config = json.loads((again / "adapter_config.json").read_text())
    config["lora_alpha"] = 32
    (again / "adapter_config.json").write_text(json.dumps(config))
    changed = inspect_adapter(str(again), CONFIG, TARGETS)
    assert changed.digest != after.digest and changed.scale == 4.0


# ---- refused adapters --------------------------------------------------------------------
def test_a_missing_folder(tmp_path):
    _refused(tmp_path / "nowhere", r"folder '.*nowhere' does not exist")


def test_a_missing_config(good, tmp_path):
    folder = _copy(good, tmp_path)
    (folder / "adapter_config.json").unlink()
    _refused(folder, r"adapter_config\.json is missing \(not a PEFT LoRA folder\)")


def test_missing_safetensors_and_the_bin_hint(good, make, tmp_path):
    folder = _copy(good, tmp_path)
    (folder / "adapter_model.safetensors").unlink()
    message = _refused(folder, r"adapter_model\.safetensors is missing")
    assert "adapter_model.bin" not in message
    pickled = make(r=8, target_modules=("q_proj",), safe_serialization=False)
    assert (pickled / "adapter_model.bin").is_file()
    _refused(
        pickled,
        r"safetensors is missing \(adapter_model\.bin is not read: save it with "
        r"safe_serialization\)",
    )


def test_a_rank_over_max_lora_rank(make):
    folder = make(r=32, lora_alpha=32, target_modules=("q_proj",))
    _refused(folder, r"rank 32 is over max_lora_rank \(16\).*--max-lora-rank")
    # a larger limit takes it
    assert inspect_adapter(str(folder), LoRAConfig(max_lora_rank=32), TARGETS).rank == 32


@pytest.mark.parametrize("module", ["lm_head", "embed_tokens"])
@pytest.mark.parametrize("with_base_layer", [True, False])
def test_embeddings_and_the_lm_head_are_not_served(make, module, with_base_layer):
    # peft saves the base layer's weight beside LoRA weights on embeddings by default
    folder = make(target_modules=("q_proj", module), save_embedding_layers=with_base_layer)
    message = _refused(folder, rf"tensor '[^']*{module}[^']*' is not a LoRA A/B weight")
    assert "(embeddings, the LM head and biases are not served)" in message
    assert ("base_layer" in message) == with_base_layer


def test_a_target_the_model_lacks(good):
    no_down = LoRATargets({k: v for k, v in MODULES.items() if k != "down_proj"}, 2)
    _refused(
        good, r"targets 'down_proj', which the model does not have \(targets: gate_proj, ", no_down
    )


def test_an_adapter_of_another_base(make):
    narrow = make(model=_tiny_llama(hidden_size=32), target_modules=("q_proj",))
    _refused(
        narrow,
        r"q_proj\.lora_A has shape \[8, 32\], the base model needs \[8, 64\] "
        r"\(an adapter of another base model",
    )
    deeper = make(model=_tiny_llama(num_hidden_layers=3), target_modules=("q_proj",))
    _refused(deeper, r"is for layer 2; the model has 2 layers")


def test_a_config_whose_r_is_not_the_tensors(good, tmp_path):
    folder = _copy(good, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["r"] = 4
    (folder / "adapter_config.json").write_text(json.dumps(config))
    _refused(
        folder,
        r"lora_A has shape \[8, (\d+)\], the base model needs \[4, \1\].*another rank than r",
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"use_dora": True}, r"DoRA adapters are not supported \(use_dora = True\)"),
        ({"bias": "lora_only"}, r"bias = 'lora_only'; only adapters without biases are served"),
        ({"bias": "all"}, r"bias = 'all'"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save \(fully trained modules\)"),
        ({"rank_pattern": {"q_proj": 4}}, r"rank_pattern"),
        ({"alpha_pattern": {"q_proj": 4}}, r"alpha_pattern"),
    ],
)
def test_what_peft_can_save_but_the_engine_does_not_apply(make, options, match):
    folder = make(r=8, target_modules=("q_proj", "v_proj"), **options)
    _refused(folder, match)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"peft_type": "IA3"}, r"peft_type is 'IA3'; only LORA adapters are served"),
        ({"r": 0}, r"r must be an integer >= 1, got 0"),
        ({"r": "8"}, r"r must be an integer >= 1, got '8'"),
        ({"lora_alpha": "16"}, r"lora_alpha must be a number, got '16'"),
        ({"fan_in_fan_out": True}, r"fan_in_fan_out"),
    ],
)
def test_a_bad_config_field(good, tmp_path, edit, match):
    folder = _copy(good, tmp_path)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **edit}))
    _refused(folder, match)


def test_unreadable_files(good, tmp_path):
    folder = _copy(good, tmp_path)
    (folder / "adapter_config.json").write_text("{not json")
    _refused(folder, r"adapter_config\.json: not readable JSON")
    (folder / "adapter_config.json").write_text("[1, 2]")
    _refused(folder, r"expected a JSON object")
    shutil.copy(good / "adapter_config.json", folder / "adapter_config.json")
    (folder / "adapter_model.safetensors").write_bytes(b"\x05\x00")
    _refused(folder, r"adapter_model\.safetensors: not a safetensors file")
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    _refused(folder, r"holds no LoRA weights")


# ---- LoRAConfig and LoRARequest ----------------------------------------------------------
def test_lora_config_defaults_and_round_trip():
    config = LoRAConfig()
    assert (config.max_loras, config.max_lora_rank, config.num_cpu_loras) == (1, 16, 1)
    assert LoRAConfig(max_loras=2, max_cpu_loras=5).num_cpu_loras == 5
    capabilities = ModelCapabilities(lora=CONFIG, lora_targets=TARGETS)
    wire = capabilities_from_pb(capabilities_to_pb(capabilities))
    assert wire == capabilities and wire.lora_targets.modules["down_proj"] == (96, 64)
    off = capabilities_from_pb(capabilities_to_pb(ModelCapabilities()))
    assert off.lora is None and off.lora_targets is None and off.runner == "generate"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_loras": 0}, r"max_loras must be an integer >= 1, got 0"),
        ({"max_loras": True}, r"max_loras must be an integer >= 1, got True"),
        ({"max_loras": 1.5}, r"max_loras must be an integer >= 1"),
        ({"max_lora_rank": 0}, r"max_lora_rank must be an integer >= 1, got 0"),
        (
            {"max_loras": 3, "max_cpu_loras": 2},
            r"max_cpu_loras \(2\) must be an integer >= "
            r"max_loras \(3\)",
        ),
    ],
)
def test_lora_config_refuses_bad_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRAConfig(**kwargs)
    with pytest.raises(ValueError, match=match):  # EngineArgs checks them when LoRA is on
        EngineArgs(enable_lora=True, **kwargs)
    assert EngineArgs(**kwargs).lora_config() is None  # and ignores them when it is off


def test_engine_args_give_the_lora_config():
    args = EngineArgs(enable_lora=True, max_loras=3, max_lora_rank=8, max_cpu_loras=4)
    assert args.lora_config() == LoRAConfig(3, 8, 4)
    assert args.model_config().lora == LoRAConfig(3, 8, 4)
    assert EngineArgs().model_config().lora is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lora_name": ""}, r"lora_name must be a non-empty string"),
        ({"lora_int_id": 0}, r"lora_int_id must be an integer >= 1, got 0"),
        ({"lora_int_id": True}, r"lora_int_id must be an integer >= 1, got True"),
        ({"lora_int_id": "1"}, r"lora_int_id must be an integer >= 1, got '1'"),
        ({"lora_path": ""}, r"lora_request 'a': lora_path must name a folder"),
    ],
)
def test_lora_request_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoRARequest(**{"lora_name": "a", "lora_int_id": 1, "lora_path": "/x", **kwargs})


def test_the_identity_tells_reloads_apart():
    lora = LoRARequest("a", 1, "/x", digest="d")
    assert lora.identity == "a#1#d"
    assert LoRARequest("a", 1, "/y", digest="d").identity == lora.identity  # by content
    others = [LoRARequest("a", 2, "/x", digest="d"), LoRARequest("a", 1, "/x", digest="e")]
    assert all(o.identity != lora.identity for o in others)


# ---- --lora-modules ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("entry", "module"),
    [
        ("a=/adapters/a", LoRAModule("a", "/adapters/a")),
        ("  a=/adapters/a ", LoRAModule("a", "/adapters/a")),
        ("a=/p=q", LoRAModule("a", "/p=q")),
        ('{"name": "b", "path": "/b"}', LoRAModule("b", "/b")),
        (
            '{"name": "b", "path": "/b", "base_model_name": "tiny"}',
            LoRAModule("b", "/b", "tiny"),
        ),
    ],
)
def test_parse_lora_module(entry, module):
    assert parse_lora_module(entry) == module


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("a", r"--lora-modules 'a': expected name=path"),
        ("=/p", r"expected name=path"),
        ("a=", r"expected name=path"),
        ("{not json", r"--lora-modules '\{not json': not valid JSON"),
        ('{"name": "a"}', r'give "name" and "path"'),
        ('{"path": "/p"}', r'give "name" and "path"'),
        ('{"name": "a", "path": "/p", "rank": 4}', r"unknown keys: rank"),
    ],
)
def test_parse_lora_module_refuses_bad_forms(entry, match):
    with pytest.raises(ValueError, match=match):
        parse_lora_module(entry)
    with pytest.raises(ValueError, match=match):  # at startup, before anything is served
        LoRAServerOptions(lora_modules=("ok=/p", entry))


def test_lora_flags_parse_and_reach_a_child_role():
    json_entry = '{"name": "b", "path": "/b", "base_model_name": "tiny"}'
    argv = ["--enable-lora", "--max-loras", "2", "--lora-modules", "a=/a", json_entry]
    updates = ["--enable-lora-runtime-updates", "--lora-root", "/r", "--max-runtime-loras", "3"]
    ns = build_parser().parse_args(["serve", "m", *argv, *updates])
    options = from_flags(LoRAServerOptions, ns)
    assert options.modules() == [LoRAModule("a", "/a"), LoRAModule("b", "/b", "tiny")]
    assert options.enable_lora_runtime_updates
    assert (options.lora_root, options.max_runtime_loras) == ("/r", 3)
    assert from_flags(EngineArgs, ns).lora_config() == LoRAConfig(max_loras=2)
    child = role_argv("frontend", "m", options)
    back = build_parser().parse_args([*child[child.index("frontend") :], "--scheduler", "x:1"])
    assert from_flags(LoRAServerOptions, back) == options
    plain = from_flags(LoRAServerOptions, build_parser().parse_args(["serve", "m"]))
    assert plain == LoRAServerOptions() and not plain.enable_lora_runtime_updates


# ---- block 0's extra keys ----------------------------------------------------------------
TOKENS = list(range(40))
IDENTITY = "a#4294967296#0123456789abcdef"


def _salt_only_hashes(token_ids, block_size, cache_salt):
    """hash_request_tokens as it was before adapters: the salt alone in block 0."""
    hashes = []
    for i in range(len(token_ids) // block_size):
        extra = (cache_salt,) if i == 0 and cache_salt else None
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, block, extra))
    return hashes


def test_first_block_keys():
    assert first_block_keys(None, None) == ()
    assert first_block_keys("", None) == ()
    assert first_block_keys("s", None) == ("s",)
    assert first_block_keys(None, IDENTITY) == ("", "lora=" + IDENTITY)
    assert first_block_keys("", IDENTITY) == ("", "lora=" + IDENTITY)
    assert first_block_keys("s", IDENTITY) == ("s", "lora=" + IDENTITY)


@pytest.mark.parametrize("salt", [None, "", "tenant-a", "lora=" + IDENTITY])
def test_without_an_adapter_the_hashes_are_unchanged(salt):
    assert hash_request_tokens(TOKENS, 16, cache_salt=salt) == _salt_only_hashes(TOKENS, 16, salt)
    assert hash_request_tokens(TOKENS, 16, cache_salt=salt, lora_identity=None) == (
        _salt_only_hashes(TOKENS, 16, salt)
    )


def _spelling_salts(identity: str) -> list[str]:
    """Salts that try to spell the adapter's keys: its key alone, both keys joined, and the
    bytes of the two-key encoding after the first key's tag."""
    key = "lora=" + identity
    encoded = struct.pack("<I", 0) + b"s" + struct.pack("<I", len(key)) + key.encode()
    return [key, identity, "" + key, "\x00" + key, encoded.decode("latin-1"), f"('', {key!r})"]


def test_no_salt_spells_an_adapters_blocks():
    with_adapter = hash_request_tokens(TOKENS, 16, lora_identity=IDENTITY)
    for salt in [None, "", *_spelling_salts(IDENTITY)]:
        salted = hash_request_tokens(TOKENS, 16, cache_salt=salt)
        assert not set(salted) & set(with_adapter), salt  # every block, not only block 0
    other = hash_request_tokens(TOKENS, 16, lora_identity=IDENTITY + "x")
    salted_adapter = hash_request_tokens(TOKENS, 16, cache_salt="s", lora_identity=IDENTITY)
    assert len({with_adapter[0], other[0], salted_adapter[0]}) == 3
    # the same adapter and salt: the same blocks (the prefix cache still hits)
    assert hash_request_tokens(TOKENS, 16, lora_identity=IDENTITY) == with_adapter
    # and the known prefix is reused, as without adapters
    known = with_adapter[:1]
    assert hash_request_tokens(TOKENS, 16, known, lora_identity=IDENTITY) == with_adapter


@given(salt=st.text(), other_salt=st.text(), identity=st.text(min_size=1))
def test_no_salt_spells_any_adapters_first_block(salt, other_salt, identity):
    salted = hash_request_tokens(TOKENS, 16, cache_salt=salt)[0]
    adapter = hash_request_tokens(TOKENS, 16, cache_salt=other_salt, lora_identity=identity)[0]
    assert salted != adapter
