"""Chat-template rendering compatible with transformers' `apply_chat_template`, without
transformers (whose tokenizer classes import torch, which the proxy must not).

The environment mirrors transformers 5.x: sandboxed, `trim_blocks`, `lstrip_blocks`,
`loopcontrols`, a `tojson` that does not HTML-escape, `raise_exception`, `strftime_now`;
`{% generation %}` blocks render their body unchanged.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(jinja2.ext.Extension):
    tags = {"generation"}  # noqa: RUF012 (jinja's own class attribute)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(
            lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)  # templates are immutable strings; compiling costs milliseconds
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_template(source: str, messages: list[dict], tools: list[dict] | None, *,
                    add_generation_prompt: bool, special_tokens: dict[str, str],
                    **kwargs: Any) -> str:
    """Render like `apply_chat_template(..., tokenize=False)`.

    Raises `jinja2.TemplateError` when the template refuses the conversation.
    """
    return compile_template(source).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
        **special_tokens, **kwargs)
