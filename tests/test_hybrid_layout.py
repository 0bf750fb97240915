"""HybridModel checkpoints (`hf-to-mcore --model-class hybrid`): the layout megatron-core's HybridModel keys (each
GPT layer's attention and MLP layers of their own, decoder.final_norm, the MTP layers' own stacks), read back bit
for bit; what cannot be written or read, in one line. Megatron-LM's checks of them: tests/megatron_lm/test_hybrid.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from cli_runner import assert_nothing_left, assert_one_line_error, run_cli
from safetensors.torch import load_file

from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.formats.dcp import DCPCheckpoint
from mconvert.mcore.checkpoint import iteration_dir, read_args, write_common
from mconvert.mcore.parallelism import Parallelism, PipelineSplit


def weights(directory) -> dict[str, torch.Tensor]:
    return {k: v for path in directory.glob("*.safetensors") for k, v in load_file(path).items()}


def test_a_hybrid_checkpoint_is_keyed_as_hybrid_model_keys_it_and_reads_back_bit_for_bit(hf_model_factory, tmp_path):
    hf = hf_model_factory("deepseek-v3", layers=3, mtp=True)
    par = Parallelism(tp=2, pp=2, ep=2, pipeline=PipelineSplit(first_stage_layers=1), model_class="hybrid")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=par)
    args = read_args(iteration_dir(tmp_path / "mcore"))
    assert (args.hybrid_layer_pattern, args.num_layers, args.decoder_first_pipeline_num_layers) == ("+-|+E+E/+E", 6, None)
    keys = set(DCPCheckpoint(iteration_dir(tmp_path / "mcore")).metadata.state_dict_metadata)
    assert {"decoder.final_norm.weight", "decoder.layers.0.input_layernorm.weight", "decoder.layers.1.mlp.linear_fc2.weight",
            "decoder.layers.5.mlp.router.weight", "mtp.layers.0.mtp_model_layer.layers.0.self_attention.linear_proj.weight",
            "mtp.layers.0.mtp_model_layer.layers.1.mlp.router.weight", "mtp.layers.0.eh_proj.weight"} <= keys
    assert not any(key.startswith("decoder.final_layernorm") for key in keys)
    script = (tmp_path / "mcore" / "megatron_args.sh").read_text()
    assert "pretrain_hybrid.py" in script and "--hybrid-layer-pattern '+-|+E+E/+E'" in script
    assert "--decoder-first-pipeline-num-layers" not in script
    assert "pretrain_hybrid.py" in (tmp_path / "mcore" / "train.sh").read_text()
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back")
    original, back = weights(hf), weights(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    inspected = run_cli("inspect", tmp_path / "mcore")
    assert "written for: HybridModel TP=2 PP=2 EP=2 ETP=2 --hybrid-layer-pattern '+-|+E+E/+E'" in inspected.stdout


def test_schedules_indexed_by_layer_spread_over_the_pattern(hf_model_factory, tmp_path):
    """gpt-oss's windowed layers and Qwen3-Next's linear-attention layers, as HybridModel numbers its layers."""
    hf = hf_model_factory("gpt-oss-20b", layers=2, sliding_window=4)
    convert_hf_to_mcore(hf, tmp_path / "oss", parallelism=Parallelism(model_class="hybrid"))
    args = read_args(iteration_dir(tmp_path / "oss"))
    assert (args.hybrid_layer_pattern, args.window_attn_skip_freq) == ("*E*E", [1, 0, 0, 0])
    hf = hf_model_factory("qwen3-next-80b-a3b-instruct", layers=4)
    convert_hf_to_mcore(hf, tmp_path / "next", parallelism=Parallelism(model_class="hybrid"))
    args = read_args(iteration_dir(tmp_path / "next"))
    assert (args.hybrid_layer_pattern, args.linear_attention_freq) == ("GEGEGE*E", [1, 0, 1, 0, 1, 0, 0, 0])
    convert_mcore_to_hf(tmp_path / "next", tmp_path / "back")
    original, back = weights(hf), weights(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())


def test_mtp_layers_gpt_model_cannot_build_are_converted_for_hybrid_model(hf_model_factory, tmp_path):
    """Qwen3.5's MTP layer (kept apart under `mtp.`, beside gated delta-net) is left out of a GPT checkpoint, and is a
    HybridModel's `/*-`; both ways bit for bit, the vision tower copied back."""
    hf = hf_model_factory("qwen3.5-0.8b", layers=4, mtp=True)
    gpt = run_cli("hf-to-mcore", "--load-dir", hf, "--save-dir", tmp_path / "gpt")
    assert "left out 1 multi-token prediction layer(s)" in gpt.stdout and "--model-class hybrid converts it" in gpt.stdout
    par = Parallelism(tp=2, pp=2, model_class="hybrid")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=par)
    assert read_args(iteration_dir(tmp_path / "mcore")).hybrid_layer_pattern == "G-G-|G-*-/*-"
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", hf_config_dir=hf)
    original, back = weights(hf), weights(tmp_path / "back")
    assert back.keys() == original.keys() and all(torch.equal(back[k], v) for k, v in original.items())
    assert any(name.startswith("mtp.layers.0.") for name in back)


