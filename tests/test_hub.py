"""Hub ids: `--load-dir Org/Name` resolved from a hub cache in huggingface_hub's own layout (built here, no
network): `HF_HUB_CACHE` or `HF_HOME`, `--revision`, and HF_HUB_OFFLINE with a clear error naming what is
missing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mconvert.errors import ConversionError
from mconvert.hub import resolve_hf_dir

REPO = "tiny-org/qwen-tiny"
COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40


def add_snapshot(cache: Path, repo: str, commit: str, source: Path, refs: tuple[str, ...] = ("main",), skip: tuple[str, ...] = ()) -> Path:
    """Put the files of `source` into `cache` as huggingface_hub stores a download: content-addressed blobs,
    a snapshot directory of links to them per commit, and refs naming commits."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.name in skip:
            continue
        data = path.read_bytes()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_local_directory_wins(hf_model_factory, offline):
    hf = hf_model_factory("qwen2.5-7b-instruct")
    assert resolve_hf_dir(str(hf), "--load-dir") == hf


def test_hub_id_from_cache_at_revision(hf_model_factory, tmp_path, offline):
    cache = tmp_path / "hub"
    main = add_snapshot(cache, REPO, COMMIT, hf_model_factory("qwen2.5-7b-instruct"))
    tagged = add_snapshot(cache, REPO, OTHER_COMMIT, hf_model_factory("qwen2.5-7b-instruct", layers=3), refs=("v2",))
    assert resolve_hf_dir(REPO, "--load-dir", cache_dir=cache) == main
    assert resolve_hf_dir(REPO, "--load-dir", revision="v2", cache_dir=cache) == tagged
    assert resolve_hf_dir(REPO, "--load-dir", revision=OTHER_COMMIT, cache_dir=cache) == tagged


def test_offline_errors_name_what_is_missing(hf_model_factory, tmp_path, offline):
    cache = tmp_path / "hub"
    with pytest.raises(ConversionError, match=rf"--load-dir {REPO}: .*HF_HUB_OFFLINE.*the repository of {REPO}"):
        resolve_hf_dir(REPO, "--load-dir", cache_dir=cache)
    add_snapshot(cache, REPO, COMMIT, hf_model_factory("qwen2.5-7b-instruct", max_shard_size="200KB"), skip=("model-00002-of-00004.safetensors",))
    with pytest.raises(ConversionError, match=r"lacks model-00002-of-00004.safetensors of"):
        resolve_hf_dir(REPO, "--load-dir", cache_dir=cache)
    # --hf-config needs no weights: the same partial snapshot serves it.
    assert (resolve_hf_dir(REPO, "--hf-config", weights=False, cache_dir=cache) / "config.json").exists()
    with pytest.raises(ConversionError, match=rf"lacks the repository of {REPO} at revision v9 \(download it with `hf download {REPO} --revision v9`"):
        resolve_hf_dir(REPO, "--load-dir", revision="v9", cache_dir=cache)


def test_a_cached_index_that_is_no_index(hf_model_factory, tmp_path, offline):
    """The cache's index is read to list the shards a snapshot lacks: one that is not an index is a one-line error,
    as the conversion's own read of it is."""
    cache = tmp_path / "hub"
    snapshot = add_snapshot(cache, REPO, COMMIT, hf_model_factory("qwen2.5-7b-instruct", max_shard_size="200KB"))
    index = snapshot / "model.safetensors.index.json"
    index.unlink()
    index.write_text("[1, 2]")
    with pytest.raises(ConversionError, match=r"model.safetensors.index.json: not a safetensors index"):
        resolve_hf_dir(REPO, "--load-dir", cache_dir=cache)


def test_not_a_directory_nor_an_id(tmp_path):
    with pytest.raises(ConversionError, match=r"--load-dir .*: no such directory \(nor a hub id\)"):
        resolve_hf_dir(str(tmp_path / "a" / "b" / "c"), "--load-dir")


def test_cli_converts_a_hub_id_offline_from_hf_home(hf_model_factory, tmp_path):
    """The command line, as a user runs it: HF_HOME's hub cache, HF_HUB_OFFLINE, a hub id."""
    add_snapshot(tmp_path / "home" / "hub", REPO, COMMIT, hf_model_factory("qwen2.5-7b-instruct"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {"HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = tmp_path / "mcore"
    run = subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", REPO, "--save-dir", str(out), "--quiet"],
        env=env, capture_output=True, text=True,
    )
    assert run.returncode == 0, run.stderr
    assert (out / "release" / ".metadata").exists()
    missing = subprocess.run(
        [sys.executable, "-m", "mconvert.cli", "hf-to-mcore", "--load-dir", "tiny-org/absent", "--save-dir", str(tmp_path / "x")],
        env=env, capture_output=True, text=True,
    )
    assert missing.returncode == 1
    assert missing.stderr.startswith("mconvert: error: --load-dir tiny-org/absent: ") and "HF_HUB_OFFLINE" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
