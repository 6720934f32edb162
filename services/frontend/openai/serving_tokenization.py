"""POST /tokenize and /detokenize in vLLM's shapes."""

from __future__ import annotations

from services.frontend.multimodal.image_prompt import image_prompt_ids
from services.frontend.openai.chat_rendering import render_chat_images
from services.frontend.openai.exceptions import InvalidRequestError
from services.frontend.openai.protocol import DetokenizeRequest, TokenizeRequest
from services.frontend.openai.replies import DetokenizeResponse, TokenizeResponse
from services.frontend.openai.serving_base import ServingBase
from services.frontend.openai.serving_chat import message_text


class OpenAIServingTokenization(ServingBase):
    default_chat_template: str | None = None  # the server's --chat-template

    def _tokenizer(self, param: str):
        tokenizer = self.frontend.tokenizer
        if tokenizer is None:
            raise InvalidRequestError("this model was loaded without a tokenizer.", param)
        return tokenizer

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        request.check()
        tokenizer = self._tokenizer("prompt")
        if request.messages is not None:
            self.limits.check_messages([message_text(m) for m in request.messages])
            text, images = await render_chat_images(
                self.frontend,
                request.messages,
                request.add_generation_prompt,
                request.chat_template,
                self.default_chat_template,
            )
            add_special = bool(request.add_special_tokens)  # the template has the BOS
        else:
            text, images = request.prompt, []
            self.limits.check_prompt_text(text)
            add_special = request.add_special_tokens is not False
        if images:
            token_ids = await image_prompt_ids(self.frontend, text, images, add_special)
        else:
            token_ids = tokenizer.encode(text, add_special_tokens=add_special)
        return TokenizeResponse(
            count=len(token_ids),
            max_model_len=self.max_model_len,
            tokens=token_ids,
            token_strs=(
                tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
            ),
        )

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        tokenizer = self._tokenizer("tokens")
        self.limits.check_token_ids(request.tokens, "tokens")
        bad = [t for t in request.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"tokens contains {bad[0]}, outside the vocabulary [0, {self.vocab_size}).",
                "tokens",
            )
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
