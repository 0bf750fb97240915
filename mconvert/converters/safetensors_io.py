"""HF safetensors checkpoints: a lazy reader that reads one tensor (or one slice of its first axis) at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets) and
the raw bytes. Reading with plain file reads into a fresh buffer, rather than through a memory map, keeps the
process's resident memory at the tensors in hand, whatever the checkpoint's size.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from mconvert.converters.copying import copy_range
from mconvert.errors import ConversionError

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Block-quantized FP8 (DeepSeek-V3's `quant_method: fp8` with `weight_block_size`): each FP8 weight `X` comes
# with `X_scale_inv`, one fp32 factor per block, which multiplies the block back to its values.
SCALE_SUFFIX = "_scale_inv"
# Floating-point dtypes whose values are checked to be finite as they are read (float8 has no min/max kernels).
_CHECKED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _finite(tensor: torch.Tensor) -> bool:
    """Whether a tensor holds no NaN or Inf (of a dtype that can): in one pass with no temporary (isfinite's bool
    tensor costs ten times more); NaN and Inf both show in the extremes."""
    if tensor.dtype not in _CHECKED_DTYPES or not tensor.numel():
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(low) and math.isfinite(high)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def read_header(path: Path) -> dict[str, StoredTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ConversionError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if 8 + header_len > size:
            raise ConversionError(f"{path}: truncated (header of {header_len} bytes, file of {size})")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:
            raise ConversionError(f"{path}: unreadable safetensors header ({e})") from None
    base = 8 + header_len
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, (begin, end), shape = info["dtype"], info["data_offsets"], tuple(int(n) for n in info["shape"])
        except (TypeError, KeyError, ValueError):
            raise ConversionError(f"{path}: tensor '{name}' has a malformed header entry {info!r}") from None
        if dtype_name not in ST_DTYPES:
            raise ConversionError(f"{path}: tensor '{name}' has unsupported dtype {dtype_name}")
        dtype = ST_DTYPES[dtype_name]
        if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
            raise ConversionError(f"{path}: tensor '{name}' has data_offsets [{begin}, {end}] for shape {list(shape)} of {dtype_name}")
        if base + end > size:
            raise ConversionError(f"{path}: truncated (tensor '{name}' ends at byte {base + end}, file has {size})")
        tensors[name] = StoredTensor(path, dtype, shape, base + begin, base + end)
    return tensors


def fp8_block_size(config: dict) -> tuple[int, int] | None:
    """The block size of block-quantized FP8 weights that config.json's quantization_config names
    (DeepSeek-V3: `quant_method: fp8`, `weight_block_size: [128, 128]`), None when it names none."""
    quantization = config.get("quantization_config") or {}
    block = quantization.get("weight_block_size")
    if not quantization:
        return None
    if quantization.get("quant_method") != "fp8" or not block or len(block) != 2:
        raise ConversionError(
            f"config.json: quantization_config {quantization} is not supported (block-quantized fp8 with a "
            f"2-D weight_block_size is)"
        )
    return int(block[0]), int(block[1])
def read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard file map; every shard a plain file name in the index's directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConversionError(f"{index}: not a safetensors index (no readable 'weight_map': {e!r})") from None
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{index}: 'weight_map' is not an object of tensor names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ConversionError(f"{index}: tensor '{name}' names shard {file!r}, not a file beside the index")
    return weight_map


def read_hf_config(directory: Path, flag: str) -> dict:
    """config.json of an HF model directory given by `flag`."""
    path = Path(directory) / "config.json"
    if not path.exists():
        raise ConversionError(f"{flag} {directory}: no config.json (not an HF model directory)")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path}: holds a JSON {type(config).__name__}, not an object of settings")
    return config


class HFCheckpoint:
    """The tensors of an HF checkpoint directory: `model.safetensors`, or shards listed by the index.
    With `check_finite`, reading a floating-point tensor that holds NaN or Inf is an error naming it."""

    def __init__(self, directory: str | os.PathLike, fp8_block: tuple[int, int] | None = None, check_finite: bool = True):
        """`fp8_block`: the block size of FP8 weights' scales (config.json's quantization_config, see
        fp8_block_size); FP8 weights are read dequantized. `check_finite`: a weight holding NaN or Inf is an
        error."""
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

    def where(self, name: str) -> str:
        return f"tensor '{name}' in {self.tensors[name].file}"

    def _region(self, name: str, index: int | None) -> tuple[StoredTensor, int, tuple[int, ...], int]:
        """Where the tensor `name` (or its slice `index`) is: its file's entry, first byte, shape and length."""
        stored = self.tensors[name]
        begin, shape = stored.begin, stored.shape
        if index is not None:
            row_bytes = math.prod(shape[1:]) * stored.dtype.itemsize
            begin, shape = begin + index * row_bytes, shape[1:]
        return stored, begin, shape, math.prod(shape) * stored.dtype.itemsize

    def nbytes(self, name: str, index: int | None = None) -> int:
        return self._region(name, index)[3]

    def place(self, name: str, index: int | None = None) -> tuple[Path, int, tuple[int, ...], torch.dtype]:
        """Where the tensor `name` (or its slice `index`) is stored: file, first byte, shape and dtype."""
        stored, begin, shape, _ = self._region(name, index)
        return stored.file, begin, tuple(shape), stored.dtype

    def read(self, name: str, index: int | None = None, into: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor `name`, or its slice `index` along the first axis (one expert of a fused expert tensor),
        read into the start of `into` (a uint8 tensor of at least its bytes, to reuse memory) or fresh memory."""
        stored, begin, shape, length = self._region(name, index)
        # torch.empty, unlike bytearray, does not spend a pass zero-filling what the read overwrites.
        buffer = (torch.empty(length, dtype=torch.uint8) if into is None else into)[:length]
        view = memoryview(buffer.numpy())
        with open(stored.file, "rb", buffering=0) as f:
            f.seek(begin)
            done = 0
            while done < length:  # one read() returns at most 2 GiB
                count = f.readinto(view[done:])
                if not count:
                    raise ConversionError(f"{stored.file}: truncated while reading tensor '{name}'")
                done += count
        tensor = buffer.view(stored.dtype).reshape(shape)
        if name in self.scales:
            tensor = self._dequantize(name, index, tensor)
        if self.check_finite and not _finite(tensor):
            raise self._nonfinite(name, index)
        return tensor

    def check(self, name: str, index: int | None = None) -> None:
        """What `read` checks of the tensor `name` (or its slice `index`), unless the checkpoint is not checked,
        without reading it into memory: through a map of the page cache, for a tensor copied file to file. Read
        into memory, each byte cost one more copy, which with the copy itself made about as much work as the
        copy (hf-to-mcore at one worker on a 16-core host). Not for FP8 weights, checked once dequantized."""
        stored, begin, _, length = self._region(name, index)
        if not self.check_finite or name in self.scales or stored.dtype not in _CHECKED_DTYPES or not length:
            return
        base = begin - begin % mmap.ALLOCATIONGRANULARITY
        with open(stored.file, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size < begin + length:
                raise ConversionError(f"{stored.file}: truncated while reading tensor '{name}'")
            # Private and writable, as torch's tensors over a buffer are, but never written: nothing is copied.
            # A file cut short by another process while mapped ends this one (SIGBUS) instead of this error.
            with mmap.mmap(f.fileno(), begin + length - base, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=base) as window:
                finite = _finite(torch.frombuffer(window, dtype=stored.dtype, count=length // stored.dtype.itemsize, offset=begin - base))
        if not finite:
            raise self._nonfinite(name, index)

    def _nonfinite(self, name: str, index: int | None) -> ConversionError:
        which = name if index is None else f"{name}[{index}]"
        return ConversionError(
            f"{self.tensors[name].file}: tensor '{which}' holds NaN or Inf values (pass --allow-nonfinite to convert it as is)"
        )

    def _dequantize(self, name: str, index: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """An FP8 weight (or its slice `index`) times its blocks' scales, in fp32: a tensor at a time, so that
        memory stays at the tensors in hand."""
        scale, (block_rows, block_cols) = self.scales[name]
        with open(scale.file, "rb") as f:
            f.seek(scale.begin)
            scales = torch.frombuffer(bytearray(f.read(scale.end - scale.begin)), dtype=scale.dtype).reshape(scale.shape)
        if index is not None:
            scales = scales[index]
        rows, cols = tensor.shape[-2:]
        if rows % block_rows or cols % block_cols:  # partial blocks at the edges: each scale spread over its block
            factors = scales.float().repeat_interleave(block_rows, -2)[..., :rows, :].repeat_interleave(block_cols, -1)[..., :cols]
            return tensor.float() * factors
        # Whole blocks: the scales broadcast over a blocked view, in place (no tensor-sized factors).
        values = tensor.float()
        blocked = values.view(*values.shape[:-2], rows // block_rows, block_rows, cols // block_cols, block_cols)
        blocked.mul_(scales.float()[..., :, None, :, None])
        return values


_ST_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
_SIZE_UNITS = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}


def parse_size(text: str) -> int:
    """Bytes in a size such as transformers' max_shard_size: "5GB" (10^9), "500MiB" (2^20), or a plain number."""
    value = text.strip().upper()
    for unit, factor in _SIZE_UNITS.items():
        if value.endswith(unit):
            value, multiplier = value[: -len(unit)], factor
            break
    else:
        multiplier = 1
    try:
        size = int(float(value) * multiplier)
    except ValueError:
        raise ConversionError(f"size '{text}' is not a number of bytes with an optional unit (5GB, 500MiB)") from None
    if size <= 0:
        raise ConversionError(f"size '{text}' must be positive")
    return size


class SafetensorsWriter:
    """Sharded safetensors files written as the tensors come, in any order, from any thread, with bounded
    memory.

    The layout of every file (which tensors, their headers and byte offsets) is computed from the tensors'
    names, dtypes and shapes before any data exists, the same in every process; the process that `create`s
    writes the headers and sizes the files, and then each tensor (or each slice of its first axis) is written
    at its place, by whichever thread or process converts it. `finish` checks that every byte was written
    and writes the index.
    """

    def __init__(
        self,
        directory: Path,
        tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]],
        max_shard_size: int,
        create: bool = True,
        together: list[list[str]] | None = None,
    ):
        self.directory = directory
        # Files break between the groups of `together` (every tensor, in their order; default: one group
        # each): a file holds whole groups.
        groups: list[list[str]] = [[]]
        group_bytes = 0
        for names in together if together is not None else [[name] for name in tensors]:
            size = sum(math.prod(tensors[name][1]) * tensors[name][0].itemsize for name in names)
            if groups[-1] and group_bytes + size > max_shard_size:
                groups.append([])
                group_bytes = 0
            groups[-1].extend(names)
            group_bytes += size
        self.places: dict[str, tuple[Path, int, torch.dtype, tuple[int, ...]]] = {}
        self.weight_map: dict[str, str] = {}
        self.sizes: dict[str, int] = {}
        self.written: dict[str, int] = {}  # bytes written by this process, by tensor
        self.files: dict[Path, list[str]] = {}  # each file's tensors, in their order there
        # Per file: how many of its tensors, from the first, this process wrote in full, and where they end.
        self._prefix: dict[Path, tuple[int, int]] = {}
        self.total_bytes = 0
        for number, names in enumerate(groups, 1):
            file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
            header: dict[str, object] = {"__metadata__": {"format": "pt"}}
            offset = 0
            for name in names:
                dtype, shape = tensors[name]
                size = math.prod(shape) * dtype.itemsize
                header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
                offset += size
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # tensors start 8-byte aligned, as the safetensors library writes
            path = directory / file
            if create:
                with open(path, "wb") as f:
                    f.write(struct.pack("<Q", len(encoded)) + encoded)
                    f.truncate(8 + len(encoded) + offset)
            base = 8 + len(encoded)
            self.files[path], self._prefix[path] = names, (0, base)
            for name in names:
                dtype, shape = tensors[name]
                self.places[name] = (path, base + header[name]["data_offsets"][0], dtype, tuple(shape))
                self.weight_map[name] = file
                self.sizes[name] = math.prod(shape) * dtype.itemsize
                self.written[name] = 0
            self.total_bytes += offset
        self._files: dict[tuple[Path, int], int] = {}  # (path, open flags) -> descriptor
        self._lock = threading.Lock()

    def _fd(self, path: Path, flags: int = os.O_WRONLY) -> int:
        """The file opened once for all threads (written to and read from only at given offsets)."""
        with self._lock:
            if (path, flags) not in self._files:
                self._files[path, flags] = os.open(path, flags)
            return self._files[path, flags]

    def written_prefix(self, path: Path) -> int:
        """How many bytes from the start of file `path` are in place: its header, then its tensors in order up
        to the first that this process has not written in full (what other processes wrote is not counted)."""
        with self._lock:
            count, end = self._prefix[path]
            names = self.files[path]
            while count < len(names) and self.written[names[count]] == self.sizes[names[count]]:
                end = self.places[names[count]][1] + self.sizes[names[count]]
                count += 1
            self._prefix[path] = count, end
            return end

    def nbytes(self, name: str, index: int | None = None) -> int:
        """The bytes of tensor `name`, or of its slice `index` along the first axis."""
        shape = self.places[name][3]
        return self.sizes[name] // shape[0] if index is not None else self.sizes[name]

    def write(self, name: str, tensor: torch.Tensor, index: int | None = None) -> None:
        """Write tensor `name`, or its slice `index` along the first axis."""
        path, begin, dtype, shape = self.places[name]
        if index is not None:
            begin += index * math.prod(shape[1:]) * dtype.itemsize
            shape = shape[1:]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise AssertionError(f"'{name}': got {tensor.dtype} {list(tensor.shape)}, the layout says {dtype} {list(shape)}")
        data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        fd, done = self._fd(path), 0
        while done < len(data):  # one write takes at most 2 GiB
            done += os.pwrite(fd, data[done:], begin + done)
        with self._lock:
            self.written[name] += len(data)

    def copy(self, name: str, index: int | None, source: Path, position: int) -> None:
        """Write tensor `name` (or its slice `index`) as the bytes at `position` of file `source`, copied by
        the kernel where it can (`copy_range`), as `cp` copies: its layout's dtype and shape, in order."""
        path, begin, dtype, shape = self.places[name]
        if index is not None:
            begin += index * math.prod(shape[1:]) * dtype.itemsize
            shape = shape[1:]
        length = math.prod(shape) * dtype.itemsize
        copy_range(self._fd(source, os.O_RDONLY), position, self._fd(path), begin, length, source, f"tensor '{name}'")
        with self._lock:
            self.written[name] += length

    def finish(self, written: list[dict[str, int]] | None = None) -> None:
        """Check that every byte was written (by this process, or by all of `written`, each process's
        `written`) and write the index."""
        self.close()
        written = written if written is not None else [self.written]
        unwritten = [name for name, size in self.sizes.items() if sum(part[name] for part in written) != size]
        if unwritten:
            raise AssertionError(f"{len(unwritten)} tensors not (fully) written, e.g. '{unwritten[0]}'")
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()
