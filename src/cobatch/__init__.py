"""cobatch: a batched-decode LLM server for GGUF models."""

__version__ = "0.1.0"