def test_what_hybrid_model_cannot_build_is_refused_in_one_line(hf_model_factory, tmp_path):
    llama3 = hf_model_factory("llama-3.1-8b", layers=2)
    out = tmp_path / "out"
    assert_one_line_error(run_cli("hf-to-mcore", "--load-dir", llama3, "--save-dir", out, "--model-class", "hybrid"),
                          "--model-class hybrid", "llama3 rope scaling")
    assert_nothing_left(out)
    qwen = hf_model_factory("qwen2.5-7b-instruct", layers=2)
    result = run_cli("hf-to-mcore", "--load-dir", qwen, "--save-dir", out, "--model-class", "hybrid", "--pp", "2",
                     "--account-for-embedding-in-pipeline-split")
    assert_one_line_error(result, "--account-for-embedding-in-pipeline-split", "--model-class hybrid")
    assert_nothing_left(out)


def test_a_save_whose_pattern_is_no_run_of_gpt_layers_is_refused_in_one_line(hf_model_factory, tmp_path):
    hf = hf_model_factory("qwen2.5-7b-instruct", layers=2)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(model_class="hybrid"))
    release = iteration_dir(tmp_path / "mcore")
    args = read_args(release)
    # A pattern with Mamba layers is read as a model of one block a layer (Nemotron-H's), which these args are not.
    for pattern, names in (("M-*-", ["nemotron_h", "Mamba"]), ("**--", ["hybrid_layer_pattern '**--'", "layer 1", "'*'"])):
        args.hybrid_layer_pattern = pattern
        write_common(release, args)
        result = run_cli("mcore-to-hf", "--load-dir", tmp_path / "mcore", "--save-dir", tmp_path / "back")
        assert_one_line_error(result, *names)
        assert_nothing_left(tmp_path / "back")
    result = run_cli("verify", "--hf", hf, "--mcore", tmp_path / "mcore", "--device", "cpu")
    if importlib.util.find_spec("megatron.core.models.hybrid") is None:  # megatron-core before 0.19
        assert_one_line_error(result, "a HybridModel checkpoint", "has no HybridModel", code=2)
    else:
        assert_one_line_error(result, *names, code=2)


HYBRID_SAVES = Path(__file__).parent / "fixtures" / "hybrid"


def test_a_megatron_lm_hybrid_training_save_at_pp2_exports_bit_for_bit(tmp_path):
    """A save Megatron-LM 0.19.2 made on two GPUs (fixtures/hybrid/MADE.md): a HybridModel at PP 2 under Transformer
    Engine's spec, with an MTP layer, trained at lr 0 from mconvert's hybrid checkpoint of `hf`. Its export must be
    `hf` again, every tensor bit for bit; the comparison itself catches two stages' tensors exchanged."""
    fixture = HYBRID_SAVES / "deepseek-mtp-pp2"
    inspected = run_cli("inspect", fixture / "save")
    assert "written for: HybridModel TP=1 PP=2 EP=1 ETP=1 --hybrid-layer-pattern '+-|+E/+E'" in inspected.stdout
    done = run_cli("mcore-to-hf", "--load-dir", fixture / "save", "--save-dir", tmp_path / "hf", "--hf-config", fixture / "hf",
                   "--quiet")
    assert done.returncode == 0, done.stderr
    original, back = weights(fixture / "hf"), weights(tmp_path / "hf")

    def differing(exported: dict[str, torch.Tensor]) -> list[str]:
        return sorted(k for k, v in original.items() if not torch.equal(exported[k].to(v.dtype), v))

    assert back.keys() == original.keys() and not differing(back)
    first, second = "model.layers.0.self_attn.o_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    back[first], back[second] = back[second], back[first]
    assert differing(back) == [first, second]
