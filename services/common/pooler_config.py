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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from services.common.model_errors import ModelLoadError

POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' 1_Pooling/config.json keys -> our pooling types
_ST_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}


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
        return cls(**value)

    # ---- filled in from the model ---------------------------------------------------
    def resolve(self, folder: Path | None, hf_config: Mapping) -> PoolerConfig:
        """Every field set: the operator's values over the model folder's."""
        pooling_type, normalize = _sentence_transformers(folder)
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
        )
        if resolved.dimensions is not None:
            resolved._check_size(resolved.dimensions, "pooler_config.dimensions")
        return resolved

    def for_classifier(self, num_labels: int, activation: str) -> PoolerConfig:
        """A cross-encoder's: its first row through its head, logits as they are."""
        return replace(
            self,
            pooling_type="CLS",
            normalize=False,
            hidden_size=num_labels,
            num_labels=num_labels,
            score_activation=activation,
        )

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

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PoolerConfig | None:
        """ "" means the engine does not pool (the generate runner)."""
        if not text:
            return None
        values = json.loads(text)
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


def _sentence_transformers(folder: Path | None) -> tuple[str | None, bool]:
    """(pooling type, normalize) from a sentence-transformers folder; (None, True)
    without one (normalized embeddings are what retrieval expects). A module or pooling
    mode the pipeline does not run is refused by name (ModelLoadError), never skipped."""
    if folder is None:
        return None, True
    modules_file = folder / "modules.json"
    pooling_dir, normalize = folder / "1_Pooling", True
    if modules_file.is_file():
        try:
            modules = json.loads(modules_file.read_text())
        except (OSError, json.JSONDecodeError):
            modules = []
        kinds = {
            str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)
        }
        normalize = "Normalize" in kinds
        unknown = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
        if unknown:
            raise ModelLoadError(
                f"{modules_file}: sentence-transformers module(s) {', '.join(unknown)} are "
                "not supported (Transformer, Pooling and Normalize are)"
            )
        if "Pooling" in kinds:
            pooling_dir = folder / str(kinds["Pooling"].get("path", "1_Pooling"))
    config_file = pooling_dir / "config.json"
    if not config_file.is_file():
        return None, normalize
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError):
        return None, normalize
    modes = [key for key, value in config.items() if key.startswith("pooling_mode_") and value]
    unsupported = [key for key in modes if key not in _ST_MODES]
    if unsupported or config.get("include_prompt") is False:
        what = ", ".join(unsupported) or "include_prompt false"
        raise ModelLoadError(f"{config_file}: {what} is not supported (lasttoken, mean, cls are)")
    for key, pooling_type in _ST_MODES.items():
        if config.get(key):
            return pooling_type, normalize
    return None, normalize
