"""mconvert beside the peers on one GPU host (issue: side by side with Megatron-Bridge, ms-swift, mbridge): the same
random-init HF checkpoint converted by each, every process timed whole from start to exit with its peak host memory
(RSS) and the GPU's peak memory in use, `cp -r` of the same files as the yardstick; then tensor for tensor, every
key of each peer's torch_dist against mconvert's (read back by torch's own DCP loader), and the way back: each peer's
HF export and mconvert's `mcore-to-hf` of the same checkpoints against the original HF files.

    python scripts/gpu/gpu_peers.py --work /tmp/peers-work --out OUT qwen2.5-0.5b qwen3-30b-a3b@2

MODEL as gpu_verify.py names it. Peers: $PEERS (default "mb swift"; mbridge too where its megatron-core allows), installed by peers_setup.sh into
/tmp/peers/<peer>. Results: OUT/peers.jsonl, a line per step and per comparison, appended as they come.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mconvert.full_size import write_random_hf_checkpoint  # noqa: E402
from mconvert.synthetic import model_config, write_word_tokenizer  # noqa: E402

SITE = os.environ.get("TE_SITE", "/tmp/site")
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
# Each peer's import path: its own folder first, so that its pinned packages shadow the machine's.
PEER_PATH = {
    "mb": f"{PEERS_DIR}/mb:{PEERS_DIR}/stubs:{SITE}",
    "swift": f"{PEERS_DIR}/sw:{SITE}",
    "mbridge": f"{PEERS_DIR}/mbridge:{SITE}",
    "mconvert": f"{REPO}",
}
# ms-swift's model type and chat template for a family (it cannot tell them from a folder without a hub name).
SWIFT_TEMPLATES = {"qwen2": "qwen2_5", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3_1", "glm4_moe": "glm4_5"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GpuPeak(threading.Thread):
    """The GPU memory in use (nvidia-smi, MiB) at its highest while a step runs, polled every 0.2 s."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=5).stdout.split()
                self.peak = max([self.peak, *map(int, used)])
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            self.stop.wait(0.2)


def timed(command: list[str], env: dict[str, str], log: Path) -> dict:
    """Runs `command` whole, through a parent that reports its children's peak RSS; seconds from start to exit."""
    wrapper = [sys.executable, "-c", (
        "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
        "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(code)"
    ), *command]
    gpu = GpuPeak()
    gpu.start()
    started = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(wrapper, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out.write(done.stdout[-20000:])
    seconds = time.perf_counter() - started
    gpu.stop.set()
    gpu.join()
    rss = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB")]
    stages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"peer_step"')]
    return {"exit": done.returncode, "seconds": round(seconds, 2), "peak_rss_gib": round(int(rss[-1]) / 2**20, 2) if rss else None,
            "gpu_peak_mib": gpu.peak, "stages": stages[-1]["seconds"] if stages else None,
            "tail": done.stdout[-1500:] if done.returncode else ""}


def peer_env(peer: str) -> dict[str, str]:
    """One rank's torch.distributed environment (the peers start a process group without a launcher)."""
    return {**os.environ, "PYTHONPATH": PEER_PATH[peer], "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def hf_to_mcore_step(peer: str, hf: Path, mcore: Path, back: Path, model_type: str) -> tuple[str, list[str]]:
    """(step name, command) of a peer's way in (and, for mbridge, its way back in the same process)."""
    run = [sys.executable, str(REPO / "scripts/gpu/peer_run.py")]
    if peer == "mconvert":
        return "hf-to-mcore", [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(mcore), "--quiet"]
    if peer == "mb":
        return "hf-to-mcore", [*run, "mb-import", str(hf), str(mcore)]
    if peer == "mbridge":
        return "hf-to-mcore+mcore-to-hf", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                           "--master-port", str(free_port()), *run[1:], "mbridge", str(hf), str(mcore), str(back)]
    template = SWIFT_TEMPLATES.get(model_type, model_type)
    return "hf-to-mcore", [sys.executable, "-m", "swift.cli._megatron.export", "--model", str(hf), "--model_type", model_type,
                           "--template", template, "--to_mcore", "true", "--torch_dtype", "bfloat16", "--output_dir", str(mcore)]


def mcore_to_hf_step(peer: str, hf: Path, mcore: Path, back: Path) -> tuple[str, list[str]] | None:
    if peer == "mconvert":
        return "mcore-to-hf", [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back),
                               "--hf-config", str(hf), "--quiet"]
    if peer == "mb":
        return "mcore-to-hf", [sys.executable, str(REPO / "scripts/gpu/peer_run.py"), "mb-export", str(hf), str(mcore), str(back)]
    if peer == "swift":
        return "mcore-to-hf", [sys.executable, "-m", "swift.cli._megatron.export", "--mcore_model", str(mcore), "--to_hf", "true",
                               "--torch_dtype", "bfloat16", "--output_dir", str(back)]
    return None  # mbridge: in its way-in process


