"""PoolerConfig: how a pooling runner turns a prompt's hidden states into one vector
(vLLM's `--pooler-config`: `pooling_type` LAST | MEAN | CLS, `normalize`, `dimensions`).

Unset fields come from the model's own files, as sentence-transformers would read them:
`1_Pooling/config.json` (or the folder `modules.json` names) picks the pooling mode, a
`Normalize` module in `modules.json` turns normalization on; with no such files a decoder
model pools its LAST token and normalizes. `config.json`'s `matryoshka_dimensions` (or
`is_matryoshka`) says the model was trained to be truncated. Torch-free: the command line,
the worker (which fills it in), the scheduler and the frontends read it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.common.model_errors import ModelLoadError

# --pooler-config's (vLLM's); MAX and WEIGHTED_MEAN come only from a sentence-transformers
# folder, for an encoder's whole prompts
OPERATOR_POOLING_TYPES = ("LAST", "MEAN", "CLS")
POOLING_TYPES = (*OPERATOR_POOLING_TYPES, "MAX", "WEIGHTED_MEAN")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: str | None = None  # None: the model's own (else LAST)
    normalize: bool | None = None  # None: the model's own (else True)
    dimensions: int | None = None  # default output size (Matryoshka models); None: all
    # Filled by the worker from the model: its hidden size and the sizes it was trained
    # to be truncated to (empty: not a Matryoshka model unless `dimensions` says so).
    hidden_size: int = 0
    matryoshka_dimensions: tuple[int, ...] = field(default_factory=tuple)
    # Filled by the worker: the model attends bidirectionally (an encoder), so a prompt
    # runs whole in one step (never chunked, never from a prefix hit) and its state at
    # any position depends on every token.
    whole_prompt: bool = False
    # Filled by the worker for a cross-encoder: its labels (the pooled vector is their
    # logits; 0: an embedding model) and what turns a logit into a score.
    num_labels: int = 0
    score_activation: str = "identity"
    labels: tuple[str, ...] = field(default_factory=tuple)  # id2label's names, by id
    # config_sentence_transformers.json's named prompts (query / document prefixes), put
    # before a text whose request names one, and the one used when a request names none.
    prompts: Mapping[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # A folder sentence-transformers 6 saved with a "message" modality (its tokenizer has a
    # chat template): a text input is rendered as a user message through the template (a
    # named prompt as the system message before it), as its encode does.
    chat_template_inputs: bool = False

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", str(self.pooling_type).upper())
            if self.pooling_type not in POOLING_TYPES:
                raise ValueError(
                    f"pooler_config.pooling_type must be one of {', '.join(POOLING_TYPES)}; "
                    f"got {self.pooling_type!r}."
                )
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(
                f"pooler_config.normalize must be true or false, got {self.normalize!r}."
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int)
            or isinstance(self.dimensions, bool)
            or self.dimensions < 1
        ):
            raise ValueError(
                f"pooler_config.dimensions must be an integer >= 1, got {self.dimensions!r}."
            )
        object.__setattr__(self, "matryoshka_dimensions", tuple(self.matryoshka_dimensions))
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "prompts", dict(self.prompts))

    @classmethod
    def parse(cls, value: str | Mapping | PoolerConfig | None) -> PoolerConfig:
        """The --pooler-config JSON (or a dict); None: everything from the model."""
        if isinstance(value, PoolerConfig):
            return value
        if value is None or value == "":
            return cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"pooler_config must be JSON: {exc}") from exc
        if not isinstance(value, Mapping):
            raise ValueError(f"pooler_config must be a JSON object, got {value!r}.")
        known = {"pooling_type", "normalize", "dimensions"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"pooler_config: unknown field(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})."
            )
        kind = str(value.get("pooling_type") or "").upper()
        if kind and kind not in OPERATOR_POOLING_TYPES:
            raise ValueError(
                f"pooler_config.pooling_type must be one of {', '.join(OPERATOR_POOLING_TYPES)}; "
                f"got {value['pooling_type']!r}."
            )
        return cls(**value)

    # ---- filled in from the model ---------------------------------------------------
    def resolve(self, folder: Path | None, hf_config: Mapping) -> PoolerConfig:
        """Every field set: the operator's values over the model folder's."""
        pipeline = sentence_transformers_pipeline(folder)
        pooling_type, normalize = pipeline.pooling_type, pipeline.normalize
        hidden = int(hf_config.get("hidden_size") or 0)
        matryoshka = tuple(hf_config.get("matryoshka_dimensions") or ())
        if not matryoshka and hf_config.get("is_matryoshka"):
            matryoshka = (hidden,)
        resolved = replace(
            self,
            pooling_type=self.pooling_type or pooling_type or "LAST",
            normalize=self.normalize if self.normalize is not None else normalize,
            hidden_size=hidden,
            matryoshka_dimensions=matryoshka,
            chat_template_inputs=_message_modality(folder),
            **_named_prompts(folder),
        )
        if resolved.dimensions is not None:
            resolved._check_size(resolved.dimensions, "pooler_config.dimensions")
        return resolved

    def for_classifier(
        self,
        num_labels: int,
        activation: str,
        labels: tuple[str, ...] = (),
        pooling_type: str = "CLS",
    ) -> PoolerConfig:
        """A classifier's (a cross-encoder is one with one label): its first row (or the
        mean of its rows) through its head, logits as they are."""
        return replace(
            self,
            pooling_type=pooling_type,
            normalize=False,
            hidden_size=num_labels,
            num_labels=num_labels,
            score_activation=activation,
            labels=labels or tuple(f"LABEL_{i}" for i in range(num_labels)),
        )

    def score(self, logit: float) -> float:
        """A cross-encoder's score of its first label's logit (score_activation)."""
        return 1.0 / (1.0 + math.exp(-logit)) if self.score_activation == "sigmoid" else logit

    def probabilities(self, logits) -> list[float]:
        """A classifier's label probabilities: a softmax over its labels' logits, a
        sigmoid for one label (what vLLM's classify returns)."""
        values = [float(x) for x in logits]
        if len(values) == 1:
            return [1.0 / (1.0 + math.exp(-values[0]))]
        top = max(values)
        exps = [math.exp(x - top) for x in values]
        total = sum(exps)
        return [e / total for e in exps]

    def prompt_text(self, prompt_name: str | None) -> str:
        """The text put before an input whose request names `prompt_name` (None: the
        folder's default prompt, if any); an unknown name is a ValueError naming it."""
        name = prompt_name if prompt_name is not None else self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(
                f"prompt_name {name!r} is not one of the model's prompts ({known}; from its "
                "config_sentence_transformers.json)."
            )
        return self.prompts[name]

    @property
    def is_matryoshka(self) -> bool:
        return bool(self.matryoshka_dimensions) or self.dimensions is not None

    def check_dimensions(self, dimensions: int, name: str = "dimensions") -> None:
        """A request's truncation size the model supports (ValueError naming `name`)."""
        self._check_size(dimensions, name)
        if not self.is_matryoshka:
            raise ValueError(
                f"{name}: this model was not trained for Matryoshka truncation (its config "
                "names no matryoshka_dimensions); start it with --pooler-config "
                "'{\"dimensions\": N}' if it was."
            )

    def _check_size(self, dimensions: int, name: str) -> None:
        """Within the hidden size, and one of the model's Matryoshka sizes if it names any."""
        if dimensions < 1 or (self.hidden_size and dimensions > self.hidden_size):
            raise ValueError(
                f"{name} must be between 1 and the model's hidden size {self.hidden_size}, "
                f"got {dimensions}."
            )
        sizes = self.matryoshka_dimensions
        if sizes and sizes != (self.hidden_size,) and dimensions not in sizes:
            raise ValueError(
                f"{name} must be one of the model's matryoshka_dimensions "
                f"{list(sizes)}, got {dimensions}."
            )


@dataclass(frozen=True)
class SentenceTransformersPipeline:
    """What a sentence-transformers folder's modules.json says to do after the model: the
    pooling mode, the Dense layers' folders (in order) and whether it normalizes."""

    pooling_type: str | None = None
    dense_dirs: tuple[str, ...] = ()
    normalize: bool = True  # without a folder: normalized (what retrieval expects)

    @property
    def needs_whole_prompts(self) -> bool:
        """Pooling no chunked prefill can add up part by part (MAX, WEIGHTED_MEAN) or Dense
        layers after it: only an encoder (its prompts run whole) runs these."""
        return bool(self.dense_dirs) or self.pooling_type in ("MAX", "WEIGHTED_MEAN")


# sentence-transformers 6's 1_Pooling `pooling_mode` values -> our pooling types
_ST_MODE_NAMES = {
    "lasttoken": "LAST",
    "mean": "MEAN",
    "cls": "CLS",
    "max": "MAX",
    "weightedmean": "WEIGHTED_MEAN",
}


def sentence_transformers_pipeline(folder: Path | None) -> SentenceTransformersPipeline:
    """The folder's pipeline; a module or pooling mode it does not run is refused by name
    (ModelLoadError), never skipped."""
    if folder is None:
        return SentenceTransformersPipeline()
    modules_file = folder / "modules.json"
    pooling_dir, normalize, dense = folder / "1_Pooling", True, []
    if modules_file.is_file():
        try:
            modules = json.loads(modules_file.read_text())
        except (OSError, json.JSONDecodeError):
            modules = []
        kinds = [
            (str(m.get("type", "")).rsplit(".", 1)[-1], m) for m in modules if isinstance(m, dict)
        ]
        unknown = sorted({k for k, _ in kinds} - {"Transformer", "Pooling", "Dense", "Normalize"})
        if unknown:
            raise ModelLoadError(
                f"{modules_file}: sentence-transformers module(s) {', '.join(unknown)} are "
                "not supported (Transformer, Pooling, Dense and Normalize are)"
            )
        normalize = any(k == "Normalize" for k, _ in kinds)
        dense = [str(m.get("path", "")) for k, m in kinds if k == "Dense"]
        pooling_dir = next(
            (folder / str(m.get("path", "1_Pooling")) for k, m in kinds if k == "Pooling"),
            pooling_dir,
        )
    return SentenceTransformersPipeline(_pooling_mode(pooling_dir), tuple(dense), normalize)


def _message_modality(folder: Path | None) -> bool:
    """Whether sentence_bert_config.json's modality_config names the "message" modality."""
    path = None if folder is None else folder / "sentence_bert_config.json"
    try:
        config = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return False
    modalities = config.get("modality_config") if isinstance(config, dict) else None
    return isinstance(modalities, dict) and "message" in modalities


def _named_prompts(folder: Path | None) -> dict:
    """config_sentence_transformers.json's `prompts` and `default_prompt_name` (empty:
    the folder has none)."""
    path = None if folder is None else folder / "config_sentence_transformers.json"
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ModelLoadError(f"{path}: prompts must map names to strings")
    default = config.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ModelLoadError(f"{path}: default_prompt_name {default!r} names no prompt")
    return {"prompts": prompts, "default_prompt_name": default}


def _pooling_mode(pooling_dir: Path) -> str | None:
    """1_Pooling/config.json's mode: sentence-transformers 6's `pooling_mode` string or the
    older `pooling_mode_*` flags (None: no such file)."""
    config_file = pooling_dir / "config.json"
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if config.get("include_prompt") is False:
        raise ModelLoadError(f"{config_file}: include_prompt false is not supported")
    if "pooling_mode" in config:
        modes = [str(config["pooling_mode"])]
    else:
        modes = [
            key.removeprefix("pooling_mode_")
            for key, on in config.items()
            if on and key.startswith("pooling_mode_")
        ]
        modes = [m.removesuffix("_tokens").removesuffix("_token") for m in modes]
    unsupported = [m for m in modes if m not in _ST_MODE_NAMES]
    if unsupported or len(modes) > 1:
        raise ModelLoadError(
            f"{config_file}: pooling mode {' + '.join(modes)} is not supported (one of "
            f"{', '.join(_ST_MODE_NAMES)})"
        )
    return _ST_MODE_NAMES[modes[0]] if modes else None
