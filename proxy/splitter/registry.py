"""Adapter registry: built-ins by name (imported lazily), user plugins, `auto` selection.

Plugins: every entry point in the group `anchorcache.splitter_adapters` must load an
`Adapter` subclass; every `*.py` file in a plugin directory (argument, or the environment
variable `ANCHORCACHE_SPLITTER_PLUGIN_DIR`) is imported and each `Adapter` subclass defined
in it with a `name` is registered. Plugins are asked first by `auto`, then the built-ins
from most to least specific, the generic fallback last. A plugin may not reuse a built-in
name (ValueError), so `--adapter qwen3` always means the same thing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import os
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from .base import Adapter

log = logging.getLogger("anchorcache.splitter")
ENTRY_POINT_GROUP = "anchorcache.splitter_adapters"
PLUGIN_DIR_ENV = "ANCHORCACHE_SPLITTER_PLUGIN_DIR"
BUILTINS = {  # in `auto` order: most specific first
    "qwen3": "hermes:Qwen3Adapter",
    "llama3": "llama3:Llama3Adapter",
    "mistral": "mistral:MistralAdapter",
    "harmony": "harmony:HarmonyAdapter",
    "chatml": "hermes:ChatMLAdapter",
    "generic": "generic:GenericAdapter",
}


def _load_builtin(name: str) -> type[Adapter]:
    module, cls = BUILTINS[name].split(":")
    return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


class AdapterRegistry:
    def __init__(self) -> None:
        self._plugins: dict[str, type[Adapter]] = {}

    def names(self) -> list[str]:
        return [*self._plugins, *BUILTINS]

    def register(self, cls: type[Adapter]) -> type[Adapter]:
        name = getattr(cls, "name", None)
        if not (inspect.isclass(cls) and issubclass(cls, Adapter)) or not isinstance(name, str):
            raise ValueError(f"{cls!r} is not an Adapter subclass with a name")
        if name in BUILTINS or name == "auto":
            raise ValueError(f"adapter name {name!r} is reserved for a built-in adapter")
        self._plugins[name] = cls
        return cls

    def load_entry_points(self) -> None:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            self.register(ep.load())

    def load_plugin_dir(self, path: str | Path) -> None:
        for file in sorted(Path(path).glob("*.py")):
            spec = importlib.util.spec_from_file_location(
                f"anchorcache_splitter_plugin_{file.stem}", file)
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            for obj in vars(module).values():
                if (inspect.isclass(obj) and issubclass(obj, Adapter) and obj.__module__ ==
                        module.__name__ and not inspect.isabstract(obj)):
                    self.register(obj)

    def adapter_class(self, name: str, tokenizer: Any) -> type[Adapter]:
        if name == "auto":
            for candidate in self.names():
                cls = self._plugins.get(candidate) or _load_builtin(candidate)
                if cls.matches(tokenizer):
                    return cls
            raise ValueError(f"no adapter matches tokenizer {getattr(tokenizer, 'name', '?')}; "
                             f"choose one of: {', '.join(self.names())}")
        if name in self._plugins:
            return self._plugins[name]
        if name in BUILTINS:
            return _load_builtin(name)
        raise ValueError(f"unknown adapter {name!r}; valid: auto, {', '.join(self.names())}")

    def create(self, name: str, tokenizer: Any, **kwargs: Any) -> Adapter:
        """An adapter by name. `auto` proves a Python mirror against the tokenizer's chat
        template on probe conversations (`Adapter.template_mismatch`) and falls back to
        `generic` (the template itself), with a log line saying why, when they differ."""
        adapter = self.adapter_class(name, tokenizer)(tokenizer, **kwargs)
        if name != "auto" or adapter.name == "generic":
            return adapter
        reason = adapter.template_mismatch()
        if reason is None:
            return adapter
        log.warning("adapter %s does not reproduce the chat template of %s (%s); using the "
                    "generic adapter, which renders with the template itself", adapter.name,
                    getattr(tokenizer, "name", "?"), reason)
        return self.adapter_class("generic", tokenizer)(tokenizer, **kwargs)


@lru_cache(maxsize=1)  # plugins are loaded once per process, like entry points themselves
def default_registry() -> AdapterRegistry:
    registry = AdapterRegistry()
    registry.load_entry_points()
    plugin_dir = os.environ.get(PLUGIN_DIR_ENV)
    if plugin_dir:
        registry.load_plugin_dir(plugin_dir)
    return registry


def get_adapter(name: str, tokenizer: Any, *, registry: AdapterRegistry | None = None,
                canonical_tools: bool = False) -> Adapter:
    """An adapter instance by name; "auto" picks by the tokenizer's template (and proves a
    mirror against it). `canonical_tools`: the adapter's default tool ordering (see
    normalize.py). Unknown names raise ValueError listing the valid ones."""
    return (registry or default_registry()).create(name, tokenizer,
                                                   canonical_tools=canonical_tools)


def available_adapters(registry: AdapterRegistry | None = None) -> list[str]:
    return ["auto", *(registry or default_registry()).names()]
