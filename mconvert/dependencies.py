"""What a command needs beyond a conversion-only install (`pip install .`: safetensors, numpy, ml_dtypes), checked
before it is used, so that a missing or too old package is a one-line error naming what to install rather than
an ImportError (or a TypeError from an API that changed) deep inside."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from dataclasses import dataclass

from mconvert.errors import MissingDependency


@dataclass(frozen=True)
class Requirement:
    distribution: str  # the name pip installs
    module: str  # the name Python imports
    minimum: str  # the oldest release with everything mconvert uses of it


# The `verify` extra of pyproject.toml (a test keeps the two equal). transformers: `from_pretrained(dtype=)`
# came in 4.56 (older ones ignore it and load fp32), after every family's model class (Qwen3 and Qwen3-MoE,
# the newest, in 4.51), so one minimum covers all families.
VERIFY = (
    Requirement("torch", "torch", "2.4"), Requirement("megatron-core", "megatron.core", "0.13"),
    Requirement("transformers", "transformers", "4.56"),
)
VERIFY_INSTALL = "pip install 'mconvert[verify]'"
# megatron-core's Mamba layers (Nemotron-H's) refuse to build without mamba_ssm and einops. The package index has
# mamba_ssm as a source distribution only; built without its CUDA extension, it serves CPU ranks (mconvert.verify.mamba).
MAMBA = (Requirement("mamba_ssm", "mamba_ssm", "2.0"), Requirement("einops", "einops", "0.6"))
MAMBA_INSTALL = "MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE pip install --no-build-isolation mamba_ssm einops"
# transformers loads FP8 checkpoints (DeepSeek-V3's, MiniMax-M2's) only with accelerate installed, even to dequantize
# them; the `verify` extra has it too.
ACCELERATE = Requirement("accelerate", "accelerate", "1.0")
# A Megatron-Bridge adapter save's settings are in its run_config.yaml (adapter-to-hf).
ADAPTERS = (Requirement("pyyaml", "yaml", "5.1"),)
ADAPTERS_INSTALL = "pip install 'mconvert[adapters]'"
# transformers dequantizes compressed-tensors' INT4 checkpoints (Kimi-K2-Thinking's) through compressed-tensors.
COMPRESSED_TENSORS = Requirement("compressed-tensors", "compressed_tensors", "0.20")


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: '4.56.0.dev0' -> (4, 56, 0)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0].split("rc")[0].split(".dev")[0])[:3])


def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # its parent package is missing (or refuses to import)
        return False


def problems(requirements: tuple[Requirement, ...]) -> list[str]:
    """What is wrong with the installed packages for `requirements`, one phrase each; empty when nothing."""
    found = []
    for requirement in requirements:
        wanted = f"{requirement.distribution}>={requirement.minimum}"
        if not importable(requirement.module):
            found.append(f"{wanted} (not installed)")
            continue
        try:
            version = importlib.metadata.version(requirement.distribution)
        except importlib.metadata.PackageNotFoundError:
            continue  # importable from a source checkout: no version to compare
        if release(version) < release(requirement.minimum):
            found.append(f"{wanted} ({version} is installed)")
    return found


def require(requirements: tuple[Requirement, ...], command: str, install: str) -> None:
    """Raise MissingDependency naming every unmet requirement of `command` and how to install them."""
    unmet = problems(requirements)
    if unmet:
        raise MissingDependency(f"{command} needs {' and '.join(unmet)}: {install}")
