"""Records that cross the splitter's boundary: split results, cuts, parsed model output.

All frozen: the proxy hands them to the planner and the HTTP layer unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import NamedTuple

from anchorcache.wire import TokenIds


class CutKind(str, Enum):
    INSTRUCTION = "instruction"  # end of leading system/developer messages + tool schemas
    TURN = "turn"  # end of a completed turn between the instruction and conversation cuts
    CONVERSATION = "conversation"  # end of the last completed turn before the newest messages
    MESSAGES = "messages"  # end of the last message, before the generation prompt: the
    #                        next turn's history ends here, so its anchor is the next hit
    HINT = "hint"  # a message boundary the client asked to anchor (Anthropic cache_control),
    #                added after splitting (proxy/cut_hints.py) and verified like the others


class Cut(NamedTuple):
    """A verified cut: `input_ids[:position]` is an exact token prefix of the full prompt.
    (A named tuple: a long conversation's split makes one per turn, and a frozen dataclass
    costs several times as much to build.)"""

    kind: CutKind
    position: int  # number of tokens in the verified prefix


# `SplitResult.adapter` of a raw prompt (`/v1/completions`): no template rendered it, and
# its output is all text (no tool calls, no reasoning parsed out of it)
RAW_ADAPTER = "raw"


@dataclass(frozen=True)
class SplitResult:
    """A rendered prompt and its verified cuts.

    Invariants: `cuts` is sorted by strictly increasing position, every position lies in
    `[1, len(input_ids)]`, at most one INSTRUCTION cut (the first cut, if present) and at
    most one CONVERSATION cut and at most one MESSAGES cut (the last cut, if present).
    """

    adapter: str
    # full prompt, generation prompt included: a tuple, or the kept turns' `TokenIds`
    input_ids: tuple[int, ...] | TokenIds
    cuts: tuple[Cut, ...]
    # the newest messages (after the last assistant one) render the same once more messages
    # follow, so the MESSAGES cut stays a prefix of the next turn (the adapter's
    # `stable_tail`; False where unknown)
    stable_tail: bool = False
    # where each tool's schema ends inside the instruction prefix (splitter/tool_cuts.py):
    # strictly increasing, each before the instruction cut; () without one
    tool_cuts: tuple[int, ...] = ()
    # the `token_bytes` of the earlier prompt of this conversation that the splitter extended
    # (its kept turn, splitter/turns.py): the planner resumes its anchor keys from that
    # prompt's and follows its anchors (planner.PrefixKeys); None where there was none
    prior_token_bytes: bytes | None = field(default=None, repr=False, compare=False)
    # (`cuts`, their anchor cuts) where the maker knows them (a kept turn's: `anchor_cuts`
    # then walks no TURN cut); used only while `cuts` is that very tuple
    given_anchor_cuts: tuple[tuple[Cut, ...], tuple[Cut, ...]] | None = field(
        default=None, repr=False, compare=False)

    def _position(self, kind: CutKind) -> int | None:
        for cut in self.cuts:
            if cut.kind is kind:
                return cut.position
        return None

    @property
    def instruction_cut(self) -> int | None:
        return self._position(CutKind.INSTRUCTION)

    @property
    def conversation_cut(self) -> int | None:
        return self._position(CutKind.CONVERSATION)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @cached_property
    def anchor_cuts(self) -> tuple[Cut, ...]:
        """The cuts but the TURN ones: those the planner may anchor (a long conversation
        has a TURN cut per turn). Made on the split thread with `token_bytes`."""
        given = self.given_anchor_cuts
        if given is not None and given[0] is self.cuts:
            return given[1]
        return tuple(c for c in self.cuts if c.kind is not CutKind.TURN)

    @cached_property
    def token_bytes(self) -> bytes:
        """`input_ids` as native int64s, what anchor keys hash (`wire.anchor_keys`): made
        once, on the split thread (split_pool.py), so planning never converts the prompt."""
        return TokenIds.of(self.input_ids).buf

    def to_json(self) -> dict:
        return {
            "adapter": self.adapter,
            "num_tokens": len(self.input_ids),
            "input_ids": list(self.input_ids),
            "cuts": [{"kind": c.kind.value, "position": c.position} for c in self.cuts],
            "tool_cuts": list(self.tool_cuts),
        }


class SplitError(ValueError):
    """Bad request content (the client's fault): the proxy answers 400 invalid_request_error.

    `param` names the offending field in OpenAI style, e.g.
    `messages[3].tool_calls[0].function.arguments`.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object; of its start only when `partial`
    partial: bool = False  # cut short by max_tokens: `arguments` is what was written

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a tool call (OpenAI `delta.tool_calls[i]`).

    The first delta of a call carries `id` and `name`; our parsers emit each call whole once
    its closing marker is seen, so `arguments_delta` is then the complete JSON text (or, for
    a call cut short by max_tokens, `partial`, the text written before the cut).
    """

    index: int
    id: str | None
    name: str | None
    arguments_delta: str
    partial: bool = False


@dataclass(frozen=True)
class OutputDelta:
    """One streamed piece of a choice: text, a tool-call piece, or reasoning text (what a
    reasoning template's think block or analysis channel holds, kept out of `content`).
    Exactly one of the three is set; a reader that knows no reasoning skips a delta whose
    `content` and `tool_call` are both None."""

    content: str | None = None
    tool_call: ToolCallDelta | None = None
    reasoning: str | None = None


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: tuple[ToolCall, ...]
    reasoning: str | None = None  # the reasoning deltas' text, joined
