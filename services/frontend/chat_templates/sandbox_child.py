"""The chat-template sandbox's child process: renders requests' own chat templates.

A request's template is a program: Jinja's sandbox keeps it from reaching Python, but not
from looping for minutes or building gigabytes of text. So it runs here, in a process of
its own that the frontend kills when a render passes its time (template_sandbox.py), under
an address-space limit, and whose output is refused past a size (the protocol: `main`).
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import struct
import sys
from typing import BinaryIO

from services.frontend.chat_templates import render_conversation

_HEADER = struct.Struct(">I")
MAX_ERROR_CHARS = 1000


def read_frame(stream: BinaryIO) -> bytes | None:
    """One frame's body, or None at the end of the stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = stream.read(size)
    return body if len(body) == size else None


def write_frame(stream: BinaryIO, body: bytes) -> None:
    stream.write(_HEADER.pack(len(body)) + body)
    stream.flush()


def render_reply(tokenizer, request: dict, max_output_bytes: int) -> dict:
    """One render's reply; every failure of the template is an error reply."""
    try:
        text = render_conversation(
            tokenizer,
            request["messages"],
            request["add_generation_prompt"],
            request["chat_template"],
            request["tools"],
            request["uses_tools"],
            request.get("template_kwargs"),
        )
    except MemoryError:
        return {"error": "the chat template used more memory than its sandbox allows."}
    except RecursionError:
        return {"error": "the chat template recursed too deeply."}
    except Exception as exc:
        return {"error": str(exc)[:MAX_ERROR_CHARS]}
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_output_bytes:
        return {
            "error": f"the chat template rendered {size} bytes, more than the limit of "
            f"{max_output_bytes} (max_prompt_bytes, --max-prompt-bytes)."
        }
    return {"text": text}


def _limit_memory(budget_bytes: int) -> None:
    """Address space: what the process holds now (interpreter, tokenizer) plus the budget."""
    with open("/proc/self/statm") as statm:
        current = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = current + budget_bytes
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main() -> None:
    """The protocol over stdin / stdout, each frame a 4-byte big-endian length and a body:
    first the frontend's setup (a pickle: the tokenizer, the memory budget, the output
    bound; answered with an empty frame once ready), then one JSON request per render, each
    answered by one JSON reply, {"text": ...} or {"error": ...}. Replies are JSON, never
    pickles: the frontend must not unpickle what a template produced.
    """

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # frames only on the real stdout
    setup = read_frame(stdin)
    if setup is None:
        return
    tokenizer, memory_bytes, max_output_bytes = pickle.loads(setup)
    _limit_memory(memory_bytes)
    write_frame(stdout, b"{}")  # ready
    while (frame := read_frame(stdin)) is not None:
        try:
            reply = render_reply(tokenizer, json.loads(frame), max_output_bytes)
        except MemoryError:  # decoding the request itself
            reply = {"error": "the chat template used more memory than its sandbox allows."}
        write_frame(stdout, json.dumps(reply).encode())


if __name__ == "__main__":
    main()
