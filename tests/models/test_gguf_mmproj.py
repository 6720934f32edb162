"""llama.cpp's file pair (a text GGUF plus its `--mmproj` vision projector GGUF) against the HF
folder it was written from (tests/helpers/mmproj_writer.py): the projector's tensors read
back exactly, the converted VLM folder's processor and greedy tokens equal HF's on the
original folder (float32), and hostile projector files are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from services.common.gguf_conversion import TEXT_GGUF_FILE, ensure_converted, text_gguf_of
from services.common.gguf_mmproj import read_mmproj
from services.common.model_errors import ModelLoadError
from services.worker.models.gguf_weights import dequantized_folder
from tests.helpers.mmproj_writer import write_pair
from tests.helpers.model_cache import isolated_model_cache
from tests.helpers.tiny_vlms import FAMILIES, build_tiny_vlm, random_image

# llama.cpp's projector families: the two tiny_vlms.FAMILIES and Gemma 3
PAIR_FAMILIES = (*FAMILIES, "gemma3")
QUESTION = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vlms")
    return {family: build_tiny_vlm(family, root / family, seed=7) for family in PAIR_FAMILIES}


@pytest.fixture(scope="module")
def pairs(folders, tmp_path_factory) -> dict[str, tuple[Path, Path, dict]]:
    """Each family's pair, the projector in F32."""
    out = {}
    for family, folder in folders.items():
        where = tmp_path_factory.mktemp(f"pair-{family}")
        out[family] = write_pair(folder, where)
    return out


