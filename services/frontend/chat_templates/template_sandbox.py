"""TemplateSandbox: renders requests' own chat templates in a child process, with bounds.

Only a server started with --trust-request-chat-template renders them at all. A template
is a program written by the client: on the event loop, a nested loop or
`{{ 'a' * 3000000000 }}` would stall every request and grow the server by gigabytes. Here
each render runs in one child process (sandbox_child.py) under an address-space budget,
with a bounded reply and a timeout past which the child is killed (a 400); renders take
turns, so requests' templates take at most one core.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pickle
import sys

from services.frontend.chat_templates.sandbox_child import MAX_ERROR_CHARS

logger = logging.getLogger(__name__)

_CHILD = "services.frontend.chat_templates.sandbox_child"
_HEADER_BYTES = 4
# What the child may allocate beyond the interpreter and the tokenizer it holds.
MEMORY_BUDGET_BYTES = 1024 * 1024 * 1024
# A child imports transformers and unpickles the tokenizer: seconds on a busy small machine.
START_TIMEOUT_S = 60.0


class ChatTemplateError(ValueError):
    """A request's chat template failed, ran too long, or rendered too much (HTTP 400)."""


class TemplateSandbox:
    def __init__(
        self,
        tokenizer,
        timeout_s: float,
        max_output_bytes: int,
        memory_bytes: int = MEMORY_BUDGET_BYTES,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        self.memory_bytes = memory_bytes
        self._process: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        chat_template: str,
        tools: list[dict] | None,
        uses_tools: bool,
        template_kwargs: dict | None = None,
    ) -> str:
        """The conversation rendered with `chat_template` (ChatTemplateError otherwise)."""
        request = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "chat_template": chat_template,
            "tools": tools,
            "uses_tools": uses_tools,
            "template_kwargs": template_kwargs,
        }
        body = json.dumps(request).encode()
        try:
            async with asyncio.timeout(self.timeout_s):  # waiting for the child counts
                await self._lock.acquire()
        except TimeoutError:
            raise ChatTemplateError(
                f"the chat-template renderer was busy for {self.timeout_s:g} s with other "
                "requests' templates (chat_template_timeout_s, --chat-template-timeout)."
            ) from None
        try:
            process = await self._started()  # a fresh child's start is not the template's
            async with asyncio.timeout(self.timeout_s):
                reply = await self._exchange(process, body)
        except TimeoutError:
            raise ChatTemplateError(
                f"the chat template did not render within {self.timeout_s:g} s "
                "(chat_template_timeout_s, --chat-template-timeout)."
            ) from None
        finally:
            self._lock.release()
        if "error" in reply:
            raise ChatTemplateError(f"the chat template failed: {reply['error']}")
        return reply["text"]

    async def _exchange(self, process: asyncio.subprocess.Process, body: bytes) -> dict:
        """One request and its reply; anything but a whole reply (a timeout, a cancelled
        request, a broken child) kills the child, whose stream is then out of step."""
        try:
            process.stdin.write(len(body).to_bytes(_HEADER_BYTES, "big") + body)
            await process.stdin.drain()
            return json.loads(await self._read_frame(process))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            await self._kill()
            raise ChatTemplateError(
                "the chat template's renderer ended while rendering it (out of memory?)."
            ) from exc
        except BaseException:
            await self._kill()
            raise

    async def _read_frame(self, process: asyncio.subprocess.Process) -> bytes:
        size = int.from_bytes(await process.stdout.readexactly(_HEADER_BYTES), "big")
        if size > self._max_reply_bytes():
            raise ChatTemplateError("the chat template's renderer sent an oversized reply.")
        return await process.stdout.readexactly(size)

    def _max_reply_bytes(self) -> int:
        # The text JSON-escaped (at most 6 bytes per byte: \\uXXXX) or an error message.
        return 6 * self.max_output_bytes + 8 * MAX_ERROR_CHARS + 64

    async def _started(self) -> asyncio.subprocess.Process:
        if self._process is not None and self._process.returncode is None:
            return self._process
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            _CHILD,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        self._process = process
        setup = pickle.dumps((self.tokenizer, self.memory_bytes, self.max_output_bytes))
        try:
            process.stdin.write(len(setup).to_bytes(_HEADER_BYTES, "big") + setup)
            async with asyncio.timeout(START_TIMEOUT_S):
                await self._read_frame(process)  # the child's "ready"
        except BaseException as exc:
            await self._kill()
            if isinstance(exc, Exception):
                raise ChatTemplateError("the chat-template renderer did not start.") from exc
            raise
        logger.info("started the chat-template sandbox (pid %d)", process.pid)
        return process

    async def _kill(self) -> None:
        process, self._process = self._process, None
        if process is None or process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        logger.warning("killed the chat-template sandbox (pid %d)", process.pid)

    async def close(self) -> None:
        await self._kill()
