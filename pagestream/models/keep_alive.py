"""A request's `keep_alive`, as Ollama reads it: how long its model stays loaded after the
request ends. Seconds as a number, or a duration string ("30s", "5m", "1h30m", "250ms");
0 unloads the model once its requests end; a negative value keeps it loaded for good.
None (absent) leaves the server's --idle-unload-seconds in force."""

from __future__ import annotations

import math
import re

FOREVER = math.inf
MAX_TEXT = 32  # a client controls the string: its length is bounded before it is read
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"([0-9]*\.?[0-9]+)(ms|s|m|h)")


def parse_keep_alive(value: object) -> float | None:
    """Seconds to keep the model loaded after the request (FOREVER for a negative value).
    Raises ValueError naming keep_alive for anything else."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"keep_alive must be seconds or a duration such as 5m, got {value!r}.")
    seconds = _seconds(value) if isinstance(value, str) else float(value)
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number, got NaN.")
    return FOREVER if seconds < 0 else seconds


def _seconds(text: str) -> float:
    body = text.strip()
    if len(body) > MAX_TEXT:
        raise ValueError(f"keep_alive must be at most {MAX_TEXT} characters.")
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    try:
        return sign * float(body)  # "300" or "-1": seconds
    except ValueError:
        pass
    parts = _PART.findall(body)
    if not parts or "".join(a + b for a, b in parts) != body:
        raise ValueError(f"keep_alive must be seconds or a duration such as 5m, got {text!r}.")
    return sign * sum(float(amount) * _UNIT_S[unit] for amount, unit in parts)
