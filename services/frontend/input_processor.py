"""InputProcessor: prompts (text, token ids) -> validated prompt token ids."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.structured_outputs import check_grammar


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def process(self, prompt, add_special_tokens: bool = True) -> ProcessedPrompt:
        """Accepts a str, {"prompt": str}, {"prompt_token_ids": [...]} or a list of ids.

        Chat prompts pass add_special_tokens=False: their template already has the BOS.
        """
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._check(prompt.get("prompt"), prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.process(prompt["prompt"], add_special_tokens)
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass prompt_token_ids instead.")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            return self._check(prompt, ids)
        if isinstance(prompt, list | tuple):
            return self._check(None, prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt)}.")

    def check_params(self, params) -> None:
        """Token ids in the sampling parameters must exist in this model's vocabulary, and
        a structured-output constraint must compile (ValueError naming the problem)."""
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids or []),
            ("logit_bias", list(params.logit_bias or {})),
        ):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise ValueError(
                    f"{name} contains token id {bad[0]}, outside the vocabulary "
                    f"[0, {self.vocab_size})."
                )

    def _check(self, text: str | None, token_ids) -> ProcessedPrompt:
        ids = list(token_ids)
        if not ids:
            raise ValueError("the prompt is empty: it must contain at least one token.")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be integers.")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids contains {bad[0]}, "
                f"outside the vocabulary [0, {self.vocab_size})."
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than the maximum context length "
                f"max_model_len={self.max_model_len}."
            )
        return ProcessedPrompt(text, ids)
