"""The export in an FP8 source's own format (`mcore-to-hf --quantize as-source`): the tensors that the original
checkpoint (`--hf-config`) stores block-quantized in FP8 are written so again, each with the original's block size
and a `_scale_inv` beside it, and config.json keeps the original's quantization_config. Which tensors those are is
read from the original's safetensors headers alone; each is quantized as it is written (`quantize_fp8_blocks`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mconvert import dtypes
from mconvert.converters.plan import Plan
from mconvert.errors import ConversionError
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.formats.quantized import SCALE_SUFFIX, fp8_block_size, quantization_config, quantize_fp8_blocks
from mconvert.formats.safetensors import INDEX_FILE, SINGLE_FILE, Rows

AS_SOURCE = "as-source"
QUANTIZE_CHOICES = (AS_SOURCE,)

Layout = dict[str, tuple[Any, tuple[int, ...]]]


@dataclass(frozen=True)
class FP8Blocks:
    """The HF tensors written block-quantized (none: the export is unquantized), their block size, and the
    quantization_config that config.json states, at the place where the original's config.json states it."""

    names: frozenset[str] = frozenset()
    block: tuple[int, int] = (128, 128)
    quantization: dict[str, Any] = field(default_factory=dict)
    in_text_config: bool = False

    def layout(self, tensors: Layout, groups: list[list[str]]) -> tuple[Layout, list[list[str]]]:
        """The writer's tensors and file groups: each quantized tensor in float8_e4m3fn, its `_scale_inv` (fp32, one
        per block, partial blocks at the edges counted) right after it, in its file."""
        laid_out: Layout = {}
        for name, (dtype, shape) in tensors.items():
            if name not in self.names:
                laid_out[name] = (dtype, shape)
                continue
            grid = tuple(-(-size // step) for size, step in zip(shape[-2:], self.block))
            laid_out[name] = (dtypes.float8_e4m3fn, shape)
            laid_out[name + SCALE_SUFFIX] = (dtypes.float32, (*shape[:-2], *grid))
        together = [[n for name in group for n in ((name, name + SCALE_SUFFIX) if name in self.names else (name,))] for group in groups]
        return laid_out, together

    def written(self, name: str, tensor: Any) -> list[tuple[str, Any]]:
        """What the writer writes for HF tensor `name` (or a slice of its first axis): the tensor, or its FP8
        blocks and their scales."""
        if name not in self.names:
            return [(name, tensor)]
        quantized, scales = quantize_fp8_blocks(dtypes.as_numpy(tensor), self.block)
        return [(name, quantized), (name + SCALE_SUFFIX, scales)]

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        """config.json with the original's quantization_config, where the export writes quantized tensors."""
        if not self.names:
            return config
        if self.in_text_config:
            return {**config, "text_config": {**config["text_config"], "quantization_config": self.quantization}}
        return {**config, "quantization_config": self.quantization}


def fp8_blocks(quantize: str | None, hf_config_dir: str | os.PathLike | None, reference: dict[str, Any] | None, plan: Plan) -> FP8Blocks:
    """The tensors of the export `plan` to write in FP8 blocks: with `quantize` "as-source", those that the
    original checkpoint in `hf_config_dir` (whose config.json is `reference`) stores so; none without it."""
    if quantize is None:
        return FP8Blocks()
    if quantize not in QUANTIZE_CHOICES:
        raise ConversionError(f"--quantize {quantize}: not one of {', '.join(QUANTIZE_CHOICES)}")
    if hf_config_dir is None or reference is None:
        raise ConversionError(f"--quantize {quantize} needs --hf-config: the original checkpoint, whose FP8 tensors are written so again")
    directory = Path(hf_config_dir)
    quantization = quantization_config(reference)
    method = quantization.get("quant_method")
    if method != "fp8" or not quantization.get("weight_block_size"):
        what = f"quant_method {method}" if method else "not quantized (no quantization_config)"
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory} is {what}; only block-quantized FP8 (quant_method fp8 with a "
            "weight_block_size) is written back, other formats are not supported yet"
        )
    if quantization.get("scale_fmt") is not None:
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory} has scale_fmt {quantization['scale_fmt']} (power-of-two "
            "scales): not supported yet, only fp32 block scales are written back"
        )
    if not any((directory / name).exists() for name in (INDEX_FILE, SINGLE_FILE)):
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory} has no {INDEX_FILE} or {SINGLE_FILE} telling which tensors "
            "are FP8: name the original checkpoint's directory"
        )
    block = fp8_block_size(reference)
    original = HFCheckpoint(directory, fp8_block=block, check_finite=False)  # headers only
    shapes = plan.hf_shapes()
    for name, (scale, _) in original.scales.items():
        stored = original.tensors[name]
        if (stored.dtype, scale.dtype) != (dtypes.float8_e4m3fn, dtypes.float32):
            raise ConversionError(
                f"--quantize {quantize}: {original.where(name)} is {stored.dtype.name} with {scale.dtype.name} block scales: "
                "only float8_e4m3fn with fp32 scales is written back yet"
            )
        if name in shapes and tuple(stored.shape) != tuple(shapes[name]):
            raise ConversionError(f"--quantize {quantize}: {original.where(name)} has shape {list(stored.shape)}, the export's {list(shapes[name])}")
    names = frozenset(original.scales) & shapes.keys()
    for piece in plan.pieces:
        for ref in piece.sources:
            # A tensor written in sections of rows (a fused projection Megatron stores in parts) is never whole in
            # one place, and its blocks may straddle the sections.
            if ref.name in names and isinstance(ref.index, Rows):
                raise ConversionError(f"--quantize {quantize}: tensor '{ref.name}' is written in sections of rows: quantizing it is not supported yet")
    return FP8Blocks(names, block, quantization, in_text_config="quantization_config" not in reference)
