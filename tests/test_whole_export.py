"""mcore-to-hf loses nothing without a word: the export's HF tensors are compared with every tensor transformers' class
for the written config.json holds (built on the meta device; in a child process beside the writes, joined before the
export is put in place, where the exporting process has not imported torch and transformers itself), and, before
writing, every tensor of the Megatron save with what the plan reads. A normal
export of each kind of model passes and says what it was checked against; a mapping entry taken out of a family's
table (a tensor the class holds is not written), a config of a class without a tensor the export writes, and a save
tensor nothing reads (an unknown module, a layer beyond num_layers) each stop the export in one line, nothing written.

The tests in this process (torch and transformers imported) check in it; the last runs a whole mcore-to-hf process,
where the child checks: a refusal that comes through the child (a pass that imports neither, and the verdict kept
for the next export: tests/test_class_verdicts.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert import mappings
from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.dtypes import as_torch
from mconvert.formats import dcp_writer
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.formats.quantized import quantize_fp8_blocks
from mconvert.full_size import is_fp8_on_the_hub
from mconvert.mcore.checkpoint import RELEASE, TRACKER_FILE
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import real_config
from tests.cli_runner import REPO, assert_nothing_left, assert_one_line_error, run_cli
from tests.test_parallel import hf_tensors

# name: (config, hf_model_factory options, layout, the class checked against, what the summary adds)
CASES = {
    "llama": ("llama-3.1-8b", {}, Parallelism(tp=2), "LlamaForCausalLM", ""),
    "qwen2-tied": ("qwen2.5-7b-instruct", {"tie_word_embeddings": True}, Parallelism(pp=2), "Qwen2ForCausalLM", ""),
    # Experts one by one on disk, fused in transformers' model.
    "qwen3-moe": ("qwen3-30b-a3b", {}, Parallelism(ep=2), "Qwen3MoeForCausalLM", ""),
    # Experts fused on disk as on the hub; the image-text class, its vision tower copied back from --hf-config.
    "qwen3.5-moe": ("qwen3.5-35b-a3b", {"layers": 4, "fused_experts": True}, Parallelism(ep=2), "Qwen3_5MoeForConditionalGeneration", ""),
    "qwen3.5-image-text": ("qwen3.5-0.8b", {"layers": 4}, Parallelism(tp=2), "Qwen3_5ForConditionalGeneration", ""),
    "deepseek-v3-mtp": ("deepseek-v3", {"mtp": True}, Parallelism(ep=2), "DeepseekV3ForCausalLM", "of the multi-token prediction layers"),
    # A class transformers lacks (its own code): checked as its language model's, the vision tower beside it.
    "kimi-k2.5": ("kimi-k2.5", {}, Parallelism(), "DeepseekV3ForCausalLM", "copied back beside it (the vision tower and the multimodal projector)"),
}


def export(load_dir, save_dir, *flags) -> tuple[int, str]:
    """mcore-to-hf in this process: its exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["mcore-to-hf", "--load-dir", str(load_dir), "--save-dir", str(save_dir), *map(str, flags)])
    return code, out.getvalue()


@pytest.mark.parametrize("case", CASES)
def test_a_normal_export_is_checked_against_transformers_class_and_passes(case, hf_model_factory, tmp_path):
    config, options, parallelism, architecture, beside = CASES[case]
    hf = hf_model_factory(config, **options)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    code, printed = export(tmp_path / "mcore", tmp_path / "back", "--hf-config", hf)
    assert code == 0
    assert f"checked against transformers' {architecture}: every tensor it holds is written, and no other" in printed, printed
    assert beside in printed
    assert hf_tensors(tmp_path / "back").keys() == hf_tensors(hf).keys()


