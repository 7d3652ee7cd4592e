"""pdserve: LLM serving with prefill and decode split into separate services."""

__version__ = "0.1.0"