def torch_dist_tensors(directory: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (the newest iteration under `directory`), read by torch's DCP."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    release = max((p for p in directory.rglob(".metadata")), key=lambda p: p.stat().st_mtime).parent
    reader = dcp.FileSystemReader(str(release))
    metadata = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def hf_tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for path in sorted(directory.glob("*.safetensors")) for k, v in load_file(path).items()}


def compare(ours: dict, theirs: dict) -> dict:
    """`theirs` against the reference `ours`. Keys both hold: equal bit for bit, equal on the rows both hold (a padded vocabulary), or differing (max |d|);
    keys only one side holds."""
    import torch

    equal, padded, differ, shape, dtype = [], [], {}, {}, {}
    for key in sorted(ours.keys() & theirs.keys()):
        a, b = ours[key], theirs[key]
        if a.dtype != b.dtype:
            dtype[key] = f"{a.dtype} vs {b.dtype}"
            b = b.to(a.dtype)
        if a.dim() != b.dim() or a.shape[1:] != b.shape[1:]:
            shape[key] = f"{tuple(a.shape)} vs {tuple(b.shape)}"
            continue
        rows = min(a.shape[0], b.shape[0])  # a padded vocabulary: the rows both hold
        if not torch.equal(a[:rows], b[:rows]):
            differ[key] = float((a[:rows].float() - b[:rows].float()).abs().max())
        elif a.shape == b.shape:
            equal.append(key)
        else:
            padded.append(key)
    return {"equal": len(equal), "equal_on_common_rows": padded, "differ": differ, "shape_differs": shape, "dtype_differs": dtype,
            "only_reference": sorted(ours.keys() - theirs.keys()), "only_candidate": sorted(theirs.keys() - ours.keys())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--device", default="cuda", help="where the random HF weights are made (cpu to try the script)")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    # mbridge 0.15.1 does not run with megatron-core 0.19.2 (ModelType.encoder_and_decoder is gone): PEERS=... mbridge.
    peers = ["mconvert", *os.environ.get("PEERS", "mb swift").split()]
    started = time.perf_counter()
    shutil.rmtree(options.work, ignore_errors=True)  # what an earlier, stopped run left would fill the disk

    def record(entry: dict) -> None:
        print(json.dumps(entry)[:2000], flush=True)
        with open(options.out / "peers.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    for model in options.models:
        if time.perf_counter() - started > options.deadline_s:
            record({"model": model, "skipped": "deadline"})
            continue
        work = options.work / model
        shutil.rmtree(work, ignore_errors=True)
        hf = work / "hf"
        config = model_config(model)
        config["torch_dtype"] = "bfloat16"
        write_random_hf_checkpoint(config, hf, device=options.device)
        write_word_tokenizer(hf, config.get("vocab_size") or config["text_config"]["vocab_size"])
        # ms-swift asserts an end-of-sequence token for some templates (Qwen3's): name one.
        tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
        (hf / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "w0"}))
        size = sum(p.stat().st_size for p in hf.iterdir())
        subprocess.run(["sync"])
        record({"model": model, "peer": "cp -r", **timed(["cp", "-r", str(hf), str(work / "copy")], dict(os.environ), options.out / "peers.log"),
                "bytes": size})
        shutil.rmtree(work / "copy")
        reference = hf_tensors(hf)
        checkpoints = {}
        for peer in peers:
            if time.perf_counter() - started > options.deadline_s:
                record({"model": model, "peer": peer, "skipped": "deadline"})
                continue
            mcore, back = work / f"{peer}-mcore", work / f"{peer}-hf"
            env = peer_env(peer)
            step, command = hf_to_mcore_step(peer, hf, mcore, back, config["model_type"])
            record({"model": model, "peer": peer, "step": step, **timed(command, env, options.out / "peers.log")})
            if any(mcore.rglob(".metadata")):
                checkpoints[peer] = mcore
                step = mcore_to_hf_step(peer, hf, mcore, back)
                if step:
                    record({"model": model, "peer": peer, "step": step[0], **timed(step[1], env, options.out / "peers.log")})
            if back.exists() and any(back.glob("*.safetensors")):
                record({"model": model, "peer": peer, "compare": "HF export vs the original HF files", **compare(reference, hf_tensors(back))})
        if "mconvert" in checkpoints:
            ours = torch_dist_tensors(checkpoints["mconvert"])
            for peer, mcore in checkpoints.items():
                if peer == "mconvert":
                    continue
                record({"model": model, "peer": peer, "compare": "torch_dist vs mconvert's", **compare(ours, torch_dist_tensors(mcore))})
                # mconvert's way back from the peer's checkpoint.
                back = work / f"mconvert-from-{peer}"
                result = timed([sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back),
                                "--hf-config", str(hf), "--quiet"], peer_env("mconvert"), options.out / "peers.log")
                record({"model": model, "peer": f"mconvert from {peer}'s", "step": "mcore-to-hf", **result})
                if result["exit"] == 0:
                    record({"model": model, "peer": f"mconvert from {peer}'s", "compare": "HF export vs the original HF files",
                            **compare(reference, hf_tensors(back))})
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
