"""The incremental detokenizer: Hugging Face tokenizers step in Rust (`DecodeStream`), the
others in Python, by one offsets scheme. Both must emit the same pieces, token by token,
for any ids a model may send (whole characters, characters split over byte tokens, ids
that decode to nothing whole), and end on the whole text."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from anchorcache.proxy.detokenizer import IncrementalDetokenizer
from anchorcache.proxy.splitter.tokenizers import load_tokenizer

NAMES = ("qwen3", "llama3", "smollm2")


@functools.cache
def tokenizer(name: str):
    return load_tokenizer(name)


def pieces(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add(c) for c in chunks] + [detok.flush()]


def in_python(tok) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok)
    detok._stream = None  # (the steps of the tokenizers without a backend)
    return detok


texts = st.text(st.characters(codec="utf-8"), max_size=60) | st.sampled_from([
    "naïve café – 日本語のテキスト 🙂👍🏽", "<think>\nplan\n</think>\n\nDone.", "\n\n  x  \n"])


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(NAMES), data=st.data(),
       text=texts, noise=st.lists(st.integers(0, 150_000), max_size=12),
       sizes=st.lists(st.integers(1, 4), max_size=40))
def test_rust_steps_emit_what_python_steps_emit(name, data, text, noise, sizes):
    tok = tokenizer(name)
    vocab = tok.backend.get_vocab_size()
    ids = tok.encode(text)
    # byte tokens and arbitrary ids mixed in: incomplete characters, held back then flushed
    for n in noise:
        ids.insert(data.draw(st.integers(0, len(ids))), n % vocab)
    chunks, at = [], 0
    for size in sizes:
        if at < len(ids):
            chunks.append(ids[at:at + size])
            at += size
    chunks.append(ids[at:])
    fast, slow = IncrementalDetokenizer(tok), in_python(tok)
    assert fast._stream is not None
    assert pieces(fast, chunks) == pieces(slow, chunks)
    assert fast.text == slow.text == tok.decode(ids)
    assert fast.marks == slow.marks


def test_a_failed_rust_step_goes_on_in_python_from_the_same_offsets():
    tok = tokenizer("qwen3")
    ids = tok.encode("Hello, wörld: 日本語 and more words after it.")
    fast, slow = IncrementalDetokenizer(tok), in_python(tok)

    class Refusing:
        def step(self, *_):
            raise Exception("Invalid prefix encountered")  # (as tokenizers raises it)

    half = len(ids) // 2
    got = [fast.add([t]) for t in ids[:half]]
    fast._stream = Refusing()
    got += [fast.add([t]) for t in ids[half:]] + [fast.flush()]
    assert fast._stream is None
    assert got == [slow.add([t]) for t in ids] + [slow.flush()]
