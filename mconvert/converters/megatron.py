"""The path docs/api.md imported `Parallelism` from before the package was split by concern, kept so that code
written against it keeps working. Its home is mconvert.mcore.parallelism."""

from mconvert.mcore.parallelism import Parallelism, PipelineSplit

__all__ = ["Parallelism", "PipelineSplit"]
