"""JSON as the config files hold it and as error messages quote it: `//` comments allowed, no NaN or Infinity, no
number of thousands of digits, no key twice in one object, a file read defensively (size, encoding, nesting) so that
a wrong file is one line.

Standard library only: the supervisor reads config files before anything else starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import UserError


def shown(value: Any, limit: int = 60) -> str:
    """A value as JSON in an error message, cut short: one line, even for a 5,000-digit number."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text):,} characters)"


def strip_json_comments(text: str) -> str:
    """Remove `//` line comments outside strings, keeping line numbers intact for error messages."""
    out: list[str] = []
    in_string = escaped = False
    i = 0
    while i < len(text):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            out.append(ch)
        elif ch == '"':
            in_string = True
            out.append(ch)
        elif text.startswith("//", i):
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)


MAX_CONFIG_BYTES = 16 << 20  # a config is a few kilobytes; anything this large is another file given by mistake


def refuse_constant(name: str) -> float:
    """`json.loads` takes NaN and Infinity, which JSON does not have: a config holding one is refused by name."""
    raise ValueError(f"{name} is not a JSON number; give a finite number")


MAX_INTEGER_DIGITS = 100


def parse_integer(text: str) -> int:
    """Python refuses to convert more than 4,300 digits with advice about `sys`; a config's numbers are short."""
    if len(text) > MAX_INTEGER_DIGITS:
        raise ValueError(f"a number of {len(text):,} digits")
    return int(text)


class DuplicateKey(ValueError):
    """A key given twice in one JSON object: well-formed JSON, but `json` keeps only the last of the two, which would
    silently drop the first (a whole section, when two `"training"` objects sit side by side)."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key '{key}' appears twice in one object; give each key once (merge what the two hold)")


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a key given twice (`DuplicateKey`)."""
    members: dict[str, Any] = {}
    for key, value in pairs:
        if key in members:
            raise DuplicateKey(key)
        members[key] = value
    return members


def parse_json(text: str) -> Any:
    """JSON as the config files use it: no NaN or Infinity, no number of thousands of digits, no key twice in one
    object. A nesting too deep for the parser is a ValueError like any other malformed input."""
    try:
        return json.loads(text, parse_constant=refuse_constant, parse_int=parse_integer, object_pairs_hook=unique_keys)
    except RecursionError:
        raise ValueError("nested too deeply to be a config") from None


def read_json(path: Path) -> Any:
    """A config file, read defensively: UTF-8 text (a BOM allowed), JSON with // comments, an object at the top."""
    if not path.is_file():
        raise UserError(f"config file {path} does not exist" if not path.exists() else
                        f"config file {path} is not a file")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise UserError(f"config file {path} is {path.stat().st_size:,} bytes, too large for a config; is it the "
                            f"right file?")
        text = path.read_bytes().decode("utf-8-sig")
    except OSError as e:
        raise UserError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.start}); save the config as UTF-8 JSON") from None
    try:
        raw = parse_json(strip_json_comments(text))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except DuplicateKey as e:
        raise UserError(f"{path}: {e}") from None
    except ValueError as e:
        raise UserError(f"{path}: invalid JSON: {e}") from None
    return raw
