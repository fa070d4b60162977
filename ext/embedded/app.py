"""Builds the embedded worker: load the model, start the engine, serve the contract."""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from anchorcache.defaults import ANCHOR_BYTES, ANCHOR_SLOTS, PINNED_SLOTS
from anchorcache.wire import ModelInfo, check_secret

from . import server
from .backend import EmbeddedBackend
from .engine import Engine
from .model_store import resolve_model

log = logging.getLogger("anchorcache.worker")


@dataclass(frozen=True)
class WorkerConfig:
    model: str | None = None  # a local HF model dir; None: the default SmolLM2
    threads: int | None = None  # torch intra-op threads; None: torch's default
    dtype: str = "float32"
    max_context_tokens: int | None = None  # None: the model config's max_position_embeddings
    anchors: bool = True  # keep an anchor store (the proxy decides per request whether to use it)
    anchor_slots: int = ANCHOR_SLOTS
    anchor_capacity_bytes: int = ANCHOR_BYTES
    pinned_slots: int = PINNED_SLOTS  # the thin region: toolsets' instruction and tool anchors
    anchor_disk_dir: str | None = None  # the disk tier's directory; None: no disk tier
    anchor_disk_bytes: int | None = None  # its budget; None: a share of free disk; 0: off
    fault_injection: bool = False  # expose POST /debug/fault (tests inject worker faults)
    prefill_chunk_tokens: int = 1024  # longest prefill forward; an abort waits at most one
    secret: str | None = None  # the worker secret every call but /health must carry

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, not {self.dtype!r}")
        if self.anchor_slots < 1 or not 0 <= self.pinned_slots < self.anchor_slots:
            raise ValueError("need anchor_slots >= 1 and 0 <= pinned_slots < anchor_slots")
        if self.anchor_capacity_bytes < 1:
            raise ValueError("anchor_capacity_bytes must be positive")
        if self.anchor_disk_bytes is not None and self.anchor_disk_bytes < 0:
            raise ValueError("anchor_disk_bytes must be 0 (off) or positive")
        if self.prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be positive")
        check_secret(self.secret, "worker secret")


def _eos_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def _vocab_size(model: Any) -> int:
    """Rows of the input embedding (a transformers model): every input id must be below it."""
    embeddings = model.get_input_embeddings()
    assert isinstance(embeddings, torch.nn.Embedding), type(embeddings)
    return int(embeddings.num_embeddings)


def _disk_tier(config: WorkerConfig, path: Path, spec: Any) -> Any:
    """The disk tier (ext/disk_tier.py) the config asks for, its directory indexed; None
    when it asks for none."""
    if config.anchor_disk_dir is None or config.anchor_disk_bytes == 0:
        return None
    from anchorcache.ext.disk_tier import DiskTier, default_budget_bytes, model_fingerprint

    budget = config.anchor_disk_bytes or default_budget_bytes(config.anchor_disk_dir)
    # the slab layout is part of the identity: another dtype or cache shape is another tier
    fingerprint = model_fingerprint(path, config.dtype, spec.kv_dtype, spec.kv_layers,
                                    spec.num_kv_heads, spec.head_dim, spec.state_bytes)
    disk = DiskTier(config.anchor_disk_dir, fingerprint, budget_bytes=budget)
    n = disk.index()
    log.info("disk tier %s: %d anchors indexed, budget %d bytes", disk.dir, n, budget)
    return disk


def load_engine(config: WorkerConfig) -> tuple[Engine, ModelInfo]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import cache_io

    path: Path = resolve_model(config.model)
    if config.threads:
        torch.set_num_threads(config.threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, config.dtype))
    model.eval()
    spec = cache_io.CacheSpec.from_model(model)
    max_ctx = config.max_context_tokens or int(getattr(model.config, "max_position_embeddings", 0) or 8192)
    info = ModelInfo(
        model_id=path.name, model_path=str(path), tokenizer_path=str(path),
        architecture=model.config.architectures[0] if model.config.architectures else type(model).__name__,
        max_context_tokens=max_ctx, eos_token_ids=_eos_ids(model, tokenizer),
        hybrid=bool(spec.state_layers),
        vocab_size=_vocab_size(model), backend="embedded",
    )
    anchors = None
    if config.anchors:
        from .anchors import EmbeddedAnchors

        anchors = EmbeddedAnchors.create(model, info.model_id, spec, num_slots=config.anchor_slots,
                                     capacity_bytes=config.anchor_capacity_bytes,
                                     pinned_slots=config.pinned_slots,
                                     disk=_disk_tier(config, path, spec))
    from .grammar import Grammars

    vocab_size = int(model.get_output_embeddings().weight.shape[0])  # the logits' width
    engine = Engine(model, eos_token_ids=info.eos_token_ids, recurrent=spec.is_recurrent,
                    anchors=anchors,
                    prefill_chunk_tokens=config.prefill_chunk_tokens,
                    grammars=Grammars(tokenizer, vocab_size), spec=spec)
    return engine, info


def create_app(config: WorkerConfig, *, engine: Engine | None = None,
               info: ModelInfo | None = None) -> web.Application:
    """The worker app. Pass a loaded `engine`/`info` to share one model between apps (tests)."""
    app = web.Application(middlewares=[server.auth_middleware(config.secret),
                                       server.error_middleware], client_max_size=256 << 20)
    app[server.EPOCH] = secrets.token_hex(8)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        nonlocal engine, info
        if engine is None or info is None:
            engine, info = load_engine(config)
        app[server.BACKEND] = EmbeddedBackend(engine, info, app[server.EPOCH])
        engine.start()
        log.info("worker ready: %s (epoch %s)", info.model_id, app[server.EPOCH])
        yield
        engine.stop()
        if engine.anchors is not None and engine.anchors.disk is not None:
            engine.anchors.disk.close()  # queued writes land before the process ends

    app.cleanup_ctx.append(lifecycle)
    server.add_routes(app, fault_injection=config.fault_injection)
    return app
