"""What transformers' class holds for a config, kept between exports (converters/class_verdicts.py): a second export
of a config imports neither torch nor transformers, in no process, and is held to the kept verdict as the first was
to the class (each refusal shown from it by fault injection); another config, a corrupt entry, or an entry that
cannot be read is made again. The verdicts are made in this process (which has imported torch and transformers)
where a test needs one kept, and read back by whole `mconvert` processes that record what they imported."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from mconvert import mappings
from mconvert.converters.class_verdicts import digest
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from tests.cli_runner import REPO, assert_nothing_left, assert_one_line_error
from tests.test_whole_export import export, run_cli_in_process, without

# Each test starts from an empty cache: what it asserts is which export makes, keeps and reads a verdict.
pytestmark = pytest.mark.usefixtures("empty_verdict_cache")
CHECKED = "checked against transformers' {}: every tensor it holds is written, and no other"
KEPT = "(the class's tensors as kept in "
# Each process ending records what it imported of torch and transformers, and its command line.
RECORDER = """import atexit, json, os, sys
def record():
    with open(os.environ["IMPORTS_RECORD"], "a") as f:
        f.write(json.dumps({"argv": sys.argv, "imported": sorted(m for m in ("torch", "transformers") if m in sys.modules)}) + "\\n")
atexit.register(record)
"""
# The fault of test_a_mapping_entry_taken_out_is_a_missing_tensor_in_one_line, and that of
# test_a_config_of_a_class_without_a_tensor_the_export_writes_is_an_extra_tensor_in_one_line, in a whole process.
WITHOUT_NORM = ("family = mappings.FAMILIES['llama']; mappings.FAMILIES['llama'] = dataclasses.replace(family, table="
                "dataclasses.replace(family.table, model=tuple(e for e in family.table.model if 'model.norm.weight' not in e.hf_names)))")
AS_LLAMA = ("family = mappings.FAMILIES['qwen3']; write = family.write_config; mappings.FAMILIES['qwen3'] = dataclasses.replace("
            "family, write_config=lambda spec: {**write(spec), 'model_type': 'llama', 'architectures': ['LlamaForCausalLM']})")


def recorded_export(tmp_path: Path, load_dir: Path, save_dir: Path, fault: str = "pass") -> tuple[subprocess.CompletedProcess, list[dict]]:
    """mcore-to-hf in a process of its own (with `fault`, Python run before it), and what it and any child imported."""
    recorder, record = tmp_path / "recorder", tmp_path / "imports.jsonl"
    recorder.mkdir(exist_ok=True)
    (recorder / "sitecustomize.py").write_text(RECORDER)
    record.unlink(missing_ok=True)
    argv = ["mcore-to-hf", "--load-dir", str(load_dir), "--save-dir", str(save_dir)]
    code = f"import dataclasses, sys; from mconvert import mappings; from mconvert.cli import main; {fault}; sys.exit(main({argv!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(recorder), str(REPO)]), "IMPORTS_RECORD": str(record)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    return done, [json.loads(line) for line in record.read_text().splitlines()]


def entries() -> list[Path]:
    return sorted(Path(os.environ["MCONVERT_CACHE_DIR"]).glob("class-*.json"))


def test_the_first_export_makes_the_verdict_in_a_child_and_the_second_imports_neither(hf_model_factory, tmp_path):
    """The first whole mcore-to-hf process imports neither torch nor transformers (its child does, for the check);
    the second starts no child and nothing imports them: it is checked against the kept verdict, and says so."""
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    first, processes = recorded_export(tmp_path, tmp_path / "mcore", tmp_path / "back")
    assert first.returncode == 0, first.stderr
    assert CHECKED.format("Qwen3ForCausalLM") in first.stdout and KEPT not in first.stdout, first.stdout
    # The child (`python -m mconvert.converters.whole_export`, its argv[0] that file) imported both; the export neither.
    assert sorted((p["argv"][0].endswith("whole_export.py"), p["imported"]) for p in processes) == [(False, []), (True, ["torch", "transformers"])], processes
    shutil.rmtree(tmp_path / "back")
    second, processes = recorded_export(tmp_path, tmp_path / "mcore", tmp_path / "back")
    assert second.returncode == 0, second.stderr
    assert f"{CHECKED.format('Qwen3ForCausalLM')} {KEPT}{entries()[0]})" in second.stdout, second.stdout
    assert [p["imported"] for p in processes] == [[]], processes  # one process, nothing imported


def test_a_kept_verdict_refuses_a_tensor_left_out(hf_model_factory, tmp_path, monkeypatch):
    """The verdict kept by a passing export of Llama; then the fault (the final norm's mapping entry taken out, and a
    save without it), in a whole process: refused in one line from the kept verdict, nothing imported, nothing left."""
    original = hf_model_factory("llama-3.1-8b")
    convert_hf_to_mcore(original, tmp_path / "mcore")
    assert export(tmp_path / "mcore", tmp_path / "back")[0] == 0 and len(entries()) == 1
    hf = tmp_path / "hf"
    shutil.copytree(original, hf)
    save_file({k: v for k, v in load_file(hf / "model.safetensors").items() if k != "model.norm.weight"}, hf / "model.safetensors", metadata={"format": "pt"})
    with monkeypatch.context() as patched:
        without("llama", "model", "model.norm.weight", patched)
        convert_hf_to_mcore(hf, tmp_path / "faulty")
    refused, processes = recorded_export(tmp_path, tmp_path / "faulty", tmp_path / "out", WITHOUT_NORM)
    assert_one_line_error(refused, "the export would leave out 1 tensor(s) that transformers' LlamaForCausalLM holds: 'model.norm.weight'")
    assert [p["imported"] for p in processes] == [[]], processes
    assert_nothing_left(tmp_path / "out")


def test_a_kept_verdict_refuses_a_tensor_the_class_does_not_hold(hf_model_factory, tmp_path, monkeypatch):
    """A refusal keeps its verdict too: Qwen3's export with a Llama config, refused in this process, then again in a
    whole process, from the kept verdict, nothing imported."""
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    error = "the export would write 4 tensor(s) that transformers' LlamaForCausalLM does not hold: 'model.layers.0.self_attn.k_norm.weight'"
    family = mappings.FAMILIES["qwen3"]
    write = family.write_config
    as_llama = dataclasses.replace(family, write_config=lambda spec: {**write(spec), "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with monkeypatch.context() as patched:
        patched.setitem(mappings.FAMILIES, "qwen3", as_llama)
        assert error in run_cli_in_process(patched, tmp_path / "mcore", tmp_path / "back")
    assert len(entries()) == 1
    refused, processes = recorded_export(tmp_path, tmp_path / "mcore", tmp_path / "back", AS_LLAMA)
    assert_one_line_error(refused, error)
    assert [p["imported"] for p in processes] == [[]], processes
    assert_nothing_left(tmp_path / "back")


def test_another_config_is_another_verdict(hf_model_factory, tmp_path):
    """The same family with fewer layers is not checked against the first config's verdict (whose names it writes a
    part of: held to that verdict, it would leave out the last layer's tensors)."""
    for layers, kept in ((3, False), (2, False), (3, True)):
        hf = hf_model_factory("qwen3-8b", layers=layers)
        convert_hf_to_mcore(hf, tmp_path / f"mcore{layers}", overwrite=True)
        code, printed = export(tmp_path / f"mcore{layers}", tmp_path / "back", "--overwrite")
        assert code == 0 and CHECKED.format("Qwen3ForCausalLM") in printed and (KEPT in printed) == kept, printed
    assert len(entries()) == 2


