"""Coverage-guided fuzzing of the readers mconvert parses files with itself, from real seeds.

    python scripts/fuzz/fuzz_readers.py --all --seconds 60 --out /tmp/fuzz   # each target for 60 s
    python scripts/fuzz/fuzz_readers.py --all --runs 300                      # CI's short budget (seeded)
    python scripts/fuzz/fuzz_readers.py config CRASH_FILE                     # one input again

Atheris: libFuzzer mutating the bytes of the seeds, steered by the coverage of mconvert's code (instrumented as it
is imported) and by the comparisons it makes. Hypothesis generates structured values but does not steer by
coverage; mutated bytes are what a corrupt download or a hostile file is. Targets (each in a process of its own,
so that libFuzzer's limits hold per target):

  safetensors-header  a shard's header (mconvert.formats.safetensors.read_header)
  safetensors-index   model.safetensors.index.json (read_weight_map)
  config              config.json, through its family's config rules (read_hf_config, get_mapping) into the plan
                      and Megatron-LM's arguments, as hf-to-mcore makes them before it reads a weight
  hf-sources          a whole small MoE model's model.safetensors, its tensors' names, dtypes and shapes held against
                      the plan of converting it at EP 2 (import_plan: what hf-to-mcore checks before it reads a weight)
  dcp-metadata        a torch_dist checkpoint's .metadata pickle (DCPCheckpoint)
  common-pt           its common.pt, a torch.save zip of a pickle (read_args), then the model its args describe
  legacy-rank         a legacy per-rank model_optim_rng.pt (read_rank_files)
  tracker             latest_checkpointed_iteration.txt (iteration_dir)
  fsdp-save           an FSDP run's .metadata, its names read as the model's and its stored args as a model
                      (open_megatron_checkpoint, plan_export)

The contract: every input is read, or ends in a ConversionError (the command line's one-line `mconvert: error:`);
any other exception is a crash, as is an input taking over --timeout-s seconds or the process growing past
--rss-limit-mb. Crashing inputs are written to OUT/TARGET-crash-*; each becomes a case in
tests/test_bad_input_catalogue.py. Seeds come from a small Qwen2.5 and Qwen3-MoE that the script makes and converts
(OUT/seeds), and every config mconvert ships.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGETS = ("safetensors-header", "safetensors-index", "config", "hf-sources", "dcp-metadata", "common-pt", "legacy-rank", "tracker",
           "fsdp-save")
# A save Megatron-LM made under FSDP2 on a GPU (tests/fixtures/fsdp): the fsdp-save target's seed and data file.
FSDP_SAVE = REPO / "tests" / "fixtures" / "fsdp" / "torch_dcp-llama" / "save" / "iter_0000002"


def check(read, data: bytes) -> None:
    """Reads `data` with `read`: a ConversionError is the contract kept; any other exception propagates (a crash)."""
    from mconvert.errors import ConversionError

    try:
        read(data)
    except ConversionError:
        pass


def make_seeds(seeds: Path) -> None:
    """One directory of seed files per target, from checkpoints made and converted here."""
    import torch

    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.checkpoint import iteration_dir
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

    work = seeds / "work"
    dense = make_hf_checkpoint(shrink(real_config("qwen2.5-0.5b"), layers=1), work / "dense", max_shard_size="200KB")
    moe = make_hf_checkpoint(shrink(real_config("qwen3-30b-a3b"), layers=1), work / "moe")
    convert_hf_to_mcore(moe, work / "mcore", parallelism=Parallelism(ep=2), overwrite=True)
    release = iteration_dir(work / "mcore")
    files = {
        "safetensors-header": [min(dense.glob("*.safetensors"), key=lambda p: p.stat().st_size)],
        "safetensors-index": [dense / "model.safetensors.index.json"],
        "config": sorted((REPO / "mconvert" / "configs").glob("*.json")),
        "hf-sources": [moe / "model.safetensors"],
        "dcp-metadata": [release / ".metadata"],
        "common-pt": [release / "common.pt"],
        "fsdp-save": [FSDP_SAVE / ".metadata"],
    }
    for target, paths in files.items():
        (seeds / target).mkdir(parents=True, exist_ok=True)
        for path in paths:
            (seeds / target / path.name).write_bytes(path.read_bytes())
    (seeds / "tracker").mkdir(exist_ok=True)
    (seeds / "tracker" / "release").write_text("release")
    (seeds / "tracker" / "iteration").write_text("1000\n")
    legacy = seeds / "legacy-rank"
    legacy.mkdir(exist_ok=True)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, num_layers=1)
    torch.save({"args": args, "iteration": 10, "model": {"embedding.word_embeddings.weight": torch.ones(4, 2)}}, legacy / "model_optim_rng.pt")


def readers(scratch: Path, seeds: Path):
    """Each target's reader of the bytes it is given, writing them where the real reader finds its file."""
    from mconvert.converters.hf_to_mcore import import_plan
    from mconvert.converters.mcore_sources import open_megatron_checkpoint
    from mconvert.converters.mcore_to_hf import plan_export
    from mconvert.converters.plan import build_plan
    from mconvert.formats.dcp import DCPCheckpoint
    from mconvert.formats.hf_checkpoint import read_hf_config
    from mconvert.formats.legacy_torch import read_rank_files
    from mconvert.formats.safetensors import read_header
    from mconvert.json_files import read_weight_map
    from mconvert.mappings import get_mapping
    from mconvert.mcore.checkpoint import TRACKER_FILE, iteration_dir, read_args
    from mconvert.mcore.parallelism import Parallelism
    from mconvert.megatron_lm.args import megatron_args
    from mconvert.megatron_lm.flags import megatron_flags
    from mconvert.megatron_lm.spec_from_args import spec_from_args

    release = scratch / "release"
    release.mkdir(exist_ok=True)
    # The data files the seed's .metadata names, beside it.
    for data in (seeds / "work" / "mcore").rglob("*.distcp"):
        target = release / data.name
        if not target.exists():
            target.symlink_to(data)
    fsdp = scratch / "fsdp"
    fsdp.mkdir(exist_ok=True)
    for data in FSDP_SAVE.glob("*.distcp"):
        if not (fsdp / data.name).exists():
            (fsdp / data.name).symlink_to(data)
    rank_dir = scratch / "legacy" / "mp_rank_00"
    rank_dir.mkdir(parents=True, exist_ok=True)
    model = scratch / "hf"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_bytes((seeds / "work" / "moe" / "config.json").read_bytes())

    def written(path: Path, data: bytes) -> Path:
        path.write_bytes(data)
        return path

    def fsdp_save(data: bytes) -> None:
        plan_export(open_megatron_checkpoint(written(fsdp / ".metadata", data).parent))

    def planned(data: bytes) -> None:
        family, spec = get_mapping(read_hf_config(written(scratch / "config.json", data).parent, "--load-dir"))
        plan = build_plan(family, spec, Parallelism())
        megatron_flags(megatron_args(spec, Parallelism(), plan.dtype, "transformer_engine"))

    def sources(data: bytes) -> None:
        written(model / "model.safetensors", data)
        config = read_hf_config(model, "--load-dir")
        family, spec = get_mapping(config)
        import_plan(model, config, family, spec, Parallelism(ep=2), None, mtp=True, allow_nonfinite=False)

    def common(data: bytes) -> None:
        written(release / "common.pt", data)
        spec_from_args(read_args(release), "qwen3_moe")

    return {
        "safetensors-header": lambda data: read_header(written(scratch / "model.safetensors", data)),
        "safetensors-index": lambda data: read_weight_map(written(scratch / "model.safetensors.index.json", data)),
        "config": planned,
        "hf-sources": sources,
        "dcp-metadata": lambda data: DCPCheckpoint(written(release / ".metadata", data).parent),
        "common-pt": common,
        "legacy-rank": lambda data: read_rank_files(written(rank_dir / "model_optim_rng.pt", data).parent.parent),
        "tracker": lambda data: iteration_dir(written(scratch / TRACKER_FILE, data).parent),
        "fsdp-save": fsdp_save,
    }


