"""The path docs/api.md imported `HFCheckpoint` from before the package was split by concern, kept so that code
written against it keeps working. Its home is mconvert.formats.hf_checkpoint."""

from mconvert.formats.hf_checkpoint import HFCheckpoint

__all__ = ["HFCheckpoint"]