def _hf(folder: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()


# -- the projector's tensors ----------------------------------------------------------------


@pytest.mark.parametrize("family", PAIR_FAMILIES)
def test_tensors_read_back_equal_the_hf_folders(family, folders, pairs):
    """F32: every tensor the file holds is the HF model's, bit for bit; what it lacks is
    what llama.cpp's converter drops (LLaVA: the block past the feature layer and the
    post-layernorm, which the features never pass through: read back as the identity)."""
    _, mmproj, _ = pairs[family]
    tensors = read_mmproj(mmproj).tensors
    reference = _hf(folders[family]).state_dict()
    for name, tensor in tensors.items():
        if name.startswith("model.vision_tower.post_layernorm"):
            assert torch.equal(tensor, torch.ones_like(tensor) * name.endswith("weight"))
            continue
        assert torch.equal(tensor, reference[name]), name
    vision = [
        n
        for n in reference
        if n.startswith(("model.vision", "model.multi_modal", "model.connector"))
    ]
    left_out = sorted(set(vision) - set(tensors))
    if family == "llava":
        assert left_out and all(
            n.startswith("model.vision_tower.encoder.layers.1.") for n in left_out
        )
    else:
        assert left_out == []


@pytest.mark.parametrize("matrix_type", ["F16", "BF16", "Q8_0"])
def test_block_and_half_formats_decode_to_what_the_file_holds(matrix_type, folders, tmp_path):
    _, mmproj, expected = write_pair(folders["idefics3"], tmp_path, matrix_type)
    tensors = read_mmproj(mmproj).tensors
    assert set(expected) == set(tensors)
    changed = 0
    for name, values in expected.items():
        assert torch.equal(tensors[name], values), name
        changed += values.dtype == torch.float32 and values.ndim == 2 and "embedding" not in name
    assert changed  # the matrices really went through the format


def test_facts_come_from_the_keys(pairs):
    facts = read_mmproj(pairs["idefics3"][1]).facts
    assert (facts.projector, facts.image_size, facts.patch_size, facts.scale_factor) == (
        "idefics3",
        32,
        8,
        2,
    )
    assert (facts.longest_edge, facts.layer_norm_eps, facts.image_mean) == (64, 1e-6, (0.5,) * 3)
    llava = read_mmproj(pairs["llava"][1]).facts
    assert (llava.num_layers, llava.use_gelu, llava.layer_norm_eps) == (1, False, 1e-5)


# -- the pair's VLM folder against HF ----------------------------------------------------------


@pytest.mark.parametrize("family", PAIR_FAMILIES)
def test_pair_folder_runs_as_the_hf_folder(family, folders, pairs, tmp_path, monkeypatch):
    """The converted folder's processor gives the same ids and pixels, and HF's own model
    class on it (its text weights de-quantized from the text GGUF: dequantized_folder) the
    same logits and greedy tokens, as on the original folder. Gemma 3's text GGUF is read
    by transformers' Gemma (SentencePiece) tokenizer, which splits this byte-level
    vocabulary's text otherwise: the same ids (the file's vocabulary is the folder's, id
    for id) and pixels then go to both models, token_type_ids included."""
    from transformers import AutoProcessor

    isolated_model_cache(tmp_path / "cache", monkeypatch)
    text, mmproj, _ = pairs[family]
    converted = ensure_converted(text, tmp_path / "vlm", mmproj)
    inputs = []
    for folder in (folders[family], converted):
        processor = AutoProcessor.from_pretrained(folder)
        prompt = processor.apply_chat_template(QUESTION, add_generation_prompt=True)
        inputs.append(processor(text=prompt, images=[random_image(3)], return_tensors="pt"))
    reference, got = inputs
    assert set(reference) == set(got)
    for key in reference:
        if family != "gemma3" or key == "pixel_values":
            assert torch.equal(reference[key], got[key]), key
    if family == "gemma3":
        assert got["token_type_ids"].sum() == 4  # the image's soft tokens, found whole
        reference = got
    ref_model, pair_model = _hf(folders[family]), _hf(dequantized_folder(converted))
    with torch.no_grad():
        assert torch.equal(ref_model(**reference).logits, pair_model(**got).logits)
        want = ref_model.generate(**reference, max_new_tokens=6, do_sample=False)
        have = pair_model.generate(**got, max_new_tokens=6, do_sample=False)
    assert want.tolist() == have.tolist()


def test_engine_args_stand_the_pair_for_its_folder(pairs, tmp_path, monkeypatch):
    """--mmproj turns the pair into its cached VLM folder, once; the roles see that folder."""
    from pagestream.engine_args import EngineArgs

    isolated_model_cache(tmp_path / "cache", monkeypatch)
    text, mmproj, _ = pairs["llava"]
    args = EngineArgs(model=str(text), mmproj=str(mmproj))
    folder = Path(args.model)
    assert args.mmproj is None and (folder / "config.json").is_file()
    assert args.served_model_name == str(text)  # what clients name, not the cache folder
    assert folder.parent == tmp_path / "cache" / "models"
    assert EngineArgs(model=str(text), mmproj=str(mmproj)).model == args.model


# -- hostile files ---------------------------------------------------------------------------


def rewrite(source: Path, target: Path, keys=None, drop=(), tensors=None) -> Path:
    """`source` written again with `keys` set (None: removed), the tensors in `drop` left
    out and those in `tensors` replaced (F32 arrays)."""
    keys, tensors = keys or {}, tensors or {}
    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(target), "clip")
    for field in reader.fields.values():
        if (
            field.name.startswith("GGUF.")
            or field.name in keys
            or field.name == "general.architecture"
        ):
            continue  # the header's own fields, those replaced, the writer's own
        sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    for key, value in keys.items():
        if value is not None:  # (value type, value[, array item type])
            writer.add_key_value(key, value[1], value[0], sub_type=(value[2:] or (None,))[0])
    for t in reader.tensors:  # the F32 pair's: each array as it is
        if t.name not in drop:
            writer.add_tensor(t.name, tensors.get(t.name, np.asarray(t.data)))
    for name in set(tensors) - {t.name for t in reader.tensors}:
        writer.add_tensor(name, tensors[name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


U32, F32, STRING, ARRAY = (
    GGUFValueType.UINT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.STRING,
    GGUFValueType.ARRAY,
)
HOSTILE = {
    "other projector": ({"clip.projector_type": (STRING, "qwen2vl_merger")}, (), "qwen2vl_merger"),
    "no image size": ({"clip.vision.image_size": None}, (), "clip.vision.image_size is missing"),
    "zero patch": ({"clip.vision.patch_size": (U32, 0)}, (), "clip.vision.patch_size is 0"),
    "huge image": ({"clip.vision.image_size": (U32, 1 << 30)}, (), "clip.vision.image_size"),
    "patch not dividing": ({"clip.vision.patch_size": (U32, 7)}, (), "whole patches"),
    "heads not dividing": ({"clip.vision.attention.head_count": (U32, 5)}, (), "whole heads"),
    "too many blocks": ({"clip.vision.block_count": (U32, 3)}, (), "'v.blk.1.attn_q.weight'"),
    "width disagrees": ({"clip.vision.embedding_length": (U32, 16)}, (), "has shape"),
    "short mean": ({"clip.vision.image_mean": (ARRAY, [0.5, 0.5], F32)}, (), "image_mean holds 2"),
    "zero std": ({"clip.vision.image_std": (ARRAY, [0.5, 0.0, 0.5], F32)}, (), "std > 0"),
    "bad eps": ({"clip.vision.attention.layer_norm_epsilon": (F32, -1.0)}, (), "epsilon"),
    "pinpoints": ({"clip.vision.image_grid_pinpoints": (ARRAY, [32, 64], U32)}, (), "any-res"),
    "two feature layers": (
        {"clip.vision.feature_layer": (ARRAY, [1, 2], U32)},
        (),
        "feature_layer",
    ),
    "missing tensor": ({}, ("v.blk.0.ln2.bias",), "'v.blk.0.ln2.bias'"),
    "missing projector": ({}, ("mm.0.weight",), "first matrix (mm.0.weight"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_mmproj_is_refused_by_name(case, pairs, tmp_path):
    keys, drop, message = HOSTILE[case]
    bad = rewrite(pairs["llava"][1], tmp_path / "bad.gguf", keys=keys, drop=drop)
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace("'", ".")):
        read_mmproj(bad)


def test_unknown_and_misshapen_tensors_are_refused(pairs, tmp_path):
    source = pairs["idefics3"][1]
    extra = rewrite(source, tmp_path / "extra.gguf", tensors={"v.mystery": np.ones(4, np.float32)})
    with pytest.raises(ModelLoadError, match=r"does not have: v\.mystery"):
        read_mmproj(extra)
    shape = {"mm.model.fc.weight": np.ones((64, 64), np.float32)}
    misshapen = rewrite(source, tmp_path / "shape.gguf", tensors=shape)
    with pytest.raises(ModelLoadError, match=r"'mm.model.fc.weight' has shape \[64, 64\]"):
        read_mmproj(misshapen)


def test_truncated_and_text_files_are_refused(pairs, tmp_path):
    text, mmproj, _ = pairs["llava"]
    with pytest.raises(ModelLoadError, match="not 'clip'"):
        read_mmproj(text)
    raw = mmproj.read_bytes()
    for cut in (8, 100, len(raw) // 2, len(raw) - 1):
        (tmp_path / "cut.gguf").write_bytes(raw[:cut])
        with pytest.raises(ModelLoadError):
            read_mmproj(tmp_path / "cut.gguf")


def test_a_pair_that_does_not_fit_is_refused(folders, pairs, tmp_path, monkeypatch):
    """The projector's width must be the text model's, the vocabulary must hold the image
    token, and --mmproj goes with a GGUF text model only."""
    from services.common.model_source import resolve_pair

    isolated_model_cache(tmp_path / "cache", monkeypatch)
    with pytest.raises(ModelLoadError, match="projects into width 32"):
        wide = {
            "mm.model.fc.weight": np.ones((32, 128), np.float32),
        }
        ensure_converted(
            pairs["idefics3"][0],
            tmp_path / "a",
            rewrite(pairs["idefics3"][1], tmp_path / "w.gguf", tensors=wide),
        )
    # the Idefics3 projector beside the LLaVA text model: its vocabulary lacks the tile tokens
    with pytest.raises(ModelLoadError, match="no <fake_token_around_image>"):
        ensure_converted(pairs["llava"][0], tmp_path / "b", pairs["idefics3"][1])
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_pair(folders["llava"], pairs["llava"][1])
    with pytest.raises(ModelLoadError, match=r"is llama\.cpp's vision projector"):
        ensure_converted(pairs["llava"][1], tmp_path / "c")
    with pytest.raises(ModelLoadError, match="no such file"):
        resolve_pair(pairs["llava"][0], tmp_path / "absent.gguf")


def test_older_llava_files_still_read(pairs, tmp_path):
    """The oldest LLaVA files name no projector type (only clip.has_llava_projector); newer
    ones may name the feature layer, which must be the file's last block."""
    keys = {
        "clip.projector_type": None,
        "clip.has_llava_projector": (GGUFValueType.BOOL, True),
        "clip.vision.feature_layer": (ARRAY, [1], U32),
    }
    old = rewrite(pairs["llava"][1], tmp_path / "old.gguf", keys=keys)
    assert read_mmproj(old).facts.projector == "mlp"


@pytest.mark.parametrize("family", PAIR_FAMILIES)
def test_mutated_files_read_or_are_refused_never_crash(family, pairs, tmp_path):
    """Random bytes of the header and tensor table overwritten: the file reads, or is a
    ModelLoadError (gguf's own reader, which decodes the arrays GGUFFile skips, decodes
    strings strictly: its errors are ModelLoadErrors too)."""
    source = pairs[family][1].read_bytes()
    rng = np.random.default_rng(5)
    refused = 0
    for _ in range(60):
        mutated = bytearray(source)
        for at in rng.integers(0, 3000, rng.integers(1, 5)):
            mutated[at] = int(rng.integers(0, 256))
        (tmp_path / "m.gguf").write_bytes(bytes(mutated))
        try:
            read_mmproj(tmp_path / "m.gguf")
        except ModelLoadError:
            refused += 1
    assert refused > 30  # the mutations did reach the fields that are checked


def test_the_folder_leaves_the_text_weights_in_the_text_gguf(folders, tmp_path, monkeypatch):
    """The pair's folder holds the vision weights only (as the mmproj holds them) and names
    its text GGUF; dequantized_folder adds the text weights as the GGUF (here Q8_0)
    de-quantizes them, under the VLM's names."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from tests.helpers.mmproj_writer import write_text_gguf

    isolated_model_cache(tmp_path / "cache", monkeypatch)
    folder = folders["idefics3"]
    text, mmproj, vision = write_pair(folder, tmp_path, text_type="Q8_0")
    converted = ensure_converted(text, tmp_path / "vlm", mmproj)
    saved = load_file(converted / "model.safetensors")
    assert saved and not any(n.startswith(("model.text_model.", "lm_head.")) for n in saved)
    record = json.loads((converted / TEXT_GGUF_FILE).read_text())
    assert record == {"path": str(text.resolve()), "size": text.stat().st_size}
    assert text_gguf_of(converted) == text.resolve()
    model = _hf(folder)  # what the text GGUF de-quantizes to: its writer's (deterministic) values
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = write_text_gguf(tmp_path / "again.gguf", model, tokenizer, "Q8_0")
    loaded = _hf(dequantized_folder(converted)).state_dict()
    for name, values in expected.items():
        hf_name = name.replace("model.", "model.text_model.", 1)
        assert torch.equal(loaded[hf_name], torch.as_tensor(values)), hf_name
    for name, values in vision.items():
        assert torch.equal(loaded[name], values), name
    assert all(t.dtype == torch.float32 for t in saved.values())
    q = "model.text_model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(loaded[q], model.state_dict()[q])  # really went through Q8_0


def test_a_changed_text_gguf_is_refused_by_name(pairs, tmp_path, monkeypatch):
    """The folder reads its text weights from the file it was converted from: that file
    gone, or another in its place, is a ModelLoadError saying to convert again."""
    import shutil

    isolated_model_cache(tmp_path / "cache", monkeypatch)
    source, mmproj, _ = pairs["llava"]
    text = shutil.copy(source, tmp_path / "text.gguf")
    converted = ensure_converted(text, tmp_path / "vlm", mmproj)
    assert text_gguf_of(converted) == text.resolve()
    with text.open("ab") as grown:
        grown.write(b"\0" * 32)
    with pytest.raises(ModelLoadError, match="missing or has changed"):
        text_gguf_of(converted)
    text.unlink()
    with pytest.raises(ModelLoadError, match="missing or has changed"):
        text_gguf_of(converted)
