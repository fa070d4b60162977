"""Registry, plugins, tokenizer loading and `run_split`."""

from __future__ import annotations

import ast
import io
import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from anchorcache.proxy.splitter import (
    AdapterRegistry,
    available_adapters,
    get_adapter,
    run_split,
)
from anchorcache.proxy.splitter.tokenizers import load_hf_dir, load_tokenizer

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


def _tokenizer_with_template(tmp_path, source_dir, template: str):
    (tmp_path / "tokenizer.json").write_bytes((Path(source_dir) / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return load_hf_dir(tmp_path, name="variant")


def test_auto_proves_a_mirror_and_falls_back_with_a_reason(tmp_path, tokenizers_by_name,
                                                           caplog):
    """A Qwen3-like template that renders tools differently (sorted keys): the qwen3 mirror
    would not reproduce it, so `auto` logs why and renders with the template itself."""
    qwen3 = tokenizers_by_name["qwen3"]
    variant = qwen3.chat_template.replace("tool | tojson", "tool | tojson(sort_keys=true)")
    assert variant != qwen3.chat_template
    tok = _tokenizer_with_template(tmp_path, qwen3.source, variant)
    with caplog.at_level(logging.WARNING, logger="anchorcache.splitter"):
        adapter = get_adapter("auto", tok)
    assert adapter.name == "generic"
    assert "adapter qwen3 does not reproduce the chat template of variant" in caplog.text
    assert "probe 2 differs" in caplog.text
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "b", "parameters": {
        "type": "object", "properties": {"z": {}, "a": {}}}}}]
    assert list(adapter.split(msgs, tools).input_ids) == tok.encode(
        tok.render(msgs, tools, add_generation_prompt=True))
    assert get_adapter("qwen3", tok).name == "qwen3"  # named explicitly: used as asked
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="anchorcache.splitter"):
        assert get_adapter("auto", qwen3).name == "qwen3"  # the real template: proven
    assert not caplog.text


def test_chatml_template_that_renders_tools_gets_generic(tmp_path, tokenizers_by_name, caplog):
    smollm2 = tokenizers_by_name["smollm2"]
    template = ("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok = _tokenizer_with_template(tmp_path, smollm2.source, template)
    with caplog.at_level(logging.WARNING, logger="anchorcache.splitter"):
        adapter = get_adapter("auto", tok)
    assert adapter.name == "generic" and "renders tools itself" in caplog.text
    assert adapter.deviation is None  # the template renders the tools: nothing lowered
    assert get_adapter("auto", smollm2).name == "chatml"


def test_split_output_names_the_deviation(tmp_path):
    path = tmp_path / "req.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                "tools": [{"type": "function", "function": {"name": "ls"}}]}))
    assert run_split("qwen3", "auto", str(path))["deviation"] is None
    smollm2 = run_split(None, "auto", str(path))
    assert smollm2["adapter"] == "chatml" and "ignores tools" in smollm2["deviation"]
    assert "canonical" in run_split("qwen3", "auto", str(path),
                                    canonical_tools=True)["deviation"]
    from anchorcache.cli import app

    cli = CliRunner().invoke(app, ["split", str(path)])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["deviation"] == smollm2["deviation"]


SPLITTER = Path(__file__).resolve().parents[3] / "proxy" / "splitter"


def test_splitter_stands_alone():
    """proxy/splitter/ imports nothing from the rest of proxy/ (no `..` imports, no
    `anchorcache.proxy.X` outside the splitter), and `run_split` is defined once."""
    for file in SPLITTER.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level <= 1, (file.name, node.module)
                module = node.module or ""
            elif isinstance(node, ast.Import):
                module = ",".join(a.name for a in node.names)
            else:
                continue
            for name in module.split(","):
                if name.startswith("anchorcache.proxy"):
                    assert name.startswith("anchorcache.proxy.splitter"), (file.name, name)
    repo = SPLITTER.parents[1]
    defs = [str(f.relative_to(repo)) for folder in ("anchorcache", "proxy", "ext", "bench")
            for f in (repo / folder).rglob("*.py") if "def run_split(" in f.read_text()]
    assert defs == ["proxy/splitter/cli.py"]
