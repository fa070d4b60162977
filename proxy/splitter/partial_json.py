"""JSON text cut short: the value it describes (`close_json`).

Two sides use it: a tool call cut by `max_tokens` (the Anthropic `tool_use` input is an
object, the OpenAI arguments stay the text), and such a call sent back in a conversation's
history (normalize.py renders it for templates that need an object).

The value is jiter's partial mode (pydantic's JSON parser, a dependency of the OpenAI SDK
too). jiter also reads some text that is no JSON's start (`[1}`, `{"a": 1 x`), so the text
is first checked to be one: one pass tracks the open containers and string, then the text
must parse once completed (the open string closed, an unfinished literal, number, key or
escape finished by one of a few fixed fillers, the containers closed). Request text reaches
it, so its cost is bounded: one pass and a few parses.
"""

from __future__ import annotations

import json
from typing import Any

import jiter

_CLOSER = {"{": "}", "[": "]"}
# what may finish a text cut outside a string: nothing, a number's or a value's missing
# digit, a key's colon and value, a pair after a comma, a literal's rest
_FILLERS = ("", "0", ":0", '"":0', "rue", "ue", "e", "alse", "lse", "se", "ull", "ll", "l")


def close_json(text: str) -> Any | None:
    """The value a JSON text cut short describes: its open string and containers closed; an
    unfinished key, literal or number (and the key it belongs to) dropped. A complete text
    gives its own value; None if the text is not the start of a JSON value, text follows a
    whole value, or it nests too deep."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    except RecursionError:
        return None
    if not is_json_start(text):
        return None
    try:
        return jiter.from_json(text.encode(), partial_mode="trailing-strings")
    except ValueError:  # nests past jiter's limit
        return None


def is_json_start(text: str) -> bool:
    """Whether some text appended to `text` makes it one whole JSON value."""
    stack: list[str] = []
    in_string = False
    escape: int | None = None  # where an unfinished escape sequence began
    whole = False  # a whole top-level value has been read
    for i, ch in enumerate(text):
        if whole and not ch.isspace():
            return False
        if in_string:
            if escape is not None:
                if text[escape + 1] != "u" or i - escape == 5:
                    escape = None
            elif ch == "\\":
                escape = i
            elif ch == '"':
                in_string = False
                whole = not stack
        elif ch == '"':
            in_string = True
        elif ch in _CLOSER:
            stack.append(_CLOSER[ch])
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return False
            whole = not stack
    closers = "".join(reversed(stack))
    if in_string:
        tail = ""
        if escape is not None:
            tail = "n" if escape == len(text) - 1 else "0" * (6 - (len(text) - escape))
        fillers: tuple[str, ...] = (tail + '"', tail + '":0')
    else:
        fillers = _FILLERS
    for filler in fillers:
        try:
            json.loads(text + filler + closers)
            return True
        except json.JSONDecodeError:
            continue
        except RecursionError:
            return False
    return False
