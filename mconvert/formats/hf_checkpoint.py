"""An HF model directory's weights, read lazily: `model.safetensors`, or the shards its index lists, one tensor
(or one slice of its first axis) at a time. Reading with plain file reads into a fresh buffer, rather than
through a memory map, keeps the process's resident memory at the tensors in hand, whatever the checkpoint's
size. FP8 block-quantized, MXFP4 and pack-quantized INT4 weights read dequantized (mconvert.formats.quantized); with `check_finite`,
a floating-point tensor holding NaN or Inf is an error naming it."""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path

import numpy as np

from mconvert import dtypes
from mconvert.errors import ConversionError
from mconvert.formats.quantized import (
    FP8_DTYPES,
    MXFP4_BLOCKS,
    MXFP4_SCALES,
    PACKED,
    SCALE,
    SCALE_SUFFIX,
    SHAPE,
    ZERO_POINT,
    PackQuantized,
    dequantize_fp8_blocks,
    dequantize_int4,
    dequantize_mxfp4,
)
from mconvert.formats.safetensors import INDEX_FILE, SINGLE_FILE, Part, Rows, StoredTensor, read_header
from mconvert.json_files import read_json_bytes, read_weight_map


def read_hf_config(directory: Path, flag: str) -> dict:
    """config.json of an HF model directory given by `flag`."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise ConversionError(f"{flag} {directory}: no config.json (not an HF model directory)")
    try:
        config = json.loads(read_json_bytes(path))
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than Python's stack allows
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: holds a JSON {type(config).__name__}, not an object of settings")
    return config


def _region_of(stored: StoredTensor, index: int | None) -> tuple[StoredTensor, int, tuple[int, ...], int]:
    """Where a stored tensor (or its slice `index` along the first axis) is: its entry, first byte, shape, length."""
    begin, shape = stored.begin, stored.shape
    if index is not None:
        row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
        begin, shape = begin + index * row_bytes, shape[1:]
    return stored, begin, tuple(shape), math.prod(shape) * stored.dtype.itemsize


class HFCheckpoint:
    """The tensors of an HF checkpoint directory: `model.safetensors`, or shards listed by the index.
    With `check_finite`, reading a floating-point tensor that holds NaN or Inf is an error naming it."""

    def __init__(
        self, directory: str | os.PathLike, fp8_block: tuple[int, int] | None = None, check_finite: bool = True, mxfp4: bool = False,
        int4: PackQuantized | None = None,
    ):
        """`fp8_block`: the block size of FP8 weights' scales (config.json's quantization_config, see
        fp8_block_size); FP8 weights are read dequantized. `mxfp4`: the config names MXFP4 weights (is_mxfp4),
        read dequantized under their own names. `int4`: the pack-quantized INT4 weights the config names
        (pack_quantized), read dequantized as `<module>.weight`; without it their tensors stand as stored.
        `check_finite`: a weight holding NaN or Inf is an error."""
        self.directory = Path(directory)
        self.check_finite = check_finite
        index = self.directory / INDEX_FILE
        if index.exists():
            weight_map = read_weight_map(index)
            files = sorted(set(weight_map.values()))
        elif (self.directory / SINGLE_FILE).exists():
            weight_map, files = {}, [SINGLE_FILE]
        else:
            files, weight_map = sorted(p.name for p in self.directory.glob("*.safetensors")), {}
            if not files:
                pickled = sorted(p.name for p in self.directory.glob("*.bin"))
                hint = f" ({pickled[0]} is pickled torch weights: save the model as safetensors first)" if pickled else ""
                raise ConversionError(f"{self.directory}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files{hint}")
        self.tensors: dict[str, StoredTensor] = {}
        for file in files:
            path = self.directory / file
            if not path.exists():
                raise ConversionError(f"{path}: shard named in {INDEX_FILE} is missing")
            for name, stored in read_header(path).items():
                if name in self.tensors:
                    raise ConversionError(f"{path}: tensor '{name}' is also in {self.tensors[name].file.name}")
                self.tensors[name] = stored
        for name, file in weight_map.items():
            if name not in self.tensors or self.tensors[name].file.name != file:
                raise ConversionError(f"{self.directory / file}: tensor '{name}' listed in {INDEX_FILE} is not there")
        self.scales = self._take_block_scales(fp8_block)
        self.mxfp4 = self._take_mxfp4() if mxfp4 else {}
        self.int4 = self._take_int4(int4) if int4 is not None else {}

    def _take_block_scales(self, block: tuple[int, int] | None) -> dict[str, tuple[StoredTensor, tuple[int, int]]]:
        """FP8 weights' block scales, by weight name, with the block size, taken out of `tensors`: FP8 weights
        read as their dequantized values, so the checkpoint's tensors are what an unquantized one holds."""
        scales = {}
        for name in [n for n, stored in self.tensors.items() if stored.dtype in FP8_DTYPES]:
            stored, scale = self.tensors[name], self.tensors.get(name + SCALE_SUFFIX)
            if scale is None or len(stored.shape) < 2 or len(scale.shape) != len(stored.shape):
                raise ConversionError(
                    f"{self.where(name)} is FP8 without a {name + SCALE_SUFFIX} of one scale per 2-D block "
                    f"(block-quantized FP8, as DeepSeek-V3's, is supported)"
                )
            if block is None:
                raise ConversionError(f"{self.where(name)} is FP8 but config.json's quantization_config names no weight_block_size")
            grid = tuple(-(-size // step) for size, step in zip(stored.shape[-2:], block))
            if stored.shape[:-2] != scale.shape[:-2] or grid != scale.shape[-2:]:
                raise ConversionError(
                    f"{self.where(name + SCALE_SUFFIX)} has shape {list(scale.shape)}, not the grid of "
                    f"{list(block)} blocks of {list(stored.shape)}"
                )
            scales[name] = (scale, block)
            del self.tensors[name + SCALE_SUFFIX]
        return scales

    def _take_mxfp4(self) -> dict[str, tuple[StoredTensor, StoredTensor]]:
        """MXFP4 weights' blocks and scales, by weight name, taken out of `tensors`, where each weight stands as what
        transformers dequantizes them into: bf16, its last two axes swapped (gpt-oss's [in, out] experts)."""
        packed = {}
        for name in [n.removesuffix(MXFP4_BLOCKS) for n in self.tensors if n.endswith(MXFP4_BLOCKS)]:
            blocks, scales = self.tensors.pop(name + MXFP4_BLOCKS), self.tensors.pop(name + MXFP4_SCALES, None)
            if scales is None or blocks.dtype != dtypes.uint8 or scales.shape != blocks.shape[:-1] or blocks.shape[-1] != 16:
                raise ConversionError(
                    f"tensor '{name + MXFP4_BLOCKS}' in {blocks.file} is not MXFP4 ([..., groups, 16] bytes with a "
                    f"{name + MXFP4_SCALES} of one exponent per group)"
                )
            *lead, rows, groups, _ = blocks.shape
            self.tensors[name] = StoredTensor(blocks.file, dtypes.bfloat16, (*lead, groups * 32, rows), blocks.begin, blocks.end)
            packed[name] = (blocks, scales)
        return packed

    def _take_int4(self, scheme: PackQuantized) -> dict[str, tuple[StoredTensor, StoredTensor, StoredTensor | None]]:
        """Pack-quantized INT4 weights' integers, scales and zero points, by weight name, taken out of `tensors`, where
        each weight `M.weight` stands as its dequantized values: its scales' dtype, `M.weight_shape`'s shape. Which
        weights are packed is the checkpoint's to say (`M.weight_packed`); the config's scheme must agree: a packed
        module that its `ignore` list names, or its `targets` do not, is an error, as are scales or zero points of
        another layout than the scheme's."""
        modules = [name.removesuffix("." + PACKED) for name in self.tensors if name.endswith("." + PACKED)]
        if not modules:
            raise ConversionError(
                f"{self.directory}: config.json's quantization_config names pack-quantized INT4 weights, but no tensor is stored so (no *.{PACKED})"
            )
        shapes = self._weight_shapes(modules)
        packed = {}
        for module in modules:
            name, stored = f"{module}.weight", self.tensors.pop(f"{module}.{PACKED}")
            where = f"tensor '{module}.{PACKED}' in {stored.file}"
            if (pattern := scheme.ignored_by(module)) is not None or not scheme.targets_module(module):
                why = f"ignores it ('{pattern}')" if pattern is not None else f"targets {list(scheme.targets)}, not it"
                raise ConversionError(f"{where} is packed INT4, but config.json's quantization_config {why}")
            if name in self.tensors:
                raise ConversionError(f"{where} is packed INT4 beside an unquantized {name}")
            scale, zero = self.tensors.pop(f"{module}.{SCALE}", None), self.tensors.pop(f"{module}.{ZERO_POINT}", None)
            rows, columns = shape = shapes[module]
            groups = 1 if scheme.group_size is None else columns // scheme.group_size
            fits = stored.dtype == np.int32 and stored.shape == (rows, -(-columns // 8)) and (scheme.group_size is None or columns % scheme.group_size == 0)
            fits &= scale is not None and scale.shape == (rows, groups) and dtypes.is_floating(scale.dtype) and scale.dtype.itemsize > 1
            if not fits or (zero is None) != scheme.symmetric or zero is not None and (zero.dtype != np.int32 or zero.shape != (-(-rows // 8), groups)):
                per = "a row" if scheme.group_size is None else f"{scheme.group_size} columns"
                zeros = " and no zero points (symmetric)" if scheme.symmetric else f" and a {module}.{ZERO_POINT} of one packed zero point each"
                raise ConversionError(
                    f"{where} is not pack-quantized INT4 of {module}.{SHAPE} {list(shape)} with a {module}.{SCALE} of one "
                    f"scale per {per}{zeros}, as config.json's quantization_config says"
                )
            self.tensors[name] = StoredTensor(stored.file, scale.dtype, shape, stored.begin, stored.end)
            packed[name] = (stored, scale, zero)
        return packed

    def _weight_shapes(self, modules: list[str]) -> dict[str, tuple[int, int]]:
        """Each packed module's `weight_shape` (its weight's rows and columns), taken out of `tensors` and read, each
        file opened once (Kimi-K2 has 70,272 of them)."""
        by_file: dict[Path, list[tuple[str, StoredTensor]]] = {}
        for module in modules:
            stored = self.tensors.pop(f"{module}.{SHAPE}", None)
            if stored is None or stored.dtype.kind != "i" or stored.shape != (2,):
                where = f"tensor '{module}.{PACKED}' in {self.tensors[f'{module}.{PACKED}'].file}"
                raise ConversionError(f"{where} has no {module}.{SHAPE} of two integers (its weight's shape)")
            by_file.setdefault(stored.file, []).append((module, stored))
        shapes = {}
        for path, entries in by_file.items():
            with open(path, "rb", buffering=0) as f:
                for module, stored in entries:
                    data = os.pread(f.fileno(), stored.end - stored.begin, stored.begin)
                    shape = tuple(int(v) for v in np.frombuffer(data, dtype=stored.dtype.newbyteorder("<"))) if len(data) == stored.end - stored.begin else ()
                    if len(shape) != 2 or min(shape) < 1:
                        raise ConversionError(f"{path}: tensor '{module}.{SHAPE}' holds {list(shape)}, not a weight's two sizes")
                    shapes[module] = shape
        return shapes

    def quantized(self, name: str) -> bool:
        """Whether the tensor `name` is stored quantized (read dequantized, never copied as its bytes)."""
        return name in self.scales or name in self.mxfp4 or name in self.int4

    def where(self, name: str) -> str:
        return f"tensor '{name}' in {self.tensors[name].file}"

    def _region(self, name: str, index: int | None) -> tuple[StoredTensor, int, tuple[int, ...], int]:
        """Where the tensor `name` (or its slice `index`) is: its file's entry, first byte, shape and length."""
        return _region_of(self.tensors[name], index)

    def nbytes(self, name: str, index: Part = None) -> int:
        if isinstance(index, Rows):
            stored = self.tensors[name]
            return math.prod(index.shape(stored.shape)) * stored.dtype.itemsize
        return self._region(name, index)[3]

    def place(self, name: str, index: int | None = None) -> tuple[Path, int, tuple[int, ...], np.dtype]:
        """Where the tensor `name` (or its slice `index`) is stored: file, first byte, shape and dtype."""
        stored, begin, shape, _ = self._region(name, index)
        return stored.file, begin, tuple(shape), stored.dtype

    def read(self, name: str, index: Part = None, into: np.ndarray | None = None, dtype: np.dtype | None = None) -> np.ndarray:
        """The tensor `name`, or its slice `index` along the first axis (one expert of a fused expert tensor), as a
        numpy array read into the start of `into` (a uint8 array of at least its bytes, to reuse memory) or fresh memory;
        or some of its rows (`Rows`: a section of a fused projection), each group's run of them read where it lies
        (an FP8 weight's whole, its scales being per block). An MXFP4 weight is a view of its
        dequantized transpose (gpt-oss stores [out, in], transformers' tensors are [in, out]). An FP8 weight comes in
        fp32, or in `dtype` where given (its fp32 values rounded once to it, a slice at a time: no fp32 tensor held)."""
        if isinstance(index, Rows) and self.quantized(name):
            return np.ascontiguousarray(index.select(self.read(name, dtype=dtype)))
        if name in self.int4:  # a linear layer's 2-D weight, read whole (a slice `index` of it is cut from it)
            tensor = self._dequantize_int4(name, into)
            tensor = tensor if index is None else np.ascontiguousarray(tensor[index])
            if self.check_finite and not dtypes.finite(tensor):
                raise self._nonfinite(name, index)
            return tensor
        if name in self.mxfp4:
            blocks, scales = (self.read_stored(stored, name, index) for stored in self.mxfp4[name])
            tensor = dequantize_mxfp4(blocks, scales)
            if self.check_finite and not dtypes.finite(tensor):
                raise self._nonfinite(name, index)
            # A view: the mapping's transposition back to [out, in] (dtypes.transposed) then copies nothing.
            return tensor.swapaxes(-1, -2)
        if isinstance(index, Rows):
            stored = self.tensors[name]
            shape = index.shape(stored.shape)
            runs = [(stored.begin + first, count) for first, count in index.runs(stored.shape, stored.dtype.itemsize)]
        else:
            stored, begin, shape, length = self._region(name, index)
            runs = [(begin, length)]
        tensor = self._read_runs(stored, name, runs, shape, into)
        if name in self.scales:
            tensor = self._dequantize(name, index, tensor, dtype or dtypes.float32)
        if self.check_finite and not dtypes.finite(tensor):
            raise self._nonfinite(name, index)
        return tensor

    def check(self, name: str, index: int | None = None) -> None:
        """What `read` checks of the tensor `name` (or its slice `index`), unless the checkpoint is not checked,
        without reading it into memory: through a map of the page cache, for a tensor copied file to file. Read
        into memory, each byte cost one more copy, which with the copy itself made about as much work as the
        copy (hf-to-mcore at one worker on a 16-core host). Not for quantized weights, checked once dequantized."""
        stored, begin, _, length = self._region(name, index)
        if not self.check_finite or self.quantized(name) or not length:
            return
        base = begin - begin % mmap.ALLOCATIONGRANULARITY
        with open(stored.file, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size < begin + length:
                raise ConversionError(f"{stored.file}: truncated while reading tensor '{name}'")
            # A file cut short by another process while mapped ends this one (SIGBUS) instead of this error.
            with mmap.mmap(f.fileno(), begin + length - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ, offset=base) as window:
                values = np.frombuffer(window, dtype=stored.dtype, count=length // stored.dtype.itemsize, offset=begin - base)
                finite = dtypes.finite(values)
                del values  # the map closes only once no array holds it
        if not finite:
            raise self._nonfinite(name, index)

    def read_stored(self, stored: StoredTensor, name: str, index: int | None) -> np.ndarray:
        """A quantized weight's stored part (FP8 scales, MXFP4 blocks or exponents, or their slice `index`), as
        stored."""
        _, begin, shape, length = _region_of(stored, index)
        return self._read_runs(stored, name, [(begin, length)], shape)

    def _read_runs(
        self, stored: StoredTensor, name: str, runs: list[tuple[int, int]], shape: tuple[int, ...], into: np.ndarray | None = None
    ) -> np.ndarray:
        """The bytes of `runs` ((first byte, length) in `stored`'s file) one after another, as a `shape` array of
        `stored`'s dtype, in the start of `into` (uint8, to reuse memory) or fresh memory."""
        length = sum(count for _, count in runs)
        # np.empty, unlike bytearray, does not spend a pass zero-filling what the read overwrites.
        buffer = (np.empty(length, dtype=np.uint8) if into is None else into)[:length]
        view = memoryview(buffer)
        with open(stored.file, "rb", buffering=0) as f:
            done = 0
            for begin, count in runs:
                f.seek(begin)
                end = done + count
                while done < end:  # one read() returns at most 2 GiB
                    got = f.readinto(view[done:end])
                    if not got:
                        raise ConversionError(f"{stored.file}: truncated while reading tensor '{name}'")
                    done += got
        return buffer.view(stored.dtype).reshape(shape)

    def _nonfinite(self, name: str, index: int | None) -> ConversionError:
        which = f"{name}[{index}]" if isinstance(index, int) else name
        return ConversionError(
            f"{self.tensors[name].file}: tensor '{which}' holds NaN or Inf values (pass --allow-nonfinite to convert it as is)"
        )

    def _dequantize(self, name: str, index: int | None, tensor: np.ndarray, dtype: np.dtype) -> np.ndarray:
        """An FP8 weight (or its slice `index`) times its blocks' scales, computed in fp32, in `dtype`: a tensor at a
        time, so that memory stays at the tensors in hand."""
        scale, block = self.scales[name]
        scales = self.read_stored(scale, name + SCALE_SUFFIX, index)
        return dequantize_fp8_blocks(tensor, scales, block, dtype)

    def _dequantize_int4(self, name: str, into: np.ndarray | None) -> np.ndarray:
        """A pack-quantized INT4 weight's values, in its scales' dtype: its packed integers read into `into` (which
        holds the dequantized tensor's bytes, four times theirs or more), its scales and zero points into fresh
        memory."""
        packed, scale, zero = self.int4[name]
        words = self._read_runs(packed, name, [(packed.begin, packed.end - packed.begin)], packed.shape, into)
        zeros = None if zero is None else self.read_stored(zero, name, None)
        return dequantize_int4(words, self.read_stored(scale, name, None), self.tensors[name].shape[1], zeros)
