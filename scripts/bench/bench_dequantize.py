"""hf-to-mcore's dequantization rate on one thread: HFCheckpoint.read of Kimi-K2's expert projections (2048 x 7168
and 7168 x 2048, alternating), stored as compressed-tensors' pack-quantized INT4 as Kimi-K2-Thinking stores them (bf16
scales per 32 columns, Kimi-K2.5's quantization_config) and as block-quantized FP8 as DeepSeek-V3 stores them (fp32
scales per 128 x 128, its quantization_config), about GB of source each, page cache warm; each tensor ends in bf16, as
a bf16 conversion stores it (FP8 reads as fp32, cast here as the conversion casts it). NaN and Inf are checked, as
hf-to-mcore checks them. Prints, per format, GB/s of source (the stored bytes, scales included) and of bf16, the
median of ROUNDS passes.

  python scripts/bench/bench_dequantize.py --work-dir DIR --gb 1 --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_scaling import warm  # noqa: E402

from mconvert import dtypes  # noqa: E402
from mconvert.formats.hf_checkpoint import HFCheckpoint  # noqa: E402
from mconvert.formats.quantized import fp8_block_size, pack_quantized  # noqa: E402
from mconvert.formats.safetensors import SafetensorsWriter  # noqa: E402
from mconvert.synthetic import real_config  # noqa: E402

SHAPES = ((2048, 7168), (7168, 2048))  # Kimi-K2's gate/up and down projections of one expert


def write_int4(directory: Path, gigabytes: float, rng: np.random.Generator) -> None:
    def parts(rows: int, columns: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return {"weight_packed": (np.dtype(np.int32), (rows, columns // 8)), "weight_scale": (dtypes.bfloat16, (rows, columns // 32)),
                "weight_shape": (np.dtype(np.int64), (2,))}

    count = expert_count(gigabytes, lambda shape: sum(d.itemsize * np.prod(s) for d, s in parts(*shape).values()))
    layout = {f"p{i}.{part}": spec for i in range(count) for part, spec in parts(*SHAPES[i % 2]).items()}
    writer = SafetensorsWriter(directory, layout, 2 * 10**9)
    for i in range(count):
        rows, columns = SHAPES[i % 2]
        # Any bits are eight 4-bit integers.
        writer.write(f"p{i}.weight_packed", rng.integers(-(1 << 31), 1 << 31, size=(rows, columns // 8), dtype=np.int64).astype(np.int32))
        writer.write(f"p{i}.weight_scale", rng.uniform(1e-3, 1e-2, size=(rows, columns // 32)).astype(dtypes.bfloat16))
        writer.write(f"p{i}.weight_shape", np.array([rows, columns], dtype=np.int64))
    writer.finish()


def write_fp8(directory: Path, gigabytes: float, rng: np.random.Generator) -> None:
    count = expert_count(gigabytes, lambda shape: np.prod(shape) + 4 * (shape[0] // 128) * (shape[1] // 128))
    layout = {}
    for i in range(count):
        rows, columns = SHAPES[i % 2]
        layout[f"p{i}.weight"] = (dtypes.float8_e4m3fn, (rows, columns))
        layout[f"p{i}.weight_scale_inv"] = (dtypes.float32, (rows // 128, columns // 128))
    writer = SafetensorsWriter(directory, layout, 2 * 10**9)
    for name, (dtype, shape) in layout.items():
        values = rng.standard_normal(size=shape, dtype=np.float32)
        writer.write(name, values.astype(dtype) if dtype == dtypes.float8_e4m3fn else np.abs(values) * 1e-3)
    writer.finish()


def expert_count(gigabytes: float, stored_bytes) -> int:
    return max(2, round(gigabytes * 1e9 / ((stored_bytes(SHAPES[0]) + stored_bytes(SHAPES[1])) / 2)))


def rates(hf: HFCheckpoint, directory: Path, rounds: int) -> tuple[float, float]:
    """(GB/s of source, GB/s of bf16): medians over `rounds` passes, each tensor read into a reused buffer."""
    source = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    written = sum(np.prod(stored.shape) * 2 for stored in hf.tensors.values())
    buffer = np.empty(max(hf.nbytes(name) for name in hf.tensors), dtype=np.uint8)
    seconds = []
    for _ in range(rounds):
        warm(directory)
        started = time.perf_counter()
        for name in hf.tensors:
            tensor = hf.read(name, into=buffer)
            if tensor.dtype != dtypes.bfloat16:
                tensor = tensor.astype(dtypes.bfloat16)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    return source / median / 1e9, written / median / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="the sources; removed after")
    parser.add_argument("--gb", type=float, default=1.0, help="gigabytes of source per format")
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    rng = np.random.default_rng(0)
    formats = {
        "INT4 (pack-quantized, bf16 scales per 32)": (write_int4, lambda d: HFCheckpoint(d, int4=pack_quantized(real_config("kimi-k2.5")))),
        "FP8 (e4m3, fp32 scales per 128 x 128)": (write_fp8, lambda d: HFCheckpoint(d, fp8_block_size(real_config("deepseek-v3")))),
    }
    try:
        for number, (name, (write, open_checkpoint)) in enumerate(formats.items()):
            directory = options.work_dir / str(number)
            directory.mkdir(parents=True)
            write(directory, options.gb, rng)
            source, written = rates(open_checkpoint(directory), directory, options.rounds)
            print(f"{name}: {source:.3f} GB/s of source, {written:.3f} GB/s of bf16 (one thread, median of {options.rounds})", flush=True)
    finally:
        shutil.rmtree(options.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
