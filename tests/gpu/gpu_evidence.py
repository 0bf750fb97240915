"""The work behind the GPU tests, done once a session for the cases pytest selected, then checked case by case.

Device time is scarce and a torchrun with Megatron-LM and Transformer Engine imported costs 20-40 s before its first
job, so the work is batched: on the CPU, one HF model a family (mconvert.synthetic) and its conversions at the
selected layouts (`mconvert hf-to-mcore`, several at once); then, side by side,
- SHARDS torchruns of four ranks (tests/gpu/megatron_lm_worker.py), the layout cases dealt among them, each loading
  its checkpoints in turn with Megatron-LM and running `mconvert verify` (a torchrun that dies is started again on
  the jobs left, the job it died in failed with its error);
- the training cases, one scripts/gpu/gpu_train.py a family on one GPU, up to TRAINING_PER_GPU at a time a GPU;
- transformers' fp32 logits of each family on the CPU (tests/gpu/hf_reference.py), the reference (on the GPU for a
  family whose own logits depend on the device: gpu_cases.Family.reference_on_gpu).
Everything lands in files under the session's folder; a test waits for its own case's and checks it.

Environment: MCONVERT_GPU_TESTS_DEVICE=cpu rehearses the layout cases on CPU gloo ranks (local spec, as the CPU tests
run Megatron-LM; the training cases skip: Megatron-LM's pretrain needs CUDA). MCONVERT_GPU_DEADLINE_S: seconds
from the first test's start after which no job starts (default 3000). MCONVERT_GPU_SHARDS (default 3).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from gpu_cases import FAMILY, LAYOUTS, Family, case_id

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# The prompts of the layout cases: longer than any window (gpt-oss's, 32 here), sparse attention's top-k (32) and
# Mamba's scan chunk (128).
PROMPTS, PROMPT_TOKENS = 2, 160
# A job still running after this long is taken as hung: its torchrun is stopped and the job fails (gated delta-net's
# first, which compiles flash-linear-attention's kernels, took about 100 s on an H100 at real width).
JOB_LIMIT_S = 300
TRAINING_PER_GPU = 2
# A training case is not started with less than this left before the deadline (one took about 2 minutes at real width).
TRAINING_S = 120
# Matrices at std 0.1: attention far from uniform over the prompts (tests/megatron_lm/test_hybrid.py).
WEIGHT_STD = 0.1


def device() -> str:
    return os.environ.get("MCONVERT_GPU_TESTS_DEVICE", "cuda")


@dataclasses.dataclass
class Outcome:
    """What a job left: its result file, or why there is none."""

    path: Path | None = None
    error: str | None = None
    skipped: str | None = None  # not run: why


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _environment(megatron: bool = False) -> dict[str, str]:
    """A subprocess's: this repository first on its path; where megatron-core's layers run (`megatron`), also the
    kernels' packages (MCONVERT_GPU_KERNELS_PATH: flash-linear-attention, mamba_ssm, which scripts/gpu/run_gpu_tests.sh
    installs apart: transformers on the CPU would take their GPU kernels) and flash-linear-attention's autotuners cut to
    one config each (scripts/gpu/fla_one_config: no compiling and timing of every config on a machine without a cache)."""
    paths = [str(REPO), os.environ.get("PYTHONPATH", "")]
    if megatron:
        paths[:0] = [str(REPO / "scripts" / "gpu" / "fla_one_config"), os.environ.get("MCONVERT_GPU_KERNELS_PATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}


class Evidence:
    def __init__(self, work: Path, layout_cases: list[tuple[str, str]], training: list[str], deadline: float):
        self.work, self.deadline = work, deadline
        self.layout_cases, self.training = layout_cases, training
        self.device = device()
        self.gpus = self._gpu_count()
        self.spec = "te" if importlib.util.find_spec("transformer_engine") else "local"
        self.threads: list[threading.Thread] = []
        self.finished: dict[str, threading.Event] = {}
        self.failures: dict[str, str] = {}  # what stopped a whole part of the work
        self.lock = threading.Lock()
        self.processes: list[subprocess.Popen] = []

    def _gpu_count(self) -> int:
        if self.device == "cpu":
            return 0
        import torch

        return torch.cuda.device_count()

    # -- the work -----------------------------------------------------------------------------------------------
    def start(self) -> None:
        families = list(dict.fromkeys([family for family, _ in self.layout_cases] + self.training))
        self.hf = {name: self.work / "hf" / name for name in families}
        for name in list(families):
            try:
                self._make_hf_model(FAMILY[name], self.hf[name])
            except Exception:  # noqa: BLE001 (the family's cases fail with it; the others go on)
                self.failures[f"hf {name}"] = f"its HF model could not be made:\n{traceback.format_exc()[-3000:]}"
                families.remove(name)
        self.training = [name for name in self.training if name in families]
        self.layout_cases = [case for case in self.layout_cases if case[0] in families]
        if self.training:
            self._in_background("training", self._train)
        if self.layout_cases:
            self._write_tokens()
            self.references = self.work / "reference"
            self._in_background("reference", self._reference, [f for f in families if any(f == c[0] for c in self.layout_cases)])
            self._convert_layout_cases()
            self._start_shards()

    def _in_background(self, name: str, target, *args) -> None:
        event = self.finished.setdefault(name, threading.Event())

        def run() -> None:
            try:
                target(*args)
            except BaseException as error:  # noqa: BLE001 (said by every test that waits on this part)
                self.failures[name] = f"{type(error).__name__}: {error}"
            finally:
                event.set()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _make_hf_model(self, family: Family, hf: Path) -> None:
        from mconvert.synthetic import add_mtp_layers, make_hf_checkpoint, real_config, shrink, write_word_tokenizer

        if (hf / "config.json").exists():
            return
        config = real_config(family.config)
        if family.text_only:
            config = text_only_config(config)
        make_hf_checkpoint(shrink(config, layers=family.layers, **family.overrides), hf, weight_std=WEIGHT_STD)
        if family.mtp:
            add_mtp_layers(hf)
        # Megatron-LM's HuggingFaceTokenizer, which MODEL_ARGS then name, reads it; verify's built-in prompts need none.
        write_word_tokenizer(hf, 1000)

    def _write_tokens(self) -> None:
        import torch

        self.tokens = self.work / "tokens.pt"
        torch.save(torch.randint(0, 1000, (PROMPTS, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0)), self.tokens)

    def checkpoint(self, family: str, layout: str) -> Path:
        return self.work / "mcore" / case_id(family, layout)

    def _convert_layout_cases(self) -> None:
        """`mconvert hf-to-mcore` of every layout case, eight at a time (a small model's takes about a second)."""
        def convert(case: tuple[str, str]) -> None:
            family, layout = case
            ckpt = self.checkpoint(family, layout)
            log = ckpt.with_suffix(".convert.log")
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "w") as out:
                done = subprocess.run(
                    [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", str(self.hf[family]), "--save-dir",
                     str(ckpt), "--overwrite", "--model-class", FAMILY[family].model_class, *LAYOUTS[layout].flags()],
                    stdout=out, stderr=subprocess.STDOUT, env=_environment(), cwd=REPO,
                )
            if done.returncode:
                self.failures[f"convert {case_id(family, layout)}"] = f"hf-to-mcore exit {done.returncode}:\n{tail(log)}"

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(convert, self.layout_cases))

    def _jobs(self) -> list[dict]:
        jobs = []
        for family, layout in self.layout_cases:
            if f"convert {case_id(family, layout)}" in self.failures:
                continue
            for part in ("megatron_lm", "verify"):
                layout_ = LAYOUTS[layout]
                jobs.append({
                    "name": f"{case_id(family, layout)}.{part}", "part": part, "family": family, "layout_name": layout,
                    "hf": str(self.hf[family]), "ckpt": str(self.checkpoint(family, layout)),
                    "layout": {"tp": layout_.tp, "pp": layout_.pp, "ep": layout_.ep, "etp": layout_.etp},
                    "layout_flags": layout_.flags(), "megatron_flags": list(FAMILY[family].megatron_flags),
                    "device": self.device, "spec": self.spec,
                })
        return jobs

    def _start_shards(self) -> None:
        """The layout cases dealt among SHARDS torchruns of each world size, each torchrun's in layout order (its
        parallel state made anew only at a change of layout), a case's two parts together."""
        order = {name: index for index, name in enumerate(LAYOUTS)}
        # The cases whose kernels compile dealt first, one a torchrun in turn: each torchrun compiles them once.
        cases = sorted(self.layout_cases, key=lambda case: (not FAMILY[case[0]].compiles_kernels, order[case[1]]))
        shards = max(1, min(int(os.environ.get("MCONVERT_GPU_SHARDS", "3")), len(cases)))
        dealt = {case: (LAYOUTS[case[1]].world, index % shards) for index, case in enumerate(cases)}
        self.outputs = self.work / "megatron_lm"
        self.outputs.mkdir(exist_ok=True)
        self.shard_of = {}
        jobs = self._jobs()
        for world, shard in sorted(set(dealt.values())):
            name = f"shard{shard}-world{world}"
            mine = sorted((job for job in jobs if dealt[(job["family"], job["layout_name"])] == (world, shard)),
                          key=lambda job: order[job["layout_name"]])
            self.shard_of.update({job["name"]: name for job in mine})
            self._in_background(name, self._run_shard, name, world, mine)

    def _run_shard(self, shard: str, world: int, jobs: list[dict]) -> None:
        """torchruns of the shard's jobs until each is done or failed, or the deadline."""
        plan = self.work / f"{shard}.json"
        plan.write_text(json.dumps({"jobs": jobs, "tokens": str(self.tokens), "deadline": self.deadline}, indent=1))
        for launch in range(len(jobs) + 1):
            left = [job["name"] for job in jobs if not self._ended(job["name"])]
            if not left or time.time() > self.deadline:
                return
            log = self.work / f"{shard}-{launch}.log"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                       str(HERE / "megatron_lm_worker.py"), str(plan), str(self.outputs)]
            with open(log, "w") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=_environment(megatron=True))
            with self.lock:
                self.processes.append(process)
            self._watch(process, log, left)
            # The job it was in when it ended, unfinished, failed: said with the torchrun's log. A torchrun that
            # ended before any job of its own ended (its start failed) is not started again: its jobs fail with it.
            # One that ended well stopped at the deadline: its jobs left are not run.
            progress = any(self._ended(name) for name in left)
            for name in left if process.returncode else []:
                if not self._ended(name) and ((self.outputs / f"{name}.started").exists() or not progress):
                    (self.outputs / f"{name}.error").write_text(
                        f"the torchrun ended (exit {process.returncode}) in this job; its log's end:\n{tail(log)}")

    def _watch(self, process: subprocess.Popen, log: Path, jobs: list[str]) -> None:
        """Wait for the torchrun; stop it past the deadline, or when one of its jobs has run JOB_LIMIT_S."""
        while process.poll() is None:
            time.sleep(1)
            started = [self.outputs / f"{name}.started" for name in jobs if not self._ended(name)]
            too_long = any(path.exists() and time.time() - path.stat().st_mtime > JOB_LIMIT_S for path in started)
            if too_long or time.time() > self.deadline + JOB_LIMIT_S:
                with open(log, "a") as out:
                    out.write(f"\n[gpu_evidence] stopped: {'a job ran past ' + str(JOB_LIMIT_S) + ' s' if too_long else 'deadline'}\n")
                end(process)

    def _ended(self, name: str) -> bool:
        return (self.outputs / f"{name}.done").exists() or (self.outputs / f"{name}.error").exists()

    def reference_device(self, family: str) -> str:
        """Where transformers' reference runs: the CPU, or the Megatron side's device for a family whose own logits
        depend on it (gpu_cases.Family.reference_on_gpu)."""
        return self.device if FAMILY[family].reference_on_gpu else "cpu"

    def _reference(self, families: list[str]) -> None:
        """transformers' fp32 logits of the prompts, a family at a time, on reference_device (tests/gpu/hf_reference.py)."""
        log = self.work / "reference.log"
        for where in dict.fromkeys(self.reference_device(name) for name in families):
            with open(log, "a") as out:
                done = subprocess.run(
                    [sys.executable, str(HERE / "hf_reference.py"), "--tokens", str(self.tokens), "--out", str(self.references),
                     "--device", where, *(f"{name}={self.hf[name]}" for name in families if self.reference_device(name) == where)],
                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=_environment(),
                )
            if done.returncode:
                raise RuntimeError(f"hf_reference.py exit {done.returncode}:\n{tail(log)}")

    def _train(self) -> None:
        """One scripts/gpu/gpu_train.py a family (Megatron-LM's pretrain: CUDA only): those at a layout of several GPUs
        first, one at a time on the first GPUs; then those on one GPU, TRAINING_PER_GPU at a time a GPU."""
        if self.device == "cpu" or not self.gpus:
            return
        for family in [name for name in self.training if LAYOUTS[FAMILY[name].training].world > 1]:
            self._train_one(family, list(range(LAYOUTS[FAMILY[family].training].world)))
        slots = [gpu for gpu in range(self.gpus) for _ in range(TRAINING_PER_GPU)]
        free = list(slots)
        lock = threading.Condition()

        def train(family: str) -> None:
            with lock:
                lock.wait_for(lambda: free)
                gpu = free.pop(0)
            try:
                self._train_one(family, [gpu])
            finally:
                with lock:
                    free.append(gpu)
                    lock.notify()

        one_gpu = [name for name in self.training if LAYOUTS[FAMILY[name].training].world == 1]
        with concurrent.futures.ThreadPoolExecutor(len(slots)) as pool:
            list(pool.map(train, sorted(one_gpu, key=lambda family: not FAMILY[family].compiles_kernels)))

    def training_dir(self, family: str) -> Path:
        return self.work / "train" / family

    def _train_one(self, family: str, gpus: list[int]) -> None:
        work = self.training_dir(family)
        (work / "models").mkdir(parents=True, exist_ok=True)
        # gpu_train.py writes an HF model of the job's MODEL into its --work unless one is there: the family's is.
        model = work / "models" / family
        if not model.exists():
            model.symlink_to(self.hf[family])
        left = self.deadline - time.time()
        if left < TRAINING_S:
            (work / "skipped").write_text(f"not started: less than {TRAINING_S} s before the deadline")
            (work / "ended").write_text("")
            return
        options = FAMILY[family]
        command = [sys.executable, str(REPO / "scripts" / "gpu" / "gpu_train.py"), "--nproc", str(len(gpus)), "--work",
                   str(work / "models"), "--out", str(work), "--deadline-s", str(int(left)), *options.train_options,
                   *(f"--megatron-flag={flag}" for flag in options.megatron_flags),
                   f"{family}:{options.training}"]
        with open(work / "gpu_train.log", "w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                       env={**_environment(megatron=True),
                                            "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))})
        with self.lock:
            self.processes.append(process)
        process.wait()
        (work / "ended").write_text(str(process.returncode))

    # -- what a test waits for ----------------------------------------------------------------------------------
    def _wait(self, part: str, ready) -> None:
        event = self.finished.get(part)
        while not ready() and event is not None and not event.is_set():
            time.sleep(0.5)

    def layout_outcome(self, family: str, layout: str, part: str) -> Outcome:
        for stage in (f"hf {family}", f"convert {case_id(family, layout)}"):
            if (failure := self.failures.get(stage)) is not None:
                return Outcome(error=failure)
        name = f"{case_id(family, layout)}.{part}"
        self._wait(self.shard_of[name], lambda: self._ended(name))
        if (self.outputs / f"{name}.done").exists():
            return Outcome(path=self.outputs / (f"{name}.pt" if part == "megatron_lm" else f"{name}.json"))
        if (self.outputs / f"{name}.error").exists():
            return Outcome(error=tail(self.outputs / f"{name}.error", 6000))
        if (failure := self.failures.get(self.shard_of[name])) is not None:
            return Outcome(error=failure)
        return Outcome(skipped="not run before the deadline")

    def reference(self, family: str) -> Outcome:
        made, failed = self.references / f"{family}.pt", self.references / f"{family}.error"
        self._wait("reference", lambda: made.exists() or failed.exists())
        if made.exists():
            return Outcome(path=made)
        return Outcome(error=tail(failed) if failed.exists() else self.failures.get("reference", "no reference was made"))

    def training_outcome(self, family: str) -> Outcome:
        if self.device == "cpu":
            return Outcome(skipped="Megatron-LM's pretrain runs on CUDA only (MCONVERT_GPU_TESTS_DEVICE=cpu)")
        if (failure := self.failures.get(f"hf {family}")) is not None:
            return Outcome(error=failure)
        work = self.training_dir(family)
        self._wait("training", lambda: (work / "ended").exists())
        if (work / "train.jsonl").exists():
            return Outcome(path=work / "train.jsonl")
        if (work / "skipped").exists():
            return Outcome(skipped=(work / "skipped").read_text())
        return Outcome(error=self.failures.get("training") or f"gpu_train.py wrote no result; its log's end:\n{tail(work / 'gpu_train.log')}")

    def stop(self) -> None:
        """At the session's end: nothing of this session's left running."""
        with self.lock:
            for process in self.processes:
                end(process)


def end(process: subprocess.Popen) -> None:
    """Stop a process and what it started (torchrun's ranks, gpu_train.py's torchruns): SIGTERM, SIGKILL 30 s later.
    They stay in pytest's process group (no session of their own), so that a timeout that stops pytest stops them too."""
    import psutil

    if process.poll() is not None:
        return
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(tree, timeout=30)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    process.wait()


def text_only_config(config: dict) -> dict:
    """The text-only checkpoint of an image-text config: its text_config as the model, with the class its family
    maps for that model type (mconvert.mappings)."""
    from mconvert.mappings import family_for_config

    text = dict(config["text_config"])
    family = family_for_config(text)
    text["architectures"] = [name for name, model_type in family.architectures if model_type == text["model_type"]]
    return text
