"""Stepping an offline LLMEngine by hand (requests added with add_request /
add_request with PoolingParams)."""

from __future__ import annotations


def run_until_done(engine) -> dict:
    """Step until no request is left; each request's final output by its id."""
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals
