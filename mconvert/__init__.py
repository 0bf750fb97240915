"""HuggingFace <-> Megatron-Core checkpoint conversion."""

__version__ = "0.1.0"
