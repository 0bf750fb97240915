"""`mconvert inspect` on the three formats, the manifest every conversion writes and `inspect --check`, and the
progress a conversion reports."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.manifest import MANIFEST
from mconvert.converters.progress import PlainProgress, progress_for
from mconvert.mcore.parallelism import Parallelism
from tests.tool_saves import copy_hf_config, without_args


@pytest.fixture(scope="module")
def converted(hf_model_factory, tmp_path_factory):
    hf = hf_model_factory("qwen2.5-7b-instruct")
    out = tmp_path_factory.mktemp("inspect") / "mcore"
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(out), "--tp", "2", "--quiet"]) == 0
    return hf, out


def inspect_json(capsys, *argv):
    capsys.readouterr()
    code = main(["inspect", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_inspect_torch_dist(converted, capsys):
    hf, out = converted
    code, report = inspect_json(capsys, str(out))
    assert code == 0
    assert report["format"] == "torch_dist" and report["family"] == "qwen2"
    assert report["written_for"] == {"model_class": "gpt", "tp": 2, "pp": 1, "ep": 1, "etp": 2, "pipeline_split": []}
    # vocab 1000 padded to a multiple of 128 x 2: 1024 rows; TP 1 pads to 1024 as well, TP 4 to 1536.
    assert report["vocab"] == {"size": 1000, "stored_rows": 1024, "padding": 24, "make_vocab_size_divisible_by": 128}
    assert report["suits"] == {"tp": [1, 2, 4], "pp": [1, 2], "ep": [1]}
    assert report["args"]["tensor_model_parallel_size"] == 2
    tensors = {t["name"]: t for t in report["tensors"]}
    assert tensors["embedding.word_embeddings.weight"] == {
        "name": "embedding.word_embeddings.weight", "shape": [1024, 64], "dtype": "float32", "chunks": 2, "chunk_shape": [512, 64]
    }
    assert tensors["decoder.layers.mlp.linear_fc1.weight"]["chunks"] == 2 * 2 * 2  # layers x gate/up x TP
    assert report["files"]["manifest"] is True
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "written for: TP=2 PP=1 EP=1 ETP=2" in text and "24 rows of padding" in text


def test_inspect_hf(converted, capsys):
    hf, _ = converted
    code, report = inspect_json(capsys, str(hf))
    assert code == 0 and report["format"] == "hf" and report["architecture"] == "Qwen2ForCausalLM"
    assert {"name": "model.embed_tokens.weight", "shape": [1000, 64], "dtype": "float32", "file": "model.safetensors"} in report["tensors"]
    assert report["suits"]["tp"] == [1, 2, 4]  # 4 heads; 2 query groups, which TP may divide or be a multiple of
    assert report["files"]["manifest"] is False


def test_inspect_a_save_without_args_says_what_it_holds_and_needs(converted, tmp_path, capsys):
    """A Megatron-LM save without args: its stored tensors, and --hf-config as what it needs; with it, the model, its
    layout not recorded."""
    hf, out = converted
    save = shutil.copytree(out, tmp_path / "save")
    without_args(save)
    code, report = inspect_json(capsys, str(save))
    assert code == 0 and report["tool"] == "Megatron-LM" and "family" not in report
    assert report["needs"].startswith("--hf-config HF_DIR") and "no Megatron-LM args" in report["needs"]
    assert {"name": "embedding.word_embeddings.weight", "shape": [1024, 64], "dtype": "float32", "chunks": 2, "chunk_shape": [512, 64]} in report["tensors"]
    assert main(["inspect", str(save)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert text[0] == f"{save}: torch_dist checkpoint, {len(report['tensors'])} model tensors; which model they are is not recorded"
    assert text[1].startswith("needs: --hf-config HF_DIR") and text[2].startswith(f"then: mconvert inspect {save} --hf-config HF_DIR")
    code, report = inspect_json(capsys, str(save), "--hf-config", str(hf))
    assert code == 0 and report["family"] == "qwen2" and report["written_for"] is None and report["args"] is None
    assert report["vocab"]["stored_rows"] == 1024 and "needs" not in report
    assert main(["inspect", str(save), "--hf-config", str(hf)]) == 0
    assert "written for: not recorded (no Megatron-LM args stored)" in capsys.readouterr().out


def test_inspect_a_tools_run_folder_reads_the_config_its_records_name(converted, tmp_path, capsys):
    """verl's run folder (global_step_<N>/actor/dist_ckpt, the HF config in huggingface/) is read whole; a
    Megatron-Bridge save whose run_config.yaml names a folder that is not there says so, and what it needs."""
    hf, out = converted
    actor = tmp_path / "verl" / "global_step_3" / "actor"
    shutil.copytree(out / "release", actor / "dist_ckpt")
    without_args(actor / "dist_ckpt")
    copy_hf_config(hf, actor / "huggingface")
    code, report = inspect_json(capsys, str(tmp_path / "verl"))
    assert code == 0 and report["tool"] == "verl" and report["family"] == "qwen2"
    assert report["config_from"] == f"{actor / 'huggingface'} (verl's {actor / 'huggingface'})"
    assert report["iteration_dir"] == str(actor / "dist_ckpt")
    bridge = shutil.copytree(out, tmp_path / "bridge")
    without_args(bridge)
    (bridge / "release" / "run_config.yaml").write_text("model:\n  hf_model_id: /nowhere/qwen2-tiny\n")
    code, report = inspect_json(capsys, str(bridge))
    assert code == 0 and report["tool"] == "Megatron-Bridge" and "family" not in report
    assert "/nowhere/qwen2-tiny" in report["needs"] and "run_config.yaml's model.hf_model_id" in report["needs"]


def test_manifest_and_check(converted, tmp_path, capsys):
    _, out = converted
    lines = (out / MANIFEST).read_text().splitlines()
    names = sorted(line.split("  ", 1)[1] for line in lines)
    assert names == sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert "release/__0_0.distcp" in names and "train.sbatch" in names
    capsys.readouterr()
    assert main(["inspect", "--check", str(out)]) == 0
    assert "all match" in capsys.readouterr().out

    back = tmp_path / "back"
    assert main(["mcore-to-hf", "--load-dir", str(out), "--save-dir", str(back), "--quiet"]) == 0
    assert main(["inspect", "--check", str(back)]) == 0
    shard = back / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    (back / "config.json").unlink()
    (back / "extra.txt").write_text("x")
    capsys.readouterr()
    assert main(["inspect", "--check", str(back)]) == 1
    out_text = capsys.readouterr().out
    assert "config.json: missing" in out_text
    assert "extra.txt: not in mconvert.sha256" in out_text
    assert f"{shard.name}: sha256 " in out_text
    (back / MANIFEST).unlink()
    assert main(["inspect", "--check", str(back)]) == 1
    assert f"no {MANIFEST}" in capsys.readouterr().err


def test_progress_lines_and_summary(hf_model_factory, tmp_path, capsys, monkeypatch):
    stream = io.StringIO()
    progress = PlainProgress("hf-to-mcore", stream, min_gap_s=0.0)
    convert_hf_to_mcore(hf_model_factory("qwen2.5-7b-instruct"), tmp_path / "out", parallelism=Parallelism(tp=2), progress=progress)
    lines = stream.getvalue().splitlines()
    assert 5 <= len(lines) <= 11
    assert lines[-1].startswith("hf-to-mcore: 100% (17/17 tensors, 821.5 KB of 821.5 KB), ")
    assert all("/s, ETA " in line for line in lines)

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    bar = progress_for("hf-to-mcore", quiet=False, stream=terminal)
    try:
        convert_hf_to_mcore(hf_model_factory("qwen2.5-7b-instruct"), tmp_path / "bar", progress=bar)
    finally:
        bar.close()
    final = terminal.getvalue().split("\r")[-1]
    assert final.startswith("hf-to-mcore: 100%") and "17/17 tensors" in final and "B/s" in final
    assert progress_for("hf-to-mcore", quiet=True, stream=terminal).__class__.__name__ == "NoProgress"
    # A torchrun rank: lines naming it, never a bar (the ranks share the terminal).
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    ranked = progress_for("hf-to-mcore", quiet=False, stream=terminal)
    assert isinstance(ranked, PlainProgress) and ranked.label == "hf-to-mcore rank 3/4"
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")

    capsys.readouterr()
    assert main(["hf-to-mcore", "--load-dir", str(hf_model_factory("qwen2.5-7b-instruct")), "--save-dir", str(tmp_path / "o2"), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert " out (" in captured.out and "/s)" in captured.out
    assert f"bash {tmp_path / 'o2'}/train.sh" in captured.out
    assert "mconvert verify --hf " in captured.out


def test_version(capsys):
    from mconvert import __version__

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"mconvert {__version__}"


def test_the_installed_command_exits_with_mains_codes(hf_model_factory, tmp_path):
    """The `mconvert` script pip installs (pyproject's entry point, `cli.run`) converts, prints and exits as
    main returns: 0, and 1 with a one-line error."""
    command = Path(sys.executable).parent / "mconvert"
    done = subprocess.run([command, "hf-to-mcore", "--load-dir", hf_model_factory("qwen3-8b"), "--save-dir", tmp_path / "out", "--quiet"],
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "" and f"wrote {tmp_path / 'out'}" in done.stdout
    assert "mconvert verify --hf" in done.stdout.splitlines()[-3]  # the last lines, flushed at exit
    failed = subprocess.run([command, "inspect", tmp_path / "nothing"], capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stderr.startswith("mconvert: error: ") and len(failed.stderr.splitlines()) == 1


def test_a_file_hashed_while_written_has_the_digest_of_its_bytes(tmp_path):
    import hashlib
    import os
    import time

    from mconvert.converters import manifest

    path = tmp_path / "out" / "data"
    path.parent.mkdir()
    written = b""
    with open(path, "wb") as f, manifest.hashed_while_written(path):
        for n in range(20):  # appended in bursts, the hasher catching up between them
            block = os.urandom(100_000 + n)
            f.write(block)
            f.flush()
            written += block
            time.sleep(0.01)
    # The digest taken while writing is the one of the bytes, and the manifest takes it from there.
    size, _, digest = manifest._hashed_while_written[path.absolute()]
    assert (size, digest) == (len(written), hashlib.sha256(written).hexdigest())
    manifest.write_manifest(path.parent)
    assert (path.parent / MANIFEST).read_text() == f"{digest}  data\n"
    assert path.absolute() not in manifest._hashed_while_written


def test_digests_handed_over_are_used_by_the_manifest_only_while_their_files_are_unchanged(tmp_path):
    """Under torchrun each rank hashes the data files it writes and hands the digests to rank 0, which writes
    the manifest without reading those files again: but a file changed since (size or time) is read."""
    import hashlib
    import os

    from mconvert.converters import manifest

    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    kept, changed = out / "sub" / "kept", out / "changed"
    for path in (kept, changed):
        with open(path, "wb") as f, manifest.hashed_while_written(path):
            f.write(os.urandom(300_000))
    taken = manifest.hand_over_digests(out)
    assert set(taken) == {"sub/kept", "changed"} and manifest.hand_over_digests(out) == {}
    # The same size and time with other bytes: only a digest taken while writing can still name the old ones.
    stat = kept.stat()
    kept.write_bytes(os.urandom(300_000))
    os.utime(kept, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed.write_bytes(b"shorter")
    manifest.adopt_digests(out, taken)
    manifest.write_manifest(out)
    lines = (out / MANIFEST).read_text().splitlines()
    assert lines == [f"{hashlib.sha256(b'shorter').hexdigest()}  changed", f"{taken['sub/kept'][2]}  sub/kept"]
    assert taken["sub/kept"][2] != hashlib.sha256(kept.read_bytes()).hexdigest()


def test_a_file_filled_out_of_order_is_hashed_as_its_front_fills(tmp_path):
    """mcore-to-hf's safetensors files exist at their full size from the start and are filled tensor by
    tensor in any order: the hasher follows only as far as they are filled from the start."""
    import functools
    import hashlib
    import time

    import torch

    from mconvert.converters import manifest
    from mconvert.formats.safetensors import SafetensorsWriter

    shapes = {f"t{i}": (torch.float32, (50_000 + i,)) for i in range(6)}
    writer = SafetensorsWriter(tmp_path, shapes, max_shard_size=1 << 30)
    (path,) = writer.files
    header_end = writer.written_prefix(path)
    ends = {name: writer.places[name][1] + writer.sizes[name] for name in shapes}
    prefixes = []
    with manifest.hashed_while_written(path, functools.partial(writer.written_prefix, path)):
        for name in ["t1", "t3", "t0", "t2", "t5", "t4"]:
            writer.write(name, torch.randn(shapes[name][1]))
            prefixes.append(writer.written_prefix(path))
            time.sleep(0.06)  # the hasher catches up between writes
        writer.close()
    assert prefixes == [header_end, header_end, ends["t1"], ends["t3"], ends["t3"], ends["t5"]]
    size, _, digest = manifest._hashed_while_written.pop(path.absolute())
    assert (size, digest) == (path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest())
