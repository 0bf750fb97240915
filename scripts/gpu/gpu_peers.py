"""mconvert beside the peers on one GPU host (issue: side by side with Megatron-Bridge, ms-swift, mbridge): the same
random-init HF checkpoint converted by each, every process timed whole from start to exit with its peak host memory
(RSS) and the GPU's peak memory in use, `cp -r` of the same files as the yardstick; then tensor for tensor, every
key of each peer's torch_dist against mconvert's (read back by torch's own DCP loader), and the export: each peer's
HF export and mconvert's `mcore-to-hf` of the same checkpoints against the original HF files.

    python scripts/gpu/gpu_peers.py --work /tmp/peers-work --out OUT qwen2.5-0.5b qwen3-30b-a3b@2 'deepseek-v3.2@2#swift'

MODEL as gpu_verify.py names it, optionally with `#PEER,PEER` naming the peers for that model alone (a peer without a
converter for the family left out). Peers: $PEERS (default "mb swift"; mbridge too where its megatron-core allows),
installed by peers_setup.sh into /tmp/peers/<peer>; "again" is mconvert a second time, as if it were a peer (to try the
comparisons on a CPU box). Results: OUT/peers.jsonl, a line per step and per comparison, appended as they come. Each
step is killed at --step-timeout-s or at the deadline, whichever comes first; with --done-dir a model whose steps all
ran leaves a mark there and is skipped by a later run (exit 3: models left for a later call).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from mconvert.full_size import write_random_hf_checkpoint  # noqa: E402
from mconvert.synthetic import make_hf_checkpoint, model_config, write_word_tokenizer  # noqa: E402

SITE = os.environ.get("TE_SITE", "/tmp/site")
PEERS_DIR = Path(os.environ.get("PEERS_DIR", "/tmp/peers"))
# Each peer's import path: its own folder first, so that its pinned packages shadow the machine's.
PEER_PATH = {
    "mb": f"{PEERS_DIR}/mb:{PEERS_DIR}/stubs:{SITE}",
    "swift": f"{PEERS_DIR}/sw:{SITE}",
    "mbridge": f"{PEERS_DIR}/mbridge:{SITE}",
    "mconvert": f"{REPO}",
    "again": f"{REPO}",
}
# ms-swift's model type and chat template for a family (it cannot tell them from a folder without a hub name).
# ms-swift's --model_type is the HF model_type for every family here (swift/model/constant.py); the templates are those
# its model registry gives the released checkpoints (swift/model/models/*.py).
SWIFT_TEMPLATES = {"qwen2": "qwen2_5", "qwen3": "qwen3", "qwen3_moe": "qwen3", "deepseek_v3": "deepseek_v3_1", "glm4_moe": "glm4_5",
                   "gpt_oss": "gpt_oss", "qwen3_next": "qwen3_nothinking", "nemotron_h": "nemotron_h", "qwen3_5": "qwen3_5",
                   "qwen3_5_moe": "qwen3_5", "deepseek_v32": "deepseek_v3_1", "glm_moe_dsa": "glm5_1", "minimax_m2": "minimax_m2_7"}
# What mconvert's hf-to-mcore needs beyond the defaults for a family: Nemotron-H (Mamba-2 layers) is a HybridModel.
MCONVERT_FLAGS = {"nemotron_h": ["--model-class", "hybrid"]}
# Families whose hub names write_random_hf_checkpoint (transformers' in-memory names) does not give: built and saved by
# transformers' save_pretrained, which writes the hub's (Nemotron-H: `backbone.`, one tensor an expert), as gpu_verify.py.
SAVED_BY_TRANSFORMERS = {"nemotron_h"}


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


def timed(command: list[str], env: dict[str, str], log: Path, timeout: float | None = None) -> dict:
    """Runs `command` whole, through a parent that reports its children's peak RSS; seconds from start to exit. Past
    `timeout` seconds its whole process group is killed (exit "timeout")."""
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
        process = subprocess.Popen(wrapper, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
        try:
            stdout, _ = process.communicate(timeout=timeout)
            code = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, _ = process.communicate()
            code = "timeout"
        out.write(stdout[-20000:])
    done = subprocess.CompletedProcess(wrapper, code, stdout)
    seconds = time.perf_counter() - started
    gpu.stop.set()
    gpu.join()
    rss = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("PEAK_RSS_KB")]
    stages = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"peer_step"')]
    return {"exit": done.returncode, "seconds": round(seconds, 2), "peak_rss_gib": round(int(rss[-1]) / 2**20, 2) if rss else None,
            "gpu_peak_mib": gpu.peak, "stages": stages[-1]["seconds"] if stages else None,
            "tail": done.stdout[-1500:] if done.returncode else ""}


def peer_env(peer: str) -> dict[str, str]:
    """One rank's torch.distributed environment (the peers start a process group without a launcher). The peer's own
    folders first, then the caller's path (the kernels' stand-ins and settings a stage puts there)."""
    path = ":".join(p for p in (PEER_PATH[peer], os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
            "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def hf_to_mcore_step(peer: str, hf: Path, mcore: Path, back: Path, model_type: str) -> tuple[str, list[str]]:
    """(step name, command) of a peer's import (and, for mbridge, its export in the same process)."""
    run = [sys.executable, str(REPO / "scripts/gpu/peer_run.py")]
    if peer in ("mconvert", "again"):
        return "hf-to-mcore", [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(mcore),
                               *MCONVERT_FLAGS.get(model_type, []), "--quiet"]
    if peer == "mb":
        return "hf-to-mcore", [*run, "mb-import", str(hf), str(mcore)]
    if peer == "mbridge":
        return "hf-to-mcore+mcore-to-hf", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                           "--master-port", str(free_port()), *run[1:], "mbridge", str(hf), str(mcore), str(back)]
    template = SWIFT_TEMPLATES.get(model_type, model_type)
    return "hf-to-mcore", [sys.executable, "-m", "swift.cli._megatron.export", "--model", str(hf), "--model_type", model_type,
                           "--template", template, "--to_mcore", "true", "--torch_dtype", "bfloat16", "--output_dir", str(mcore)]


