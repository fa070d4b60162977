"""One choice's text path: detokenizer → stop sequences → output parser → markup guard.

The pipeline (`pipeline.py`) drives the worker and hands each choice its chunks; a `Choice`
turns them into text / tool-call deltas (`ChoiceDelta`) and fills its `Outcome`. Stop
sequences are cut from the text, and text a stop sequence may still complete is held back,
so none reaches the client in part. A tool call the parser cannot read never reaches the
client as content: the text before it is kept, the rest dropped, and the choice records
`tool_call_error`. A call cut short by max_tokens whose name is whole comes back partial
(`ToolCall.partial`: its arguments so far) with finish reason `length`, as OpenAI returns it.
Reasoning (a think block, harmony's analysis channel: the parser's `OutputDelta.reasoning`)
passes the guard untouched and is collected in `Outcome.reasoning`, never in `text`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from anchorcache.wire import GenerateMeta

from .detokenizer import IncrementalDetokenizer
from .errors import ApiError
from .splitter.parsers import OutputParser
from .splitter.types import OutputDelta, ToolCall
from .worker_client import Chunk


class FinishReason(str, Enum):
    STOP = "stop"  # an EOS / stop token
    LENGTH = "length"  # max_tokens or the context ran out
    TOOL_CALLS = "tool_calls"  # the output parsed into tool calls
    STOP_SEQUENCE = "stop_sequence"  # one of `Generation.stop` appeared in the text


@dataclass
class Outcome:
    """What one completion produced, filled in as `Completion.deltas` goes."""

    text: str = ""  # the content deltas' text joined (no reasoning)
    reasoning: str = ""  # the reasoning deltas' text joined (reasoning templates)
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.STOP
    stop_sequence: str | None = None  # which of `Generation.stop` ended the text
    completion_tokens: int = 0
    meta: GenerateMeta | None = None  # the worker's final meta_info for this choice
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when asked for
    tool_call_error: str | None = None  # a tool call was started but could not be parsed


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the token's text (its bytes may be part of a character: U+FFFD)
    logprob: float
    top: tuple[tuple[str, float], ...] = ()  # the most likely tokens there, best first


@dataclass(frozen=True)
class ChoiceDelta:
    """A piece of choice `index`: a text / tool-call delta, and the logprobs of the tokens
    that arrived with it (a delta of None carries only logprobs: text still held back)."""

    index: int
    delta: OutputDelta | None
    logprobs: tuple[TokenLogprob, ...] = ()


# The opening of a tool call in each family's markup (structured.FAMILY): content that
# contains one is an unparsed call, cut there.
CALL_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                "llama3": ("<|python_tag|>", '{"name": ')}


class Choice:
    """One choice of a completion: `feed` it the worker's chunks for it, in order; the
    worker ending without its final chunk: `close` it."""

    def __init__(self, index: int, outcome: Outcome, *, tokenizer: Any, parser: OutputParser,
                 stop: tuple[str, ...], stop_ids: set[int], markers: tuple[str, ...]) -> None:
        self.index = index
        self.outcome = outcome
        self.tokenizer = tokenizer
        self.parser = parser
        self.stop = stop  # stop sequences (text)
        self.detok = IncrementalDetokenizer(tokenizer, skip_token_ids=stop_ids)
        self.stop_ids = stop_ids
        self.markers = markers
        self.emitted = 0  # characters of detok.text already passed on
        self.closed = False  # a stop sequence or the worker ended it
        self.kept_tokens: int | None = None  # a stop sequence: output ids wholly before it

    def feed(self, chunk: Chunk) -> list[ChoiceDelta]:
        outcome, stops = self.outcome, self.stop
        outcome.completion_tokens += len(chunk.output_ids)
        logprobs = self._logprobs(chunk)
        outcome.logprobs.extend(logprobs)
        self.detok.add(chunk.output_ids)
        if chunk.meta is not None:
            self.detok.flush()
        text = self.detok.text
        stop = _find_stop(text, stops, self.emitted) if stops else None
        if stop is not None:
            text = text[:stop[0]]
        elif stops and chunk.meta is None:
            text = text[:max(self.emitted, len(text) - _stop_prefix(text, stops))]
        new, self.emitted = text[self.emitted:], len(text)
        if stop is not None:
            outcome.finish_reason = FinishReason.STOP_SEQUENCE
            outcome.stop_sequence = stop[1]
            self.kept_tokens = self.detok.tokens_before(stop[0])
        elif chunk.meta is not None:
            if chunk.meta.finish_type == "abort":  # the worker gave up: never a completion
                raise ApiError("worker_error", "the worker aborted the request before it "
                                               "finished")
            outcome.meta = chunk.meta
            outcome.finish_reason = FinishReason.LENGTH if chunk.meta.finish_type == "length" \
                else FinishReason.STOP
        deltas = self._guard(self.parser.feed(new)) if new else []
        if stop is not None or chunk.meta is not None:
            deltas += self.close()
        out = [ChoiceDelta(self.index, d) for d in deltas]
        if logprobs:
            if out:
                out[0] = ChoiceDelta(self.index, out[0].delta, logprobs)
            else:
                out.append(ChoiceDelta(self.index, None, logprobs))
        return out

    def close(self) -> list[OutputDelta]:
        """The choice has ended (a stop sequence, its final chunk, or a worker that ended
        without one): flush the parser and settle its tool calls and finish reason."""
        self.closed = True
        # cut by max_tokens: an unfinished call comes back partial, finish_reason "length"
        deltas = self._guard(self.parser.flush(truncated=self._cut_by_length()))
        parsed = self.parser.finish()
        self.outcome.tool_calls = list(parsed.tool_calls)
        if self.outcome.tool_calls and not any(c.partial for c in parsed.tool_calls):
            self.outcome.finish_reason = FinishReason.TOOL_CALLS
        return deltas

    def _guard(self, deltas: list[OutputDelta]) -> list[OutputDelta]:
        """Pass the parser's deltas on, cutting content at the first call marker (an
        unparsed call) and dropping all content after it."""
        out = []
        for delta in deltas:
            if delta.reasoning is not None:  # not content: it may mention markup freely
                self.outcome.reasoning += delta.reasoning
                out.append(delta)
                continue
            if delta.tool_call is None and self.outcome.tool_call_error is not None:
                continue
            text = delta.content or ""
            hits = [i for m in self.markers if (i := text.find(m)) >= 0]
            if delta.tool_call is None and hits:
                head = text[:min(hits)].rstrip()
                reason = "cut off by max_tokens" if self._cut_by_length() else "malformed"
                self.outcome.tool_call_error = f"the model's tool call could not be parsed ({reason})"
                if not head:
                    continue
                delta = OutputDelta(content=head)
            if delta.tool_call is None:
                self.outcome.text += delta.content or ""
            out.append(delta)
        return out

    def _cut_by_length(self) -> bool:
        return self.outcome.finish_reason is FinishReason.LENGTH

    def _logprobs(self, chunk: Chunk) -> tuple[TokenLogprob, ...]:
        if chunk.logprobs is None:
            return ()
        decode = self.tokenizer.decode
        return tuple(
            TokenLogprob(decode([t]), lp, tuple((decode([i]), v) for i, v in top))
            for t, (lp, top) in zip(chunk.output_ids, chunk.logprobs, strict=True)
            if t not in self.stop_ids)


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    """The earliest stop sequence in `text` that ends past `start` (where new text began)."""
    hits = [(i, s) for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that a stop sequence may still complete: held
    back, so that a sequence spanning tokens or chunks never reaches the client in part."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held
