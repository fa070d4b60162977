"""anchorcache: a prefix-cache sidecar for LLM agent traffic (anchors + delta)."""

__version__ = "0.1.0"