@pytest.mark.parametrize("corruption", ["truncated", "a character of a name changed", "another key's", "not a verdict", "a directory"])
def test_an_entry_that_cannot_be_trusted_is_made_again(corruption, hf_model_factory, tmp_path):
    """The entry of a passing export spoilt: the next export is checked against the class again (and keeps it anew
    where the entry is a file); spoilt into a held name that no longer matches, it would refuse a good export."""
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    assert export(tmp_path / "mcore", tmp_path / "back")[0] == 0
    [entry] = entries()
    good = entry.read_text()
    kept = json.loads(good)
    if corruption == "truncated":
        entry.write_text(good[: len(good) // 2])
    elif corruption == "a character of a name changed":
        entry.write_text(good.replace('"model.norm.weight"', '"model.norm.weighT"', 1))
    elif corruption == "another key's":
        entry.write_text(json.dumps({**kept, "key": {**kept["key"], "transformers": "0.0"}}))
    elif corruption == "not a verdict":
        kept["verdict"]["held"] = "model.norm.weight"
        entry.write_text(json.dumps({**kept, "sha256": digest(kept["verdict"])}))
    else:
        entry.unlink()
        entry.mkdir()
    code, printed = export(tmp_path / "mcore", tmp_path / "back", "--overwrite")
    assert code == 0 and CHECKED.format("Qwen3ForCausalLM") in printed and KEPT not in printed, printed
    assert entry.is_dir() if corruption == "a directory" else entry.read_text() == good


def test_the_cache_turned_off_keeps_nothing(hf_model_factory, tmp_path, monkeypatch):
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    cache = Path(os.environ["MCONVERT_CACHE_DIR"])
    monkeypatch.setenv("MCONVERT_CACHE_DIR", "")
    for _ in range(2):
        code, printed = export(tmp_path / "mcore", tmp_path / "back", "--overwrite")
        assert code == 0 and CHECKED.format("Qwen3ForCausalLM") in printed and KEPT not in printed, printed
    assert not cache.exists() or not list(cache.iterdir())


def test_a_class_not_built_is_not_kept(hf_model_factory, tmp_path, monkeypatch):
    """Why a class was not built may be the environment's, not the config's: the next export tries again."""
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    family = mappings.FAMILIES["qwen3"]
    write = family.write_config
    monkeypatch.setitem(mappings.FAMILIES, "qwen3", dataclasses.replace(family, write_config=lambda spec: {**write(spec), "architectures": ["Qwen3NoSuchClass"]}))
    code, printed = export(tmp_path / "mcore", tmp_path / "back")
    assert code == 0 and "not checked against transformers' class: transformers 5" in printed and "has no class Qwen3NoSuchClass" in printed, printed
    assert entries() == []
