"""An incremental, strict JSON scanner that re-serialises what it reads in one canonical form.

Why: a streamed tool call's `arguments` fragments must concatenate to exactly the string the
non-streamed response carries, whatever the chunk boundaries. Both paths feed the model's
text through this scanner and use its output (json.dumps' separators and escaping, with
ensure_ascii=False). Output only ever grows and a number or literal is written once
complete, so every prefix of the output is final.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_ENDINGS = ("0", "0.0", ".0", "e0", "0e0")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r"}
_SHORT_ESCAPES["t"] = "\t"
_WRITE_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r"}
_WRITE_ESCAPES["\t"] = "\\t"
_WHITESPACE = " \t\n\r"


class JsonError(ValueError):
    """The text is not a prefix of any JSON value."""


def _escape(char: str) -> str:
    if char in _WRITE_ESCAPES:
        return _WRITE_ESCAPES[char]
    if ord(char) < 0x20 or 0xD800 <= ord(char) <= 0xDFFF:  # controls, lone surrogates
        return f"\\u{ord(char):04x}"
    return char


class JsonScanner:
    """Feed characters; `out` is the canonical text so far, `done` once the value is whole.

    The scanner reads one value. At depth 1 of an object it reports where each member's value
    starts and ends in the output, which is how the tool-call parser finds `name` and
    `arguments` without a second parse.
    """

    def __init__(self) -> None:
        self.out = ""
        self.done = False
        self._stack: list[str] = []  # "{" or "["
        self._expect = "value"  # value | key | colon | comma | value_or_end | key_or_end
        self._token: str | None = None  # a number or literal being read
        self._string: str | None = None  # "key" or "value" while inside a string
        self._escape: str | None = None  # "\\" or "\\uXXXX" digits so far
        self._high: str | None = None  # a high surrogate waiting for its low half
        self._key: list[str] = []
        self.member: str | None = None  # the depth-1 key whose value is being read
        self.member_start = 0  # where that value starts in out
        self.members: dict[str, tuple[int, int]] = {}  # depth-1 key -> (start, end) in out

    # ---- output --------------------------------------------------------------------------
    def _write(self, text: str) -> None:
        self.out += text

    @property
    def length(self) -> int:
        return len(self.out)

    # ---- feeding -------------------------------------------------------------------------
    def feed(self, char: str) -> bool:
        """Read one character; False when it is not part of the value (the value ended
        before it: only after a top-level number or literal). JsonError when invalid."""
        if self.done:
            return False
        if self._string is not None:
            self._string_char(char)
            return True
        if self._token is not None:
            if char in _NUMBER_CHARS or char.isalpha():
                self._token += char
                self._check_token_prefix()
                return True
            self._end_token()
            if self.done:
                return False
        if char in _WHITESPACE:
            return True
        self._structural(char)
        return True

    def finish(self) -> None:
        """The text ended: a top-level number or literal is complete now."""
        if self._token is not None and not self._stack:
            self._end_token()

    # ---- tokens --------------------------------------------------------------------------
    def _structural(self, char: str) -> None:
        expect = self._expect
        if expect in ("value", "value_or_end"):
            if char == "]" and expect == "value_or_end":
                self._close("[", char)
            else:
                self._start_value(char)
        elif expect in ("key", "key_or_end"):
            if char == "}" and expect == "key_or_end":
                self._close("{", char)
            elif char == '"':
                self._string, self._key = "key", []
                self._write('"')
            else:
                raise JsonError(f"expected a key, got {char!r}")
        elif expect == "colon":
            if char != ":":
                raise JsonError(f"expected ':', got {char!r}")
            self._write(": ")
            self._expect = "value"
        elif char == ",":
            self._write(", ")
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif char in "}]":
            self._close("{" if char == "}" else "[", char)
        else:
            raise JsonError(f"expected ',' or a closing bracket, got {char!r}")

    def _start_value(self, char: str) -> None:
        if len(self._stack) == 1 and self._stack[0] == "{":
            self.member, self.member_start = "".join(self._key), self.length
        if char in "{[":
            self._stack.append(char)
            self._write(char)
            self._expect = "key_or_end" if char == "{" else "value_or_end"
        elif char == '"':
            self._string = "value"
            self._write('"')
        elif char == "-" or char.isdigit() or char in "tfn":
            self._token = char
        else:
            raise JsonError(f"expected a value, got {char!r}")

    def _close(self, opener: str, char: str) -> None:
        if not self._stack or self._stack[-1] != opener:
            raise JsonError(f"unexpected {char!r}")
        self._stack.pop()
        self._write(char)
        self._value_done()

    def _value_done(self) -> None:
        if not self._stack:
            self.done = True
            return
        if len(self._stack) == 1 and self._stack[0] == "{" and self.member is not None:
            self.members[self.member] = (self.member_start, self.length)
            self.member = None
        self._expect = "comma"

    def _check_token_prefix(self) -> None:
        token = self._token
        if token[0] in "tfn":
            if not any(lit.startswith(token) for lit in _LITERALS):
                raise JsonError(f"invalid literal {token!r}")
        elif not (_NUMBER.fullmatch(token) or _is_number_prefix(token)):
            raise JsonError(f"invalid number {token!r}")

    def _end_token(self) -> None:
        token, self._token = self._token, None
        if token not in _LITERALS and not _NUMBER.fullmatch(token):
            raise JsonError(f"invalid value {token!r}")
        self._write(token)
        self._value_done()

    # ---- strings -------------------------------------------------------------------------
    def _string_char(self, char: str) -> None:
        if self._escape is not None:
            self._escape_char(char)
        elif char == "\\":
            self._escape = "\\"
        elif char == '"':
            self._flush_high()
            self._end_string()
        elif ord(char) < 0x20:
            raise JsonError("a raw control character inside a string")
        else:
            self._flush_high()
            self._string_text(char)

    def _escape_char(self, char: str) -> None:
        if self._escape == "\\":
            if char == "u":
                self._escape = "\\u"
                return
            if char not in _SHORT_ESCAPES:
                raise JsonError(f"invalid escape \\{char}")
            self._escape = None
            self._flush_high()
            self._string_text(_SHORT_ESCAPES[char])
            return
        if char not in "0123456789abcdefABCDEF":
            raise JsonError(f"invalid \\u escape {self._escape + char!r}")
        self._escape += char
        if len(self._escape) == 6:
            code, self._escape = int(self._escape[2:], 16), None
            self._code_point(code)

    def _code_point(self, code: int) -> None:
        if 0xDC00 <= code <= 0xDFFF and self._high is not None:
            high, self._high = self._high, None
            self._string_text(chr(0x10000 + ((ord(high) - 0xD800) << 10) + (code - 0xDC00)))
            return
        self._flush_high()
        if 0xD800 <= code <= 0xDBFF:
            self._high = chr(code)  # held: the next escape may be its low half
        else:
            self._string_text(chr(code))

    def _flush_high(self) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            self._string_text(high)

    def _string_text(self, char: str) -> None:
        if self._string == "key" and len(self._stack) == 1:
            self._key.append(char)
        self._write(_escape(char))

    def _end_string(self) -> None:
        kind, self._string = self._string, None
        self._write('"')
        if kind == "key":
            self._expect = "colon"
        else:
            self._value_done()


def _is_number_prefix(token: str) -> bool:
    """Whether more characters could still make `token` a JSON number."""
    return any(_NUMBER.fullmatch(token + suffix) for suffix in _NUMBER_ENDINGS)
