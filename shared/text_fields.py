"""The one rule for text in a request: which characters a string field may hold.

Control characters (C0, U+0000–U+001F; DEL, U+007F; C1, U+0080–U+009F) are refused with a 422 naming the field:
PostgreSQL stores no NUL in a text column, and the others would reach terminals, logs and pages as escape
sequences. Three kinds of field, each an annotated ``str`` to declare a field with:

- ``Line``: one line of text (a name, a platform, a path, a label): no control character at all;
- ``Text``: text that may span lines (a prompt template, an answer): tabs, newlines and carriage returns, no other
  control character;
- ``Report``: a device's account of a failure (a native runner's output may hold anything), which is never refused
  for its characters: each control character other than a tab or a newline is written out as an escape
  (``\\x00``, ``\\x1b``, ``\\r``; a lone surrogate ``\\ud800``), and the escaped text is cut to ``REPORT_LENGTH``.

A lone surrogate (a JSON ``\\ud800`` with no pair) is no text at all: pydantic refuses it in every field but a
``Report``. The OpenAPI schema states the rule as a ``pattern`` on each ``Line`` and ``Text`` field, and as
``x-control-characters: escaped`` on a ``Report``. Only pydantic and the standard library are imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

CONTROLS = r"\x00-\x1f\x7f-\x9f"  # as a regular-expression range (Python's and ECMAScript's)
LINE_PATTERN = rf"^[^{CONTROLS}]*$"
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*$"  # tab, newline and carriage return allowed
REPORT_LENGTH = 4000  # characters of a failure report, raw and once escaped
_LINE = re.compile(f"[{CONTROLS}]")
_TEXT = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_ESCAPED = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")  # a report keeps tabs and newlines
_WHAT = "control characters (U+0000-U+001F, U+007F-U+009F)"


@dataclass(frozen=True)
class _Schema:
    """Adds the rule to a field's JSON schema (without replacing a stricter ``pattern`` the field declares)."""

    extra: tuple[tuple[str, Any], ...]

    def __get_pydantic_json_schema__(self, core: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core)
        for key, value in self.extra:
            schema.setdefault(key, value)
        return schema


def _refuse(found: re.Pattern[str], allowed: str):
    def check(value: str) -> str:
        bad = found.search(value)
        if bad is not None:
            raise ValueError(f"must hold no {_WHAT}{allowed}: found U+{ord(bad.group()):04X}")
        return value

    return check


def escape_controls(value: str) -> str:
    """``value`` with each control character but a tab or a newline (and each lone surrogate) as an escape."""

    def escape(match: re.Match[str]) -> str:
        char = match.group()
        return "\\r" if char == "\r" else f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"

    return _ESCAPED.sub(escape, value)


def _report(value: Any) -> Any:
    """A report as it is stored: refused only when it is not a string or longer than ``REPORT_LENGTH`` as sent;
    escaped (``escape_controls``), then cut to ``REPORT_LENGTH``."""
    if not isinstance(value, str):
        return value  # str validation refuses it, naming the field
    if len(value) > REPORT_LENGTH:
        raise ValueError(f"must be at most {REPORT_LENGTH} characters")
    return escape_controls(value)[:REPORT_LENGTH]


Line = Annotated[str, AfterValidator(_refuse(_LINE, "")), _Schema((("pattern", LINE_PATTERN),))]
Text = Annotated[str, AfterValidator(_refuse(_TEXT, " but tabs and newlines")), _Schema((("pattern", TEXT_PATTERN),))]
Report = Annotated[
    str,
    BeforeValidator(_report),
    Field(min_length=1),
    _Schema((("maxLength", REPORT_LENGTH), ("x-control-characters", "escaped"))),
]
