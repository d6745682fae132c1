"""kvserve: LLM inference over gRPC with the KV cache in a process of its own (memsvc)."""

__version__ = "0.1.0"