def test_an_fp8_export_as_source_is_checked_by_the_weights_it_quantizes(hf_model_factory, tmp_path):
    """DeepSeek-V3 written back in FP8 blocks: each quantized weight's _scale_inv is the format's, the weights are the
    class's."""
    source = hf_model_factory("deepseek-v3")
    block = (16, 32)
    release = {}
    for name, tensor in load_file(source / "model.safetensors").items():
        if is_fp8_on_the_hub(name):
            quantized, scales = quantize_fp8_blocks(tensor.float().numpy(), block)
            release[name], release[name + "_scale_inv"] = as_torch(quantized), as_torch(scales)
        else:
            release[name] = tensor
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {**real_config("deepseek-v3")["quantization_config"], "weight_block_size": list(block)}
    (tmp_path / "release").mkdir()
    save_file(release, tmp_path / "release" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    convert_hf_to_mcore(tmp_path / "release", tmp_path / "mcore")
    code, printed = export(tmp_path / "mcore", tmp_path / "back", "--hf-config", tmp_path / "release", "--quantize", "as-source")
    assert code == 0
    assert "checked against transformers' DeepseekV3ForCausalLM: every tensor it holds is written, and no other" in printed, printed
    assert "_scale_inv" in printed and hf_tensors(tmp_path / "back").keys() == release.keys()


def without(family_name: str, scope: str, hf_name: str, monkeypatch) -> None:
    """The family's table with the entry that writes `hf_name` (in `scope`) taken out, for both directions."""
    family = mappings.FAMILIES[family_name]
    entries = getattr(family.table, scope)
    kept = tuple(entry for entry in entries if hf_name not in entry.hf_names)
    assert len(kept) == len(entries) - 1
    monkeypatch.setitem(mappings.FAMILIES, family_name, dataclasses.replace(family, table=dataclasses.replace(family.table, **{scope: kept})))


@pytest.mark.parametrize(
    "config, family, scope, hf_name, missing, architecture",
    [
        ("llama-3.1-8b", "llama", "model", "model.norm.weight", "1 tensor(s)", "LlamaForCausalLM: 'model.norm.weight'"),
        # Each layer's experts' down projections, one tensor a layer in transformers' model.
        ("qwen3-30b-a3b", "qwen3_moe", "experts", "mlp.experts.{expert}.down_proj.weight", "2 tensor(s)", "Qwen3MoeForCausalLM: 'model.layers.0.mlp.experts.down_proj'"),
    ],
)
def test_a_mapping_entry_taken_out_is_a_missing_tensor_in_one_line(config, family, scope, hf_name, missing, architecture, hf_model_factory, tmp_path, monkeypatch):
    """The fault: a family's table without one entry, and a save made without that tensor (so that the save holds
    nothing unread). The export would write a checkpoint transformers loads with a random tensor: refused."""
    original = hf_model_factory(config)
    hf = tmp_path / "hf"
    shutil.copytree(original, hf)
    taken_out = re.compile(".*" + re.escape(hf_name).replace(re.escape("{expert}"), r"\d+"))
    tensors = {k: v for k, v in load_file(hf / "model.safetensors").items() if not taken_out.fullmatch(k)}
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    without(family, scope, hf_name, monkeypatch)
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    failed = run_cli_in_process(monkeypatch, tmp_path / "mcore", tmp_path / "back")
    assert f"the export would leave out {missing} that transformers' {architecture.split(':')[0]} holds:{architecture.partition(':')[2]}" in failed, failed
    assert_nothing_left(tmp_path / "back")


def run_cli_in_process(monkeypatch, load_dir, save_dir, *flags) -> str:
    """The one error line of a failed mcore-to-hf run in this process (the monkeypatched table is this process's)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["mcore-to-hf", "--load-dir", str(load_dir), "--save-dir", str(save_dir), *map(str, flags)])
    lines = err.getvalue().strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("mconvert") and ": error: " in lines[0], (code, lines)
    return lines[0]


def test_a_config_of_a_class_without_a_tensor_the_export_writes_is_an_extra_tensor_in_one_line(hf_model_factory, tmp_path, monkeypatch):
    """The fault: Qwen3's export written with a Llama config, whose class has no q/k norms."""
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    family = mappings.FAMILIES["qwen3"]
    write = family.write_config
    as_llama = dataclasses.replace(family, write_config=lambda spec: {**write(spec), "model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    monkeypatch.setitem(mappings.FAMILIES, "qwen3", as_llama)
    failed = run_cli_in_process(monkeypatch, tmp_path / "mcore", tmp_path / "back")
    assert "the export would write 4 tensor(s) that transformers' LlamaForCausalLM does not hold: 'model.layers.0.self_attn.k_norm.weight'" in failed, failed
    assert_nothing_left(tmp_path / "back")


def with_tensors(mcore, out, tensors: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The torch_dist save `mcore` rewritten into `out` with more tensors: key -> (shape, the key whose dtype it has)."""
    release = mcore / RELEASE
    dcp = DCPCheckpoint(release)
    (out / RELEASE).mkdir(parents=True)
    shutil.copy(mcore / TRACKER_FILE, out / TRACKER_FILE)
    for name in ("common.pt", "metadata.json"):
        shutil.copy(release / name, out / RELEASE / name)
    writer = dcp_writer.DCPWriter(out / RELEASE)
    added = {key: (shape, dcp.dtypes[like]) for key, (shape, like) in tensors.items()}
    for name, stored in dcp.shapes.items():
        writer.declare(name, stored, dcp.dtypes[name])
    for key, (shape, dtype) in added.items():
        writer.declare(key, shape, dtype)
    for name, stored in dcp.shapes.items():
        writer.write_chunk(name, (0,) * len(stored), dcp.read_region(name, (0,) * len(stored), stored))
    for key, (shape, dtype) in added.items():
        writer.write_chunk(key, (0,) * len(shape), np.zeros(shape, dtype=dtype))
    writer.finish()


@pytest.mark.parametrize(
    "key",
    [
        "vision_model.patch_embed.weight",  # a module outside the model's keys: was skipped without a word
        "decoder.layers.self_attention.linear_qkv.extra.weight",  # a module the mapping does not know
    ],
)
def test_a_save_tensor_nothing_reads_is_named_in_one_line(key, hf_model_factory, tmp_path):
    hf = hf_model_factory("llama-3.1-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    with_tensors(tmp_path / "mcore", tmp_path / "extra", {key: ((4, 8), "embedding.word_embeddings.weight")})
    failed = run_cli("mcore-to-hf", "--load-dir", tmp_path / "extra", "--save-dir", tmp_path / "back")
    assert_one_line_error(failed, f"tensor '{key}' is not used by the llama mapping")
    assert_nothing_left(tmp_path / "back")


def test_a_layer_beyond_num_layers_is_named_in_one_line(hf_model_factory, tmp_path, capsys):
    """Mixed dense and MoE layers are stored one key a layer: a third layer's tensor in a save of two."""
    hf = hf_model_factory("qwen3-30b-a3b", layers=2, mlp_only_layers=[0])
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    stored = DCPCheckpoint(tmp_path / "mcore" / RELEASE).shapes
    layer_key = next(key for key in stored if key.startswith("decoder.layers.1."))
    extra = layer_key.replace("decoder.layers.1.", "decoder.layers.2.")
    with_tensors(tmp_path / "mcore", tmp_path / "extra", {extra: (stored[layer_key], layer_key)})
    capsys.readouterr()
    assert main(["mcore-to-hf", "--load-dir", str(tmp_path / "extra"), "--save-dir", str(tmp_path / "back")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"tensor '{extra}' is not used by the qwen3_moe mapping" in err, err
    assert_nothing_left(tmp_path / "back")


def test_mtp_layers_of_a_family_without_a_place_for_them_are_left_out_and_said_so(hf_model_factory, tmp_path):
    """A Llama trained with Megatron-LM's --mtp-num-layers 1: LlamaForCausalLM's checkpoints have no place for the MTP
    layer, which the export leaves out and says so (DeepSeek-V3's are written: the deepseek-v3-mtp case above)."""
    hf = hf_model_factory("llama-3.1-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    hidden = load_file(hf / "model.safetensors")["model.norm.weight"].shape[0]
    mtp = {"mtp.layers.0.eh_proj.weight": ((hidden, 2 * hidden), "embedding.word_embeddings.weight"),
           "mtp.layers.0.enorm.weight": ((hidden,), "embedding.word_embeddings.weight"),
           "mtp.layers.0.transformer_layer.self_attention.linear_proj.weight": ((hidden, hidden), "embedding.word_embeddings.weight")}
    with_tensors(tmp_path / "mcore", tmp_path / "mtp", mtp)
    common = tmp_path / "mtp" / RELEASE / "common.pt"
    state = torch.load(common, weights_only=False)
    state["args"].mtp_num_layers = 1
    torch.save(state, common)
    code, printed = export(tmp_path / "mtp", tmp_path / "back")
    assert code == 0
    assert "left out 1 multi-token prediction layer(s) of the save: the llama HF format has no place for them" in printed, printed
    assert hf_tensors(tmp_path / "back").keys() == hf_tensors(hf).keys()


@pytest.mark.usefixtures("empty_verdict_cache")  # a verdict kept by the test above would refuse without a child
def test_a_refusal_comes_through_the_child_in_one_line(hf_model_factory, tmp_path):
    """The fault of test_a_config_of_a_class_without_a_tensor_the_export_writes..., in a whole mcore-to-hf process
    that imports neither torch nor transformers: the child refuses, the export says it in one line, nothing is left."""
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    argv = ["mcore-to-hf", "--load-dir", str(tmp_path / "mcore"), "--save-dir", str(tmp_path / "back")]
    code = ("import dataclasses, sys; from mconvert import mappings; from mconvert.cli import main; "
            "family = mappings.FAMILIES['qwen3']; write = family.write_config; "
            "mappings.FAMILIES['qwen3'] = dataclasses.replace(family, write_config=lambda spec: "
            "{**write(spec), 'model_type': 'llama', 'architectures': ['LlamaForCausalLM']}); "
            f"code = main({argv!r}); "
            "print('imported:', sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode != 0 and "imported: []" in done.stdout, (done.stdout, done.stderr)
    error = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(error) == 1 and "transformers' LlamaForCausalLM does not hold" in error[0], done.stderr
    assert_nothing_left(tmp_path / "back")