def fuzz_one(target: str, out: Path, libfuzzer_flags: list[str]) -> None:
    """In this process: instrument mconvert, then hand the target to libFuzzer (which exits the process)."""
    import atheris

    with atheris.instrument_imports(include=["mconvert"]):
        import mconvert.converters.hf_to_mcore  # noqa: F401  (instrumented: its coverage steers the fuzzer)
        import mconvert.converters.plan  # noqa: F401
        import mconvert.formats.dcp  # noqa: F401
        import mconvert.formats.hf_checkpoint  # noqa: F401
        import mconvert.formats.legacy_torch  # noqa: F401
        import mconvert.formats.pickles  # noqa: F401
        import mconvert.formats.safetensors  # noqa: F401
        import mconvert.json_files  # noqa: F401
        import mconvert.mappings  # noqa: F401
        import mconvert.mcore.checkpoint  # noqa: F401
        import mconvert.megatron_lm.spec_from_args  # noqa: F401
    seeds = out / "seeds"
    scratch = Path(tempfile.mkdtemp(prefix=f"fuzz-{target}-"))
    read = readers(scratch, seeds)[target]
    corpus = out / "corpus" / target
    corpus.mkdir(parents=True, exist_ok=True)
    inputs = [flag for flag in libfuzzer_flags if not flag.startswith("-")]
    flags = [flag for flag in libfuzzer_flags if flag.startswith("-")]
    atheris.Setup([sys.argv[0], *flags, f"-artifact_prefix={out}/{target}-", *(inputs or [str(corpus), str(seeds / target)])],
                  lambda data: check(read, data))
    atheris.Fuzz()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", nargs="?", choices=TARGETS)
    parser.add_argument("inputs", nargs="*", help="inputs to run once (a crash file), instead of fuzzing")
    parser.add_argument("--all", action="store_true", help="every target, one after the other")
    parser.add_argument("--seconds", type=int, default=None, help="fuzzing time per target")
    parser.add_argument("--runs", type=int, default=None, help="inputs per target (with --seed: the same each time)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=10, help="the longest one input may take")
    parser.add_argument("--rss-limit-mb", type=int, default=2048, help="the most memory the process may grow to")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "mconvert-fuzz")
    options = parser.parse_args()
    if not all((options.out / "seeds" / target).exists() for target in TARGETS):
        make_seeds(options.out / "seeds")
    budget = [f"--seed={options.seed}", f"--timeout-s={options.timeout_s}", f"--rss-limit-mb={options.rss_limit_mb}"]
    budget += [f"--seconds={options.seconds}"] if options.seconds else []
    budget += [f"--runs={options.runs}"] if options.runs is not None else []
    if options.target and not options.all:
        flags = [f"-seed={options.seed}", f"-timeout={options.timeout_s}", f"-rss_limit_mb={options.rss_limit_mb}", "-print_final_stats=1"]
        flags += [f"-max_total_time={options.seconds}"] if options.seconds else []
        flags += [f"-runs={options.runs}"] if options.runs is not None else []
        fuzz_one(options.target, options.out, flags + [str(Path(i).absolute()) for i in options.inputs])
        return 0
    failed = []
    for target in TARGETS:
        started = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, target, "--out", str(options.out), *budget], capture_output=True,
                              text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        stats = [line for line in done.stderr.splitlines() if line.startswith("stat::number_of_executed_units")]
        print(f"{target}: exit {done.returncode} in {time.perf_counter() - started:.0f} s; {'; '.join(stats)}", flush=True)
        if done.returncode != 0:
            failed.append(target)
            print(done.stderr[-3000:], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