def mcore_to_hf_step(peer: str, hf: Path, mcore: Path, back: Path) -> tuple[str, list[str]] | None:
    if peer in ("mconvert", "again"):
        return "mcore-to-hf", [sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back),
                               "--hf-config", str(hf), "--quiet"]
    if peer == "mb":
        return "mcore-to-hf", [sys.executable, str(REPO / "scripts/gpu/peer_run.py"), "mb-export", str(hf), str(mcore), str(back)]
    if peer == "swift":
        return "mcore-to-hf", [sys.executable, "-m", "swift.cli._megatron.export", "--mcore_model", str(mcore), "--to_hf", "true",
                               "--torch_dtype", "bfloat16", "--output_dir", str(back)]
    return None  # mbridge: in its import process


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


def write_processor(hf: Path, config: dict) -> None:
    """An image-text checkpoint's processor files beside its tokenizer, as the hub's Qwen3.5 checkpoints hold them:
    ms-swift loads the processor of these families (AutoProcessor, which needs torchvision) before it builds anything."""
    if "vision_config" not in config:
        return
    vision = config["vision_config"]
    common = {"patch_size": vision.get("patch_size", 16), "temporal_patch_size": vision.get("temporal_patch_size", 2),
              "merge_size": vision.get("spatial_merge_size", 2), "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "processor_class": "Qwen3VLProcessor"}
    (hf / "preprocessor_config.json").write_text(json.dumps({
        **common, "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "image_processor_type": "Qwen2VLImageProcessorFast"}, indent=2))
    (hf / "video_preprocessor_config.json").write_text(json.dumps({
        **common, "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "video_processor_type": "Qwen3VLVideoProcessor"}, indent=2))


def mark_name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", model)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=540)
    parser.add_argument("--step-timeout-s", type=float, default=300, help="a step's longest run (then killed)")
    parser.add_argument("--done-dir", type=Path, help="marks of the models whose steps all ran; those are skipped")
    parser.add_argument("--device", default="cuda", help="where the random HF weights are made (cpu to try the script)")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    # mbridge 0.15.1 does not run with megatron-core 0.19.2 (ModelType.encoder_and_decoder is gone): PEERS=... mbridge.
    default_peers = os.environ.get("PEERS", "mb swift").split()
    started = time.perf_counter()
    shutil.rmtree(options.work, ignore_errors=True)  # what an earlier, stopped run left would fill the disk
    left_over = False

    def record(entry: dict) -> None:
        print(json.dumps(entry)[:2000], flush=True)
        with open(options.out / "peers.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")

    def left() -> float:
        return options.deadline_s - (time.perf_counter() - started)

    cut_short = []  # steps of the model in hand that the deadline, not their own time limit, stopped

    def step(command: list[str], env: dict[str, str]) -> dict:
        limit = max(1.0, min(options.step_timeout_s, left()))
        result = timed(command, env, options.out / "peers.log", timeout=limit)
        if result["exit"] == "timeout" and limit < options.step_timeout_s:
            cut_short.append(command)
        return result

    def exported(model: str, peer: str, reference: dict, back: Path) -> None:
        """The HF export in `back` against the original files, then removed (the disk holds a few models' copies)."""
        if back.exists() and any(back.glob("*.safetensors")):
            try:
                record({"model": model, "peer": peer, "compare": "HF export vs the original HF files", **compare(reference, hf_tensors(back))})
            except Exception as error:  # a broken export is a result too
                record({"model": model, "peer": peer, "compare": "HF export vs the original HF files", "error": repr(error)[:1500]})
        shutil.rmtree(back, ignore_errors=True)

    for spec in options.models:
        model, _, named = spec.partition("#")
        peers = ["mconvert", *(named.replace(",", " ").split() if named else default_peers)]
        if options.done_dir and (options.done_dir / mark_name(spec)).exists():
            record({"model": model, "skipped": "done in an earlier run"})
            continue
        if left() < 60:
            record({"model": model, "skipped": "deadline"})
            left_over = True
            continue
        work = options.work / mark_name(model)
        shutil.rmtree(work, ignore_errors=True)
        hf = work / "hf"
        config = model_config(model)
        config["torch_dtype"] = "bfloat16"
        t0 = time.perf_counter()
        try:
            if config.get("model_type") in SAVED_BY_TRANSFORMERS:
                make_hf_checkpoint(config, hf, dtype="bfloat16")
            else:
                write_random_hf_checkpoint(config, hf, device=options.device)
        except Exception as error:  # a config this source cannot make: the other models go on
            record({"model": model, "written": None, "error": repr(error)[:1500]})
            shutil.rmtree(work, ignore_errors=True)
            continue
        write_word_tokenizer(hf, config.get("vocab_size") or config["text_config"]["vocab_size"])
        # ms-swift asserts an end-of-sequence token for some templates (Qwen3's): name one.
        tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
        (hf / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "w0"}))
        write_processor(hf, config)
        # A checkpoint that ships its own code (MiniMax-M2.7's, Nemotron-H's auto_map) under a model_type transformers has
        # its own class for: the code files are not here, and ms-swift loads configs with trust_remote_code=True, which
        # would look for configuration_*.py. Without auto_map's AutoConfig transformers' own class reads it (as
        # mconvert does); auto_map's AutoModelForCausalLM stays (Megatron-Bridge picks its bridge by that name).
        written = json.loads((hf / "config.json").read_text())
        if "AutoConfig" in written.get("auto_map", {}):
            written["auto_map"] = {k: v for k, v in written["auto_map"].items() if k != "AutoConfig"}
            (hf / "config.json").write_text(json.dumps(written, indent=2) + "\n")
        size = sum(p.stat().st_size for p in hf.iterdir())
        model_type = json.loads((hf / "config.json").read_text())["model_type"]
        record({"model": model, "written": str(hf), "bytes": size, "model_type": model_type, "seconds": round(time.perf_counter() - t0, 1),
                "peers": peers[1:]})
        subprocess.run(["sync"])
        record({"model": model, "peer": "cp -r", **timed(["cp", "-r", str(hf), str(work / "copy")], dict(os.environ), options.out / "peers.log"),
                "bytes": size})
        shutil.rmtree(work / "copy")
        reference = hf_tensors(hf)
        checkpoints = {}
        complete = True
        cut_short.clear()
        for peer in peers:
            if left() < 20:
                record({"model": model, "peer": peer, "skipped": "deadline"})
                complete = False
                continue
            mcore, back = work / f"{peer}-mcore", work / f"{peer}-hf"
            env = peer_env(peer)
            name, command = hf_to_mcore_step(peer, hf, mcore, back, model_type)
            record({"model": model, "peer": peer, "step": name, **step(command, env)})
            if any(mcore.rglob(".metadata")):
                checkpoints[peer] = mcore
                export_step = mcore_to_hf_step(peer, hf, mcore, back)
                if export_step and left() >= 20:
                    record({"model": model, "peer": peer, "step": export_step[0], **step(export_step[1], env)})
                elif export_step:
                    record({"model": model, "peer": peer, "step": export_step[0], "skipped": "deadline"})
                    complete = False
            exported(model, peer, reference, back)
        if "mconvert" in checkpoints:
            ours = torch_dist_tensors(checkpoints["mconvert"])
            for peer, mcore in checkpoints.items():
                if peer == "mconvert":
                    continue
                try:
                    record({"model": model, "peer": peer, "compare": "torch_dist vs mconvert's", **compare(ours, torch_dist_tensors(mcore))})
                except Exception as error:  # a checkpoint that torch cannot read is a result too
                    record({"model": model, "peer": peer, "compare": "torch_dist vs mconvert's", "error": repr(error)[:1500]})
                if left() < 20:
                    record({"model": model, "peer": f"mconvert from {peer}'s", "skipped": "deadline"})
                    complete = False
                    continue
                # mconvert's export of the peer's checkpoint.
                back = work / f"mconvert-from-{peer}"
                result = step([sys.executable, "-m", "mconvert.cli", "mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back),
                               "--hf-config", str(hf), "--quiet"], peer_env("mconvert"))
                record({"model": model, "peer": f"mconvert from {peer}'s", "step": "mcore-to-hf", **result})
                exported(model, f"mconvert from {peer}'s", reference, back)
            del ours
        del reference
        shutil.rmtree(work, ignore_errors=True)
        complete &= not cut_short
        if complete and options.done_dir:
            options.done_dir.mkdir(parents=True, exist_ok=True)
            (options.done_dir / mark_name(spec)).touch()
        left_over |= not complete
    return 3 if left_over else 0


if __name__ == "__main__":
    sys.exit(main())
