"""The proxy's tokenizers: `proxy/splitter/tokenizers.py` (the splitter stands alone and owns
tokenizer loading; the proxy imports it from here or from there, never the other way)."""

from .splitter.tokenizers import (
    NAMES,
    HarmonyTokenizerHandle,
    HFTokenizer,
    MistralTokenizerHandle,
    Tokenizer,
    load_hf_dir,
    load_tokenizer,
    o200k_dir,
)

__all__ = ["NAMES", "HFTokenizer", "HarmonyTokenizerHandle", "MistralTokenizerHandle",
           "Tokenizer", "load_hf_dir", "load_tokenizer", "o200k_dir"]
