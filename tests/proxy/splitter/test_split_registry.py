"""Registry, plugins, tokenizer loading and `run_split`."""

from __future__ import annotations

import io
import json

import pytest

from anchorcache.proxy.splitter import (
    AdapterRegistry,
    available_adapters,
    get_adapter,
    run_split,
)
from anchorcache.proxy.splitter.tokenizers import load_tokenizer

PLUGIN = '''
from anchorcache.proxy.splitter.hermes import ChatMLAdapter

class ShoutAdapter(ChatMLAdapter):
    name = "shout"

    @classmethod
    def matches(cls, tokenizer):
        return tokenizer.name == "smollm2"
'''


def test_auto_picks_by_template(tokenizers_by_name):
    picked = {n: get_adapter("auto", t).name for n, t in tokenizers_by_name.items()}
    assert picked == {"qwen3": "qwen3", "smollm2": "chatml", "llama3": "llama3",
                      "mistral": "mistral"}


def test_unknown_adapter_lists_valid_names(tokenizers_by_name):
    with pytest.raises(ValueError) as err:
        get_adapter("nope", tokenizers_by_name["qwen3"])
    for name in available_adapters():
        assert name in str(err.value)


def test_unknown_tokenizer_lists_names():
    with pytest.raises(ValueError, match="qwen3"):
        load_tokenizer("no-such-model")


def test_plugin_directory(tmp_path, tokenizers_by_name):
    (tmp_path / "shout.py").write_text(PLUGIN)
    registry = AdapterRegistry()
    registry.load_plugin_dir(tmp_path)
    assert "shout" in available_adapters(registry)
    adapter = get_adapter("auto", tokenizers_by_name["smollm2"], registry=registry)
    assert adapter.name == "shout"  # plugins are asked first
    assert get_adapter("auto", tokenizers_by_name["qwen3"], registry=registry).name == "qwen3"
    result = adapter.split([{"role": "user", "content": "hi"}])
    assert result.adapter == "shout" and result.instruction_cut is not None


def test_plugins_cannot_shadow_builtins(tmp_path):
    (tmp_path / "bad.py").write_text(PLUGIN.replace('"shout"', '"qwen3"'))
    with pytest.raises(ValueError, match="reserved"):
        AdapterRegistry().load_plugin_dir(tmp_path)


def test_run_split_from_file_and_stdin(tmp_path, monkeypatch):
    request = {"messages": [{"role": "system", "content": "S"},
                            {"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "yo"},
                            {"role": "user", "content": "more"}],
               "tools": [{"type": "function", "function": {"name": "ls"}}]}
    path = tmp_path / "req.json"
    path.write_text(json.dumps(request))
    out = run_split("qwen3", "auto", str(path))
    assert out["adapter"] == "qwen3" and out["model"] == "qwen3"
    assert out["num_tokens"] == len(out["input_ids"])
    kinds = [c["kind"] for c in out["cuts"]]
    assert kinds[0] == "instruction" and kinds[-2:] == ["conversation", "messages"]
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(request)))
    assert run_split("qwen3", "qwen3", "-") == out
    default = run_split(None, "auto", str(path))
    assert default["adapter"] == "chatml" and default["model"] == "smollm2"
