"""The figures behind docs/verification.md's memory bounds of the readers.

    python scripts/bench/reader_bounds.py growth --work DIR   # what the unpicklers build from 10 MB of empty dicts
    python scripts/bench/reader_bounds.py open --work DIR     # opening a torch_dist checkpoint with and without the
                                                              # check of its claimed sizes

growth: each hostile pickle is read in a process of its own, whose peak RSS before and after the read is the growth.
`.metadata` and `common.pt` are read by mconvert's own unpicklers (mconvert.formats.dcp and
mconvert.formats.pickles.load_megatron_file), Python's, without torch. open: a Qwen3-MoE shape (8 layers, 128 experts) converted at TP 2 x
EP 8, its `.metadata` opened five times each way; the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Ten million bytes of pickle: a list of empty dicts, plain (`}a`: 2 bytes a dict), or each memoized (`}\x94a`).
DICTS = {"plain": b"}a", "memoized": b"}\x94a"}
PICKLE_BYTES = 10_000_000

READ = {
    ".metadata": "import io; from mconvert.formats.dcp import _MetadataUnpickler as U; U(io.BytesIO(open(PATH, 'rb').read())).load()",
    "common.pt": "from mconvert.formats.pickles import load_megatron_file; load_megatron_file(PATH, 'x')",
}
PROBE = "import resource, sys; sys.path.insert(0, {repo!r}); PATH = {path!r}\n{setup}\nbase = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n{read}\nprint(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)"


def hostile_pickle(item: bytes) -> bytes:
    return b"\x80\x04]" + item * (PICKLE_BYTES // len(item)) + b"."


def common_pt(path: Path, pickle_bytes: bytes) -> None:
    """A torch.save archive whose data.pkl is `pickle_bytes` (the rest of the archive as torch writes it)."""
    import torch

    small = path.with_suffix(".small")
    torch.save({"args": None}, small)
    with zipfile.ZipFile(small) as source, zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            archive.writestr(info.filename, pickle_bytes if info.filename.endswith("data.pkl") else source.read(info.filename))
    small.unlink()


CASES = ((".metadata", "plain"), (".metadata", "memoized"), ("common.pt", "plain"), ("common.pt", "memoized"))


def growth(work: Path) -> None:
    for reader, name in CASES:
        item, read = DICTS[name], READ[reader]
        path = work / f"{name}-{reader.lstrip('.')}"
        if reader == ".metadata":
            path.write_bytes(hostile_pickle(item))
        else:
            common_pt(path, hostile_pickle(item))
        probe = PROBE.format(repo=str(REPO), path=str(path), setup="import numpy", read=read)
        kib = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
        size = path.stat().st_size
        print(f"{reader} of {size / 1e6:.1f} MB ({name} empty dicts): grew by {kib / 1024:.0f} MB, {kib * 1024 / size:.0f} x its size")

def open_times(work: Path) -> None:
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.formats import dcp
    from mconvert.mcore.checkpoint import iteration_dir
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

    config = shrink(real_config("qwen3-30b-a3b"), layers=8)
    config["num_experts"] = 128
    hf = make_hf_checkpoint(config, work / "hf")
    convert_hf_to_mcore(hf, work / "mcore", parallelism=Parallelism(tp=2, ep=8), overwrite=True)
    release = iteration_dir(work / "mcore")
    opened = dcp.DCPCheckpoint(release)
    chunks = sum(len(m.chunks) for m in opened.metadata.state_dict_metadata.values() if isinstance(m, dcp._TensorEntry))

    def median_ms() -> float:
        times = []
        for _ in range(5):
            started = time.perf_counter()
            dcp.DCPCheckpoint(release)
            times.append(time.perf_counter() - started)
        return statistics.median(times) * 1000

    with_check = median_ms()
    dcp.DCPCheckpoint._check_claims = lambda self, *args: None
    without = median_ms()
    print(f"{chunks} chunks: opened in {with_check:.0f} ms with the check of claimed sizes, {without:.0f} ms without (medians of 5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("growth", "open"))
    parser.add_argument("--work", type=Path, required=True)
    options = parser.parse_args()
    options.work.mkdir(parents=True, exist_ok=True)
    if options.what == "growth":
        growth(options.work)
    else:
        open_times(options.work)


if __name__ == "__main__":
    main()
