"""Quantized sources both ways. `rates` (the default): hf-to-mcore's dequantization rate on one thread: HFCheckpoint.read of Kimi-K2's expert projections (2048 x 7168
and 7168 x 2048, alternating), stored as compressed-tensors' pack-quantized INT4 as Kimi-K2-Thinking stores them (bf16
scales per 32 columns, Kimi-K2.5's quantization_config) and as block-quantized FP8 as DeepSeek-V3 stores them (fp32
scales per 128 x 128, its quantization_config), about GB of source each, page cache warm; each tensor ends in bf16, as
a bf16 conversion stores it (FP8 read in bf16, as the conversion reads it). NaN and Inf are checked, as
hf-to-mcore checks them. Prints, per format, GB/s of source (the stored bytes, scales included) and of bf16, the
median of ROUNDS passes.

  python scripts/bench/bench_dequantize.py --work-dir DIR --gb 1 --rounds 3

`--convert`: whole conversions against `cp -r` of the same bytes, on the disk of --work-dir, page cache warm, at the
default worker count (printed) or --workers: hf-to-mcore (EP 8) from Kimi-K2's shapes in block FP8 (as released) and
in pack-quantized INT4 (as Kimi-K2-Thinking), and from gpt-oss-120b's layers in MXFP4, each cut to --gib of source
(experts and vocabulary cut), and mcore-to-hf --quantize as-source of each result back against `cp -r` of that
checkpoint. Sources are written from mconvert's own plan with numpy (no torch, no transformers): random values
tiled. Peak RSS (ru_maxrss) is set beside the bound docs/performance.md states: 1 GiB + workers x the larger of
the largest tensor in hand (its bf16 values, and a quantized one's stored bytes) and the read-ahead (512 MiB) +
slice threads (one per core) x 32 MiB. Writes OUT/quantized.md and OUT/quantized.json.

  python scripts/bench/bench_dequantize.py --convert --work-dir DIR --out OUT --gib 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_convert import GiB, remove, run_timed  # noqa: E402
from bench_scaling import warm  # noqa: E402

from mconvert import dtypes, slices  # noqa: E402
from mconvert.formats.hf_checkpoint import HFCheckpoint  # noqa: E402
from mconvert.converters.parallel import READ_AHEAD_BYTES, default_workers, machine_share  # noqa: E402
from mconvert.converters.plan import build_plan  # noqa: E402
from mconvert.formats.quantized import MXFP4_BLOCKS, MXFP4_SCALES, fp8_block_size, pack_quantized  # noqa: E402
from mconvert.formats.safetensors import SafetensorsWriter  # noqa: E402
from mconvert.full_size import is_fp8_on_the_hub  # noqa: E402
from mconvert.mappings import get_mapping  # noqa: E402
from mconvert.mcore.parallelism import Parallelism  # noqa: E402
from mconvert.synthetic import model_config, real_config  # noqa: E402

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
            hf.read(name, into=buffer, dtype=dtypes.bfloat16)
        seconds.append(time.perf_counter() - started)
    median = statistics.median(seconds)
    return source / median / 1e9, written / median / 1e9


# Source GiB a routed expert adds (its three projections, scales included), and GiB of the rest, per model: the
# expert count of each cut is chosen from them for --gib.
KIMI = "kimi-k2-instruct@2+first_k_dense_replace=1+vocab_size=32768+n_routed_experts={experts}"
CUTS = {
    "FP8 (Kimi-K2, e4m3 128 x 128)": (KIMI, None, 0.0412, 1.45),
    "INT4 (Kimi-K2-Thinking, pack-quantized)": (KIMI, real_config("kimi-k2.5")["text_config"]["quantization_config"], 0.0212, 2.18),
    "MXFP4 (gpt-oss-120b's layers)": ("gpt-oss-20b@2+vocab_size=32768+torch_dtype=bfloat16+num_local_experts={experts}", None, 0.0131 * 2, 0.34),
}


def tiled(pool: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.resize(pool, count).view(dtype).reshape(shape)


def write_source(directory: Path, config: dict, rng: np.random.Generator) -> dict:
    """A checkpoint of `config` as its release stores it: every HF tensor mconvert's plan reads, random, the weights
    the quantization_config names quantized (FP8 blocks, INT4 packed, MXFP4 blocks and scales), the rest in bf16;
    its layout (name: dtype, shape)."""
    family, spec = get_mapping(config)
    shapes = build_plan(family, spec, Parallelism()).hf_shapes()
    quantization = config.get("quantization_config", {})
    method = quantization.get("quant_method")
    pools = {
        "bf16": (rng.standard_normal(1 << 23, dtype=np.float32) * 0.02).astype(dtypes.bfloat16).view(np.uint8),
        "fp8": np.where(((codes := rng.integers(0, 256, 1 << 24, dtype=np.uint8)) & 0x7F) == 0x7F, 0x7E, codes).astype(np.uint8),
        "bytes": rng.integers(0, 256, 1 << 24, dtype=np.uint8),
        "exponents": rng.integers(118, 131, 1 << 20, dtype=np.uint8),
        "scales": rng.uniform(1e-3, 2e-3, 1 << 20).astype(np.float32).view(np.uint8),
        "int4 scales": rng.uniform(1e-3, 2e-3, 1 << 20).astype(dtypes.bfloat16).view(np.uint8),
    }
    layout, values = {}, {}
    for name, shape in shapes.items():
        if method == "fp8" and is_fp8_on_the_hub(name):
            grid = tuple(-(-size // 128) for size in shape)
            layout[name], values[name] = (dtypes.float8_e4m3fn, shape), "fp8"
            layout[name + "_scale_inv"], values[name + "_scale_inv"] = (dtypes.float32, grid), "scales"
        elif method == "compressed-tensors" and ".mlp.experts." in name and name.endswith("_proj.weight"):
            module, (rows, columns) = name.removesuffix(".weight"), shape
            layout[module + ".weight_packed"], values[module + ".weight_packed"] = (np.dtype(np.int32), (rows, columns // 8)), "bytes"
            layout[module + ".weight_scale"], values[module + ".weight_scale"] = (dtypes.bfloat16, (rows, columns // 32)), "int4 scales"
            layout[module + ".weight_shape"], values[module + ".weight_shape"] = (np.dtype(np.int64), (2,)), np.array(shape, dtype=np.int64)
        elif method == "mxfp4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = shape
            layout[name + MXFP4_BLOCKS], values[name + MXFP4_BLOCKS] = (dtypes.uint8, (experts, outputs, inputs // 32, 16)), "bytes"
            layout[name + MXFP4_SCALES], values[name + MXFP4_SCALES] = (dtypes.uint8, (experts, outputs, inputs // 32)), "exponents"
        else:
            layout[name], values[name] = (dtypes.bfloat16, shape), "bf16"
    directory.mkdir(parents=True)
    writer = SafetensorsWriter(directory, layout, 2 * 10**9)
    for name, (dtype, shape) in layout.items():
        value = values[name]
        writer.write(name, value if isinstance(value, np.ndarray) else tiled(pools[value], dtype, shape))
    writer.finish()
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return layout


def stored_bytes(layout: dict, name: str) -> int:
    """The bytes a quantized weight `name` is stored in (its quantized parts, `layout` as write_source gives it); 0
    for one stored in bf16."""
    parts = [name + suffix for suffix in ("", "_scale_inv", MXFP4_BLOCKS, MXFP4_SCALES, "_packed", "_scale", "_shape")]
    if layout.get(name, (dtypes.bfloat16,))[0] == dtypes.bfloat16 and name in layout:
        return 0
    return sum(int(np.prod(layout[part][1])) * np.dtype(layout[part][0]).itemsize for part in parts if part in layout)


def record(out: Path, rows: list[dict], note: str) -> None:
    """The rows so far as OUT/quantized.md and OUT/quantized.json: a run cut short keeps what it measured."""
    header = list(rows[0])
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(str(row[k]) for k in header) + " |" for row in rows]
    (out / "quantized.md").write_text("\n".join(table) + f"\n\n{note}\n")
    (out / "quantized.json").write_text(json.dumps({"rows": rows, "note": note}, indent=2) + "\n")


def convert(options: argparse.Namespace) -> int:
    """--convert: each quantized format both ways against `cp -r`, rows appended to OUT as they are measured."""
    options.out.mkdir(parents=True, exist_ok=True)
    workers, threads = options.workers or default_workers(), machine_share()[0]
    flags = ["--workers", str(options.workers)] if options.workers else []
    rows, started = [], time.perf_counter()
    load = os.getloadavg()
    print(f"{os.cpu_count()} cores, default workers {default_workers()}, running at {workers}, {threads} slice threads; load average {load[0]:.1f}", flush=True)
    for what, (model, quantization, expert_gib, rest_gib) in CUTS.items():
        if time.perf_counter() - started > options.deadline_s:
            print(f"{what}: left out, past --deadline-s", flush=True)
            continue
        experts = max(8, round((options.gib - rest_gib) / expert_gib / 8) * 8)
        config = model_config(model.format(experts=experts))
        if quantization is not None:
            config["quantization_config"] = quantization
        work = options.work_dir / what.split()[0]
        shutil.rmtree(work, ignore_errors=True)
        source, mcore, back, copy = work / "hf", work / "mcore", work / "back", work / "copy"
        layout = write_source(source, config, np.random.default_rng(0))
        # The largest tensor in hand: its bf16 values, beside a quantized one's stored bytes.
        shapes = build_plan(*get_mapping(config), Parallelism()).hf_shapes()
        largest = max(2 * int(np.prod(shape)) + stored_bytes(layout, name) for name, shape in shapes.items())
        bound = GiB + workers * max(largest, READ_AHEAD_BYTES) + threads * slices.SLICE_TEMPORARY_BYTES
        python = [sys.executable, "-m", "mconvert.cli"]
        steps = (
            ("hf-to-mcore", source, [*python, "hf-to-mcore", "--load-dir", str(source), "--save-dir", str(mcore), "--ep", "8", *flags], mcore),
            ("mcore-to-hf as-source", mcore, [*python, "mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back), "--hf-config", str(source), "--quantize", "as-source", *flags], back),
        )
        for direction, read, command, target in steps:
            nbytes = sum(path.stat().st_size for path in read.rglob("*") if path.is_file())
            run_timed(["cp", "-r", str(read), str(copy)])  # not recorded: the first write of this size
            remove(copy)
            warm(read)
            copied = run_timed(["cp", "-r", str(read), str(copy)])
            remove(copy)
            warm(read)
            converted = run_timed(command)
            row = {
                "format": what, "direction": direction, "experts": experts, "read GiB": round(nbytes / GiB, 2),
                "cp s": round(copied.seconds, 2), "s": round(converted.seconds, 2), "vs cp -r": round(converted.seconds / copied.seconds, 2),
                "on disk": round(converted.synced_seconds / copied.synced_seconds, 2), "GiB/s read": round(nbytes / GiB / converted.seconds, 2),
                "workers": workers, "peak RSS GiB": round(converted.max_rss_bytes / GiB, 2), "RSS bound GiB": round(bound / GiB, 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            record(options.out, rows, f"{os.cpu_count()} cores, load average at the start {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, "
                   f"{time.perf_counter() - started:.0f} s in all")
            if direction != "hf-to-mcore":
                remove(target)
        shutil.rmtree(work, ignore_errors=True)
    print((options.out / "quantized.md").read_text() if rows else "no rows")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="the sources; removed after")
    parser.add_argument("--gb", type=float, default=1.0, help="gigabytes of source per format")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--convert", action="store_true", help="whole conversions both ways against cp -r (above)")
    parser.add_argument("--out", type=Path, help="--convert: where quantized.md and quantized.json go")
    parser.add_argument("--gib", type=float, default=3.0, help="--convert: GiB of each source")
    parser.add_argument("--workers", type=int, default=None, help="--convert: workers (default: the conversion's default)")
    parser.add_argument("--deadline-s", type=float, default=100.0, help="--convert: no format started after this")
    options = parser.parse_args()
    if options.convert:
        return convert(options)
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
