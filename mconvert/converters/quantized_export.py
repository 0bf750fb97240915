"""The export in a quantized source's own format (`mcore-to-hf --quantize as-source`): the tensors that the original
checkpoint (`--hf-config`) stores quantized are written so again, and config.json keeps the original's
quantization_config. Which tensors those are is read from the original's safetensors headers alone; each is quantized
as it is written. Three formats: block-quantized FP8 (`FP8Blocks`: each weight in float8_e4m3fn with the original's
block size and a `_scale_inv` beside it, `quantize_fp8_blocks`), compressed-tensors' pack-quantized INT4
(`PackedInt4`: each linear layer `M` as `M.weight_packed`, `M.weight_scale`, `M.weight_shape` and, asymmetric,
`M.weight_zero_point`, `quantize_int4` and `quantize_int4_asymmetric`) and
gpt-oss's MXFP4 (`MXFP4`: each expert tensor `X` as `X_blocks` and `X_scales`, `quantize_mxfp4`). All three
keep the original's own scale, read from it a tensor at a time, for each group (block) whose values are exactly
integers (e2m1, float8_e4m3fn values) times it, and so give back the original's bytes for what training left as it
was, whatever rule made its scales; the other groups are quantized afresh."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mconvert import dtypes
from mconvert.converters.plan import Plan
from mconvert.errors import ConversionError
from mconvert.formats.fp8_source import quantize_fp8_on_source
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.formats.int4_asymmetric import quantize_int4_asymmetric
from mconvert.formats.quantized import (
    COMPRESSED_TENSORS,
    MXFP4_BLOCKS,
    MXFP4_GROUP,
    MXFP4_SCALES,
    PACKED,
    SCALE,
    SCALE_SUFFIX,
    SHAPE,
    ZERO_POINT,
    fp8_block_size,
    pack_quantized,
    quantization_config,
    quantize_int4,
    quantize_mxfp4,
)
from mconvert.formats.safetensors import INDEX_FILE, SINGLE_FILE, Rows

AS_SOURCE, FP8_BLOCK, FP8_BLOCK_UE8M0 = "as-source", "fp8-block", "fp8-block-ue8m0"
QUANTIZE_CHOICES = (AS_SOURCE, FP8_BLOCK, FP8_BLOCK_UE8M0)
# `--quantize fp8-block`'s quantization_config: DeepSeek-V3's release's (Qwen3's FP8 releases state the same), which
# transformers' FineGrainedFP8Config and vLLM's Fp8Config read; modules_to_not_convert is added per export, and
# `scale_fmt: ue8m0` (DeepSeek-V3.1's and V3.2's power-of-two scales, stored here in fp32) for `fp8-block-ue8m0`.
FP8_BLOCK_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# A decoder layer's (or an MTP layer's) tensors, and a vision tower's, which keeps its dtype.
DECODER_LAYER, VISION = re.compile(r"^(.*\.)?layers\.\d+\."), re.compile(r"(^|\.)(visual|vision_tower|vision_model)\.")

Layout = dict[str, tuple[Any, tuple[int, ...]]]


def is_fp8_on_the_hub(name: str) -> bool:
    """Which weights DeepSeek-V3's and MiniMax-M2's hub checkpoints store block-quantized in FP8: the linear layers of
    attention and MLPs (experts included, MiniMax-M2's named w1, w2, w3); not embeddings, norms, routers or the output
    layer."""
    return name.endswith(("proj.weight", "proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


@dataclass(frozen=True)
class Unquantized:
    """The export's HF tensors as the plan gives them, and config.json without a quantization_config. Its
    subclasses write the tensors `names` quantized, with the original's `quantization` stated where the original's
    config.json states it (its text_config, as Kimi-K2.5's)."""

    quantization: dict[str, Any] = field(default_factory=dict)
    in_text_config: bool = False
    what = ""  # how the quantized tensors are written, as the CLI reports it

    @property
    def names(self) -> frozenset[str]:
        """The HF tensors written quantized: none here."""
        return frozenset()

    def stored(self, name: str, dtype: Any, shape: tuple[int, ...]) -> Layout:
        """What HF tensor `name` is written as: itself, or its quantized tensors in their file order."""
        return {name: (dtype, shape)}

    def held(self, name: str) -> str:
        """The first tensor written for HF tensor `name`: the writer's place of it (its file)."""
        return name

    def written(self, name: str, tensor: Any, index: int | None = None) -> list[tuple[str, Any]]:
        """What the writer writes for HF tensor `name` (or its slice `index` along the first axis): the tensor, or its
        quantized tensors (`quantized`)."""
        return self.quantized(name, dtypes.as_numpy(tensor), index) if name in self.names else [(name, tensor)]

    def quantized(self, name: str, values: np.ndarray, index: int | None) -> list[tuple[str, np.ndarray]]:
        raise NotImplementedError  # only the subclasses have `names`

    def layout(self, tensors: Layout, groups: list[list[str]]) -> tuple[Layout, list[list[str]]]:
        """The writer's tensors and file groups: each quantized tensor's parts together, in its file."""
        laid_out: Layout = {}
        for name, (dtype, shape) in tensors.items():
            laid_out.update(self.stored(name, dtype, shape) if name in self.names else {name: (dtype, shape)})
        together = [[n for name in group for n in (self.stored(name, *tensors[name]) if name in self.names else (name,))] for group in groups]
        return laid_out, together

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        """config.json with the original's quantization_config, where the export writes quantized tensors."""
        if not self.names:
            return config
        if self.in_text_config:
            return {**config, "text_config": {**config["text_config"], "quantization_config": self.quantization}}
        return {**config, "quantization_config": self.quantization}


@dataclass(frozen=True)
class FP8Blocks(Unquantized):
    """Block-quantized FP8: each tensor of `names` in float8_e4m3fn, its `_scale_inv` (one per `block`, partial blocks
    at the edges counted) right after it, in the dtype the `original` stores it in (fp32, or float8_e8m0fnu for
    power-of-two scales). `power_of_two` (`scale_fmt: ue8m0`): fresh scales rounded up to powers of two. A block
    whose values are exactly float8_e4m3fn values times the `original`'s scale keeps that scale (fp8_source)."""

    names: frozenset[str] = frozenset()
    block: tuple[int, int] = (128, 128)
    power_of_two: bool = False
    original: HFCheckpoint | None = field(default=None, compare=False, repr=False)
    what = "in FP8 blocks with their _scale_inv"

    def scale_dtype(self, name: str) -> np.dtype:
        return dtypes.float32 if self.original is None else self.original.scales[name][0].dtype

    def stored(self, name: str, dtype: Any, shape: tuple[int, ...]) -> Layout:
        grid = tuple(-(-size // step) for size, step in zip(shape[-2:], self.block))
        return {name: (dtypes.float8_e4m3fn, shape), name + SCALE_SUFFIX: (self.scale_dtype(name), (*shape[:-2], *grid))}

    def quantized(self, name: str, values: np.ndarray, index: int | None) -> list[tuple[str, np.ndarray]]:
        source = None if self.original is None else self.original.read_stored(self.original.scales[name][0], name + SCALE_SUFFIX, index)
        quantized, scales = quantize_fp8_on_source(values, self.block, source, self.power_of_two)
        return [(name, quantized), (name + SCALE_SUFFIX, scales.astype(self.scale_dtype(name)))]


@dataclass(frozen=True)
class PackedInt4(Unquantized):
    """compressed-tensors' pack-quantized INT4: each weight `M.weight` of `names` as `M.weight_packed` (int32, eight
    integers a word), `M.weight_scale` (one per `group_size` columns, None: one a row), `M.weight_shape` and, not
    `symmetric`, `M.weight_zero_point` (int32, eight a word down the rows), the scales and the shape in the dtypes
    the original stores them in (`stored_dtypes`: by weight name). A group whose values are exactly integers (less
    their zero point) times the `original`'s scale keeps that scale and zero point (quantize_int4's
    `source_scales`, quantize_int4_asymmetric's `source`)."""

    group_size: int | None = None
    stored_dtypes: dict[str, tuple[np.dtype, np.dtype]] = field(default_factory=dict)
    original: HFCheckpoint | None = field(default=None, compare=False, repr=False)
    symmetric: bool = True

    @property
    def what(self) -> str:  # type: ignore[override]
        parts = "weight_scale and weight_shape" if self.symmetric else "weight_scale, weight_shape and weight_zero_point"
        return f"pack-quantized in INT4 with their {parts}"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.stored_dtypes)

    def stored(self, name: str, dtype: Any, shape: tuple[int, ...]) -> Layout:
        module, (rows, columns) = name.removesuffix(".weight"), shape
        scale, size = self.stored_dtypes[name]
        groups = 1 if self.group_size is None else columns // self.group_size
        zeros = {} if self.symmetric else {f"{module}.{ZERO_POINT}": (np.dtype(np.int32), (-(-rows // 8), groups))}
        return {f"{module}.{PACKED}": (np.dtype(np.int32), (rows, -(-columns // 8))), f"{module}.{SCALE}": (scale, (rows, groups)), f"{module}.{SHAPE}": (size, (2,)), **zeros}

    def held(self, name: str) -> str:
        return f"{name.removesuffix('.weight')}.{PACKED}" if name in self.names else name

    def quantized(self, name: str, values: np.ndarray, index: int | None) -> list[tuple[str, np.ndarray]]:
        module, (scale, size) = name.removesuffix(".weight"), self.stored_dtypes[name]
        source = None if self.original is None else self.original.read(f"{module}.{SCALE}")
        shape = (f"{module}.{SHAPE}", np.array(values.shape, dtype=size))
        if self.symmetric:
            packed, scales = quantize_int4(values, self.group_size, scale, source)
            return [(f"{module}.{PACKED}", packed), (f"{module}.{SCALE}", scales), shape]
        given = None if source is None else (source, self.original.read(f"{module}.{ZERO_POINT}"))
        packed, scales, zeros = quantize_int4_asymmetric(values, self.group_size, scale, given)
        return [(f"{module}.{PACKED}", packed), (f"{module}.{SCALE}", scales), shape, (f"{module}.{ZERO_POINT}", zeros)]


@dataclass(frozen=True)
class MXFP4(Unquantized):
    """gpt-oss's MXFP4: each tensor `X` of `names` (transformers' [..., in, out] experts) as `X_blocks` (uint8 [..., out,
    in / 32, 16], two 4-bit floats a byte, the first in the low 4 bits) and `X_scales` (uint8 [..., out, in / 32], one
    exponent per 32 inputs, biased by 127), the layout that `dequantize_mxfp4` reads. A group whose values are
    exactly e2m1 values times the `original`'s scale keeps that scale (quantize_mxfp4's `source_exponents`)."""

    names: frozenset[str] = frozenset()
    original: HFCheckpoint | None = field(default=None, compare=False, repr=False)
    what = "in MXFP4 as _blocks and _scales"

    def stored(self, name: str, dtype: Any, shape: tuple[int, ...]) -> Layout:
        *lead, inputs, outputs = shape
        groups = inputs // MXFP4_GROUP
        return {name + MXFP4_BLOCKS: (dtypes.uint8, (*lead, outputs, groups, MXFP4_GROUP // 2)), name + MXFP4_SCALES: (dtypes.uint8, (*lead, outputs, groups))}

    def held(self, name: str) -> str:
        return name + MXFP4_BLOCKS if name in self.names else name

    def quantized(self, name: str, values: np.ndarray, index: int | None) -> list[tuple[str, np.ndarray]]:
        source = None if self.original is None else self.original.read_stored(self.original.mxfp4[name][1], name + MXFP4_SCALES, index)
        blocks, scales = quantize_mxfp4(dtypes.transposed(values), source)
        return [(name + MXFP4_BLOCKS, blocks), (name + MXFP4_SCALES, scales)]


def quantized_export(quantize: str | None, hf_config_dir: str | os.PathLike | None, reference: dict[str, Any] | None, plan: Plan) -> Unquantized:
    """How the export `plan` writes its tensors: with `quantize` "as-source", those that the original checkpoint in
    `hf_config_dir` (whose config.json is `reference`) stores quantized so again; unquantized without it."""
    if quantize is None:
        return Unquantized()
    if quantize not in QUANTIZE_CHOICES:
        raise ConversionError(f"--quantize {quantize}: not one of {', '.join(QUANTIZE_CHOICES)}")
    if quantize in (FP8_BLOCK, FP8_BLOCK_UE8M0):
        export: Unquantized = fp8_block(plan, power_of_two=quantize == FP8_BLOCK_UE8M0)
    else:
        export = as_source(quantize, hf_config_dir, reference, plan)
    for piece in plan.pieces:
        for ref in piece.sources:
            # A tensor written in sections of rows (a fused projection Megatron stores in parts) is never whole in
            # one place, and its blocks may straddle the sections; an INT4 weight's shape is written whole.
            if ref.name in export.names and (isinstance(ref.index, Rows) or isinstance(export, PackedInt4) and ref.index is not None):
                raise ConversionError(f"--quantize {quantize}: tensor '{ref.name}' is written in parts: quantizing it is not supported yet")
    return export


def as_source(quantize: str, hf_config_dir: str | os.PathLike | None, reference: dict[str, Any] | None, plan: Plan) -> Unquantized:
    """`--quantize as-source`: the tensors that the original in `hf_config_dir` stores quantized, in its format."""
    if hf_config_dir is None or reference is None:
        raise ConversionError(f"--quantize {quantize} needs --hf-config: the original checkpoint, whose quantized tensors are written so again")
    directory = Path(hf_config_dir)
    quantization = quantization_config(reference)
    method = quantization.get("quant_method")
    if method not in ("fp8", COMPRESSED_TENSORS, "mxfp4") or method == "fp8" and not quantization.get("weight_block_size"):
        what = f"quant_method {method}" if method else "not quantized (no quantization_config)"
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory} is {what}; only block-quantized FP8 (quant_method fp8 with a "
            "weight_block_size), compressed-tensors' pack-quantized INT4 and MXFP4 are written back, other formats are not supported yet"
        )
    if not any((directory / name).exists() for name in (INDEX_FILE, SINGLE_FILE)):
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory} has no {INDEX_FILE} or {SINGLE_FILE} telling which tensors "
            "are quantized: name the original checkpoint's directory"
        )
    return {"fp8": fp8_blocks, COMPRESSED_TENSORS: packed_int4, "mxfp4": mxfp4}[method](quantize, directory, reference, plan)


def fp8_block(plan: Plan, power_of_two: bool = False) -> FP8Blocks:
    """`--quantize fp8-block`: the linear layers of the export `plan`'s decoder (and MTP) layers, the weights that
    DeepSeek-V3's release stores in FP8 (`is_fp8_on_the_hub`: attention and MLP projections, experts), in 128 x 128
    blocks (partial blocks at the edges, as the release's kv_a_proj_with_mqa has, counted), quantized afresh; the rest
    in the export's dtype; `power_of_two` (`fp8-block-ue8m0`): the scales rounded up to powers of two, in fp32, as
    transformers and mconvert read them under `scale_fmt: ue8m0`. modules_to_not_convert names each other module with a matrix (lm_head, routers, a vision
    tower's): transformers' FineGrainedFP8 would otherwise make an FP8 layer of any nn.Linear but the output layer, and
    when given the list it adds nothing to it. A decoder layer's module is named by its name within the layer, which
    transformers matches as a suffix, in every layer."""
    shapes = plan.hf_shapes()
    names = frozenset(name for name, shape in shapes.items() if len(shape) == 2 and is_fp8_on_the_hub(name) and DECODER_LAYER.match(name) and not VISION.search(name))
    kept = {name.rsplit(".", 1)[0] for name, shape in shapes.items() if len(shape) >= 2 and name not in names}
    skipped = sorted({module if VISION.search(module) else DECODER_LAYER.sub("", module) for module in kept})
    quantization = {**FP8_BLOCK_CONFIG, **({"scale_fmt": "ue8m0"} if power_of_two else {}), "modules_to_not_convert": skipped}
    return FP8Blocks(quantization, False, names, tuple(FP8_BLOCK_CONFIG["weight_block_size"]), power_of_two)


def fp8_blocks(quantize: str, directory: Path, reference: dict[str, Any], plan: Plan) -> FP8Blocks:
    """The tensors of the export `plan` that the FP8 original in `directory` stores in blocks, with its block size."""
    quantization = quantization_config(reference)
    power_of_two = quantization.get("scale_fmt") == "ue8m0"
    if quantization.get("scale_fmt") not in (None, "float", "ue8m0"):
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory} has scale_fmt {quantization['scale_fmt']}: not supported "
            "(float and ue8m0, power-of-two scales, are)"
        )
    block = fp8_block_size(reference)
    original = HFCheckpoint(directory, fp8_block=block, check_finite=False)  # headers only
    shapes = plan.hf_shapes()
    scale_dtypes = (dtypes.float32, dtypes.float8_e8m0fnu) if power_of_two else (dtypes.float32,)
    for name, (scale, _) in original.scales.items():
        stored = original.tensors[name]
        if stored.dtype != dtypes.float8_e4m3fn or scale.dtype not in scale_dtypes:
            raise ConversionError(
                f"--quantize {quantize}: {original.where(name)} is {stored.dtype.name} with {scale.dtype.name} block scales: "
                f"only float8_e4m3fn with {' or '.join(d.name for d in scale_dtypes)} scales is written back"
                + ("" if power_of_two else " without scale_fmt ue8m0")
            )
        if name in shapes and tuple(stored.shape) != tuple(shapes[name]):
            raise ConversionError(f"--quantize {quantize}: {original.where(name)} has shape {list(stored.shape)}, the export's {list(shapes[name])}")
    names = frozenset(original.scales) & shapes.keys()
    return FP8Blocks(quantization, "quantization_config" not in reference, names, block, power_of_two, original)


def packed_int4(quantize: str, directory: Path, reference: dict[str, Any], plan: Plan) -> PackedInt4:
    """The weights of the export `plan` that the INT4 original in `directory` stores packed (its `*.weight_packed`),
    with its scheme, and the dtypes of their scales and shapes."""
    scheme = pack_quantized(reference)  # an error for any scheme but 4-bit integer weights in groups or rows
    original = HFCheckpoint(directory, check_finite=False)  # headers only: the packed tensors stand as stored
    shapes, found = plan.hf_shapes(), {}
    for module in [name.removesuffix("." + PACKED) for name in original.tensors if name.endswith("." + PACKED)]:
        name, packed = f"{module}.weight", original.tensors[f"{module}.{PACKED}"]
        scale, size = original.tensors.get(f"{module}.{SCALE}"), original.tensors.get(f"{module}.{SHAPE}")
        if name not in shapes:
            continue
        rows, columns = shapes[name]
        groups = 1 if scheme.group_size is None else columns // scheme.group_size
        zeros = original.tensors.get(f"{module}.{ZERO_POINT}")
        fits = zeros is None if scheme.symmetric else zeros is not None and (zeros.dtype, zeros.shape) == (np.int32, (-(-rows // 8), groups))
        if not fits or scale is None or size is None or (packed.shape, scale.shape) != ((rows, -(-columns // 8)), (rows, groups)) or packed.dtype != np.int32:
            zero_points = "no zero points" if scheme.symmetric else f"a {module}.{ZERO_POINT} of {groups} packed int32 a word of rows"
            raise ConversionError(
                f"--quantize {quantize}: {original.where(f'{module}.{PACKED}')} is not the export's {name} {[rows, columns]} "
                f"packed, with a {module}.{SCALE} of {groups} scales a row, a {module}.{SHAPE} and {zero_points}"
            )
        found[name] = (scale.dtype, size.dtype)
    quantization = quantization_config(reference)
    return PackedInt4(quantization, "quantization_config" not in reference, scheme.group_size, found, original, scheme.symmetric)


def mxfp4(quantize: str, directory: Path, reference: dict[str, Any], plan: Plan) -> MXFP4:
    """The tensors of the export `plan` that the MXFP4 original in `directory` stores as blocks and scales (its
    `*_blocks`), each of the export's shape."""
    original = HFCheckpoint(directory, check_finite=False, mxfp4=True)  # headers only
    shapes = plan.hf_shapes()
    for name, (blocks, _) in original.mxfp4.items():
        if name in shapes and tuple(original.tensors[name].shape) != tuple(shapes[name]):
            raise ConversionError(
                f"--quantize {quantize}: tensor '{name + MXFP4_BLOCKS}' in {blocks.file} holds MXFP4 values of shape "
                f"{list(original.tensors[name].shape)}, the export's {name} is {list(shapes[name])}"
            )
    names = frozenset(original.mxfp4) & shapes.keys()
    if not names:
        raise ConversionError(
            f"--quantize {quantize}: --hf-config {directory}'s quantization_config names MXFP4, but it stores no tensor of "
            f"the export as MXFP4 (no *{MXFP4_BLOCKS} of {', '.join(sorted(shapes)[:2])}, ...)"
        )
    return MXFP4(quantization_config(reference), "quantization_config" not in reference, names, original)
