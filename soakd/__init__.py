"""soakd: a soak-test daemon for OpenAI-compatible LLM inference servers."""

__version__ = "0.1.0"
