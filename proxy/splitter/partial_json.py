"""JSON text cut short: the value it describes (`close_json`).

Two sides use it: a tool call cut by `max_tokens` (the Anthropic `tool_use` input is an
object, the OpenAI arguments stay the text), and such a call sent back in a conversation's
history (normalize.py renders it for templates that need an object).

Request text reaches it, so its cost is bounded: one pass over the text, then a few
`json.loads` (see `close_json`), never one per possible cut.
"""

from __future__ import annotations

import json
from typing import Any

_CLOSER = {"{": "}", "[": "]"}


def close_json(text: str) -> Any | None:
    """The value a JSON text cut short describes: its open string and containers closed; an
    unfinished key, literal or number (or a half-written escape) dropped. A complete text
    gives its own value; None if no prefix of it reads as JSON, text follows a whole value,
    or it nests too deep for the json module.

    Candidates are the text closed at its end, then closed at the cuts where a value may stop
    (before each `,` and after each `{` / `[` outside strings), longest first. A candidate
    that fails at a character of the text rules out every longer cut (they hold that
    character too), so the next one tried ends at or before it: a handful of parses in all,
    not one per cut. The stack of open containers at each cut is a parent-linked node, so
    noting a cut costs O(1) however deep the text nests."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    except RecursionError:
        return None
    # open containers as linked nodes: node i is (closer, parent node), -1 the empty stack
    nodes: list[tuple[str, int]] = []
    top = -1
    cuts: list[tuple[int, int]] = []  # (end of the kept text, stack node there)
    in_string = False
    escape: int | None = None  # where an escape sequence began, while it is unfinished
    for i, ch in enumerate(text):
        if top < 0 and cuts and not in_string and not ch.isspace():
            return None  # more after a whole value: not a value cut short
        if in_string:
            if escape is not None:
                done = text[escape + 1] != "u" or i - escape == 5
                escape = None if done else escape
            elif ch == "\\":
                escape = i
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in _CLOSER:
            nodes.append((_CLOSER[ch], top))
            top = len(nodes) - 1
            cuts.append((i + 1, top))
        elif ch in "}]":
            if top < 0 or nodes[top][0] != ch:
                return None  # a closer with nothing, or something else, open
            top = nodes[top][1]
        elif ch == ",":
            cuts.append((i, top))

    def closers(node: int) -> str:
        out = []
        while node >= 0:
            closer, node = nodes[node]
            out.append(closer)
        return "".join(out)

    kept = text[:escape] if escape is not None else text
    limit = len(text)
    for end, node in [(len(kept), top), *reversed(cuts)]:
        if end > limit:
            continue
        tail = '"' if end == len(kept) and in_string else ""  # only the text's own end
        try:
            return json.loads(text[:end] + tail + closers(node))
        except json.JSONDecodeError as e:
            limit = min(limit, e.pos)  # a character of the text that no cut after it can fix
        except RecursionError:
            return None
    return None
