"""Next-token choice from the last position's logits (grammar mask, greedy, temperature,
top-k, top-p), and the logprobs reported for it.

Under a grammar a choice that misspells forced text (`Mask.canonical`) is replaced by the
next choice without it (the next most likely token, or a draw from the rest), a few times at
most; the first choice stands if no allowed token is left.

Logprobs are the model's own distribution (log-softmax of the raw logits), before the
grammar mask, temperature or truncation: what OpenAI's `logprobs` report.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from anchorcache.wire import SamplingParams

# Choices one step may replace for misspelling forced text (a choice among names or keys
# rarely needs more than two or three)
MAX_RESPELLINGS = 8


class Mask(Protocol):
    """A grammar's token mask (grammar.TokenMask): forbid, then advance on the chosen token."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor: ...

    def canonical(self, token: int) -> bool: ...

    def accept(self, token: int) -> None: ...


class Pick(NamedTuple):
    token: int
    logprob: float | None = None  # set when logprobs are asked for
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


class Sampler:
    """One per sample: owns its seeded generator (sample `index` draws from `seed + index`,
    so a request's n samples differ and each is reproducible) and its grammar mask."""

    def __init__(self, params: SamplingParams, *, index: int = 0, mask: Mask | None = None,
                 logprobs: bool = False, top_logprobs: int = 0) -> None:
        self.params = params
        self.mask = mask
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator()
            if params.seed is not None:
                self.generator.manual_seed(params.seed + index)
            else:
                self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> Pick:
        """`logits`: [vocab] float tensor of the last position."""
        raw = logits
        if self.mask is not None:
            logits = self.mask.apply(logits)
        token = self._choose(logits)
        if self.mask is not None:
            token = self._spelled(logits, token)
            self.mask.accept(token)
        if not self.logprobs:
            return Pick(token)
        logp = torch.log_softmax(raw.float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.top_logprobs > 0:
            values, ids = torch.topk(logp, min(self.top_logprobs, logp.numel()))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return Pick(token, float(logp[token]), top)

    def _spelled(self, masked: torch.Tensor, token: int) -> int:
        """`token`, or the next choice while it misspells forced text. `masked`: the mask's
        own copy of the logits (changed here)."""
        assert self.mask is not None
        first = token
        for _ in range(MAX_RESPELLINGS):
            if self.mask.canonical(token):
                return token
            masked[token] = float("-inf")
            if not torch.isfinite(masked).any():
                return first
            token = self._choose(masked)
        return token

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = torch.cumsum(sorted_probs, 0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self.generator))
