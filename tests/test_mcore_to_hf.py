"""mcore-to-hf: torch_dist (ours) -> HF gives the original tensors bit for bit, an equivalent config, and a
model transformers loads with the original logits; and the pieces it is made of."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.state_dict import hf_to_mcore_state_dict, mcore_to_hf_state_dict
from mconvert.errors import ConversionError
from mconvert.formats import dcp_writer
from mconvert.formats.dcp import DCPCheckpoint
from mconvert import dtypes
from mconvert.dtypes import as_torch, torch_dtype
from mconvert.formats.hf_checkpoint import HFCheckpoint
from mconvert.formats.safetensors import INDEX_FILE, SafetensorsWriter, parse_size
from mconvert.formats.torch_save import saved_bytes
from mconvert.mappings import family_for_spec, get_mapping, write_hf_config
from mconvert.mcore.checkpoint import RELEASE, TRACKER_FILE, read_args, read_common_args
from mconvert.mcore.parallelism import Parallelism
from mconvert.megatron_lm.args import megatron_args
from mconvert.megatron_lm.spec_from_args import spec_from_args
from mconvert.synthetic import add_mtp_layers, make_hf_checkpoint, real_config, shrink
from tests.cli_runner import REPO
from tests.test_optional_packages import BLOCKER

# id: (real config, overrides)
MODELS = {
    "llama-2-7b": ("llama-2-7b", {}),
    "llama-3.1-8b": ("llama-3.1-8b", {}),
    "qwen2.5-7b-instruct": ("qwen2.5-7b-instruct", {}),
    "qwen3-8b": ("qwen3-8b", {}),
    # Llama 3.2 1B and Qwen2.5 0.5B tie the output layer to the embedding.
    "qwen2.5-7b-instruct-tied": ("qwen2.5-7b-instruct", {"tie_word_embeddings": True}),
    # MoE: dense layers mixed in (per-layer keys); a gated shared expert; experts in every layer.
    "qwen3_moe-mixed": ("qwen3-30b-a3b", {"layers": 4, "mlp_only_layers": [0, 3]}),
    "qwen2_moe": ("qwen1.5-moe-a2.7b", {}),
    "mixtral": ("mixtral-8x7b-v0.1", {}),
    # Multi-latent attention with and without the query bottleneck, sigmoid and softmax routing; GLM-4.5.
    "deepseek-v3": ("deepseek-v3", {}),
    "deepseek-v2-lite": ("deepseek-v2-lite", {}),
    "glm-4.5-air": ("glm-4.5-air", {"use_qk_norm": True}),
}
MOE = ("qwen3_moe-mixed", "qwen2_moe", "mixtral", "deepseek-v3", "deepseek-v2-lite", "glm-4.5-air")


def hf_dir(factory, name):
    config, overrides = MODELS[name]
    return factory(config, **overrides)


def read_hf(directory):
    checkpoint = HFCheckpoint(directory)
    return {name: as_torch(checkpoint.read(name)) for name in checkpoint.tensors}


def export(capsys, load_dir, save_dir, *flags):
    code = main(["mcore-to-hf", "--load-dir", str(load_dir), "--save-dir", str(save_dir), *flags])
    assert code == 0, capsys.readouterr().err
    return json.loads((save_dir / "config.json").read_text())


@pytest.mark.parametrize("name", list(MODELS))
def test_round_trip_is_bit_exact_with_an_equivalent_config(name, hf_model_factory, tmp_path, capsys):
    hf = hf_dir(hf_model_factory, name)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, pp=2, ep=2 if name in MOE else 1))
    config = export(capsys, tmp_path / "mcore", tmp_path / "back", "--max-shard-size", "60KB")

    original, back = read_hf(hf), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)
    # From the checkpoint's args alone (the family told from them): the same model, in HF's terms as mconvert reads
    # them, and the same rope as transformers reads it (test_transformers_loads_the_export_... runs it).
    assert get_mapping(config)[1] == get_mapping(json.loads((hf / "config.json").read_text()))[1]
    assert transformers_rope(tmp_path / "back") == transformers_rope(hf)
    assert ("lm_head.weight" in back) == (not config["tie_word_embeddings"])
    index = json.loads((tmp_path / "back" / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1 and set(index["weight_map"]) == set(back)


def test_reference_config_keeps_its_fields_and_side_files_are_copied(hf_model_factory, tmp_path, capsys):
    hf = tmp_path / "hf"
    shutil.copytree(hf_model_factory("qwen3-8b"), hf)
    (hf / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    config = export(capsys, tmp_path / "mcore", tmp_path / "back", "--hf-config", str(hf), "--dtype", "bf16")

    original = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["torch_dtype"]) == (1, 2, "bfloat16")
    assert config["max_window_layers"] == original["max_window_layers"]
    for side_file in ("generation_config.json", "tokenizer_config.json"):
        assert (tmp_path / "back" / side_file).read_bytes() == (hf / side_file).read_bytes()
    back = read_hf(tmp_path / "back")
    assert all(t.dtype == torch.bfloat16 for t in back.values())
    assert torch.equal(back["model.norm.weight"], read_hf(hf)["model.norm.weight"].bfloat16())


def transformers_rope(directory: pathlib.Path) -> tuple[dict, list[float], float]:
    """The rope a config.json describes as transformers reads it: its rope settings in its own form whichever form the
    file has (numbers as floats; the legacy `type` beside `rope_type` aside), and the frequencies and attention
    scaling its model computes from them."""
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        rotary = type(transformers.AutoModelForCausalLM.from_config(config).model.rotary_emb)
    rotary = rotary(config)
    settings = {k: float(v) if type(v) in (int, float) else v for k, v in config.rope_parameters.items() if k != "type"}
    return settings, rotary.inv_freq.tolist(), rotary.attention_scaling


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_loads_the_export_and_gives_the_original_logits(name, hf_model_factory, tmp_path, capsys):
    hf = hf_dir(hf_model_factory, name)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2 if name in MOE else 1))
    export(capsys, tmp_path / "mcore", tmp_path / "back")
    tokens = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for directory in (hf, tmp_path / "back"):
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            logits.append(model(tokens).logits)
    assert torch.equal(logits[0], logits[1])


def test_state_dicts_convert_both_ways_as_the_files_do(hf_model_factory, tmp_path):
    hf = hf_model_factory("llama-3.1-8b")
    config = json.loads((hf / "config.json").read_text())
    hf_state = read_hf(hf)
    parallelism = Parallelism(tp=2)
    mcore_state = hf_to_mcore_state_dict(hf_state, config, parallelism=parallelism)

    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    dcp = DCPCheckpoint(tmp_path / "mcore" / RELEASE)
    keys = sorted(dcp.shapes)
    written = [as_torch(dcp.read_region(key, (0,) * len(dcp.shapes[key]), dcp.shapes[key])) for key in keys]
    assert sorted(mcore_state) == keys
    assert all(torch.equal(mcore_state[key], tensor) for key, tensor in zip(keys, written))

    back = mcore_to_hf_state_dict(mcore_state, config)
    assert sorted(back) == sorted(hf_state) and all(torch.equal(back[k], hf_state[k]) for k in back)
    # The args the checkpoint stores describe the same model.
    args = read_args(tmp_path / "mcore" / RELEASE)
    from_args = mcore_to_hf_state_dict(mcore_state, args=args)
    assert all(torch.equal(from_args[k], hf_state[k]) for k in hf_state)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b-instruct", "qwen3-8b", *MOE])
def test_args_read_back_into_the_same_model_of_the_same_family(name):
    config_name, overrides = MODELS[name]
    family, spec = get_mapping(shrink(real_config(config_name), **overrides))
    args = megatron_args(spec, Parallelism(tp=2), torch.bfloat16, "transformer_engine")
    from_args = spec_from_args(args)
    assert family_for_spec(from_args) is family
    assert dataclasses.replace(from_args, family=family.name) == dataclasses.replace(spec, dtype=dtypes.bfloat16)


@pytest.mark.parametrize("name", MOE)
def test_router_dtype_is_written_and_either_converts_back(name):
    """fp32 routing is how transformers computes DeepSeek's and GLM-4.5's routers, so their args ask Megatron for
    it; it is how a model computes, not what it is, so a checkpoint trained with or without it converts back."""
    config_name, overrides = MODELS[name]
    family, spec = get_mapping(shrink(real_config(config_name), **overrides))
    args = megatron_args(spec, Parallelism(), torch.bfloat16, "transformer_engine")
    assert args.moe_router_dtype == ("fp32" if family.name in ("deepseek", "glm4_moe") else None)
    assert spec_from_args(args).moe.router_fp32 == (args.moe_router_dtype == "fp32")
    configs = [
        write_hf_config(family, spec_from_args(argparse.Namespace(**{**vars(args), "moe_router_dtype": dtype})))
        for dtype in (None, "fp32")
    ]
    assert configs[0] == configs[1]


def moe_args(**changes) -> argparse.Namespace:
    """Megatron-LM args of a small Qwen2-MoE (a gated shared expert, biases on q, k, v), changed."""
    _, spec = get_mapping(shrink(real_config("qwen1.5-moe-a2.7b")))
    args = megatron_args(spec, Parallelism(), torch.float32, "transformer_engine")
    return argparse.Namespace(**{**vars(args), **changes})


def test_moe_layer_freq_reads_as_megatron_lm_stores_it():
    """Megatron-LM parses --moe-layer-freq ("([0]+[1]*1)") when reading its command line: args hold an int
    (every k-th layer from layer 0) or a list."""
    assert spec_from_args(moe_args(num_layers=4, moe_layer_freq=2)).moe.moe_layers == (True, False, True, False)
    assert spec_from_args(moe_args(moe_layer_freq=[0, 1])).moe.moe_layers == (False, True)
    with pytest.raises(ConversionError, match="string"):
        spec_from_args(moe_args(moe_layer_freq="([0]+[1]*1)"))


@pytest.mark.parametrize(
    "changes, message",
    [
        # Sigmoid routing is GLM-4.5's, whose shared experts have no gate.
        (dict(moe_router_score_function="sigmoid"), "glm4_moe family has ungated shared experts"),
        (dict(moe_router_enable_expert_bias=True), "qwen2_moe family cannot express this model: moe.expert_bias would read back as False"),
        (dict(moe_router_score_function="sqrtsoftplus"), "score function 'sqrtsoftplus'"),
        # No shared expert: a Mixtral, whose config has no biases on q, k, v to say.
        (
            dict(moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False, moe_router_pre_softmax=False, moe_ffn_hidden_size=128),
            "mixtral family cannot express this model: qkv_bias would read back as False, not True",
        ),
    ],
    ids=["sigmoid-routing-gated-shared-expert", "expert-bias-softmax", "sqrtsoftplus", "mixtral-with-qkv-bias"],
)
def test_args_of_models_no_family_has_are_refused(changes, message):
    with pytest.raises(ConversionError, match=message):
        mcore_to_hf_state_dict({}, args=moe_args(**changes))


def test_iteration_is_picked_by_tracker_or_flag(hf_model_factory, tmp_path, capsys):
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    shutil.copytree(tmp_path / "mcore" / "release", tmp_path / "mcore" / "iter_0000020")
    (tmp_path / "mcore" / TRACKER_FILE).write_text("20")
    export(capsys, tmp_path / "mcore", tmp_path / "by-tracker")
    export(capsys, tmp_path / "mcore", tmp_path / "by-flag", "--iteration", "20")
    assert read_hf(tmp_path / "by-flag").keys() == read_hf(hf).keys()


def test_common_state_stored_among_the_dcp_objects_is_read(hf_model_factory, tmp_path, capsys):
    """Newer megatron-core keeps the common state (args included) as a `common_state` object in the DCP
    files and writes no common.pt."""
    hf = hf_model_factory("qwen3-8b")
    conversion = convert_hf_to_mcore(hf, tmp_path / "mcore")
    release = tmp_path / "mcore" / "release"
    (release / "common.pt").unlink()
    dcp = DCPCheckpoint(release)
    assert read_common_args(release, dcp) is None
    rewritten = tmp_path / "rewritten"
    rewritten.mkdir()
    writer = dcp_writer.DCPWriter(rewritten)
    for key, shape in dcp.shapes.items():
        writer.declare(key, shape, dcp.dtypes[key])
    for key, shape in dcp.shapes.items():
        tensor = as_torch(dcp.read_region(key, (0,) * len(shape), shape))
        writer.write_chunk(key, (0,) * tensor.dim(), tensor)
    writer.write_object("common_state/shard_0_1", saved_bytes({"args": conversion.args, "iteration": 0}))
    writer.finish()
    read = read_common_args(rewritten, DCPCheckpoint(rewritten))
    assert isinstance(read, argparse.Namespace)
    # The args hold numpy's dtype, stored as torch's of the same name (what Megatron-LM's own saves hold), read back
    # as numpy's.
    assert read.params_dtype == conversion.args.params_dtype
    assert vars(read) == {**vars(conversion.args), "params_dtype": read.params_dtype}


def test_metadata_that_records_the_checkpoints_path_is_read(hf_model_factory, tmp_path, capsys):
    """torch's FileSystemWriter (and megatron-core's writer through the multi-storage client) records the
    checkpoint's path, a pathlib path, in the metadata's storage_meta: such metadata reads as any other."""
    import pickle

    from torch.distributed.checkpoint import FileSystemWriter

    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore")
    release = tmp_path / "mcore" / "release"
    metadata = FileSystemReader(release).read_metadata()
    metadata.storage_meta = FileSystemWriter(release).storage_meta()
    assert isinstance(metadata.storage_meta.checkpoint_id, pathlib.PurePath)
    (release / ".metadata").write_bytes(pickle.dumps(metadata))
    export(capsys, tmp_path / "mcore", tmp_path / "back")
    assert read_hf(tmp_path / "back").keys() == read_hf(hf).keys()


def dcp_modules_imported_by(argv: list[str], package: str = "torch.distributed.checkpoint", env: dict | None = None) -> str:
    """The modules of `package` that mconvert's command line `argv` imports, run to success in a fresh interpreter."""
    program = (
        "import sys; from mconvert.cli import main; code = main(sys.argv[1:]); "
        f"print(sorted(m for m in sys.modules if m == {package!r} or m.startswith({package + '.'!r}))); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_export_reads_dcp_metadata_without_torchs_dcp_package(hf_model_factory, tmp_path):
    """`.metadata` is read into plain records (importing torch.distributed.checkpoint is a third of the start):
    the whole conversion runs without that package, and the records say what torch's own classes say. (transformers'
    import brings it, for the check against transformers' class: a conversion-only install, without transformers, is
    what runs here.)"""
    hf = hf_model_factory("qwen3-30b-a3b", layers=2)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2))
    argv = ["mcore-to-hf", "--load-dir", str(tmp_path / "mcore"), "--save-dir", str(tmp_path / "back")]
    (tmp_path / "blocker").mkdir()
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "blocker"), str(REPO)])}
    assert dcp_modules_imported_by(argv, env=env) == "[]"
    assert sorted(HFCheckpoint(tmp_path / "back").tensors) == sorted(HFCheckpoint(hf).tensors)

    release = tmp_path / "mcore" / RELEASE
    records = DCPCheckpoint(release).metadata
    torchs = FileSystemReader(release).read_metadata()
    assert set(records.state_dict_metadata) == set(torchs.state_dict_metadata)
    for key, meta in torchs.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            record = records.state_dict_metadata[key]
            assert (record.size, torch_dtype(record.properties.dtype)) == (meta.size, meta.properties.dtype)
            assert [(c.offsets, c.sizes) for c in record.chunks] == [(c.offsets, c.sizes) for c in meta.chunks]
    stored = {(i.fqn, getattr(i, "offset", None)): vars(info) for i, info in records.storage_data.items()}
    assert stored == {(i.fqn, i.offset): {k: v for k, v in vars(info).items() if v is not None} for i, info in torchs.storage_data.items()}


@pytest.mark.parametrize("family", ["qwen3-30b-a3b", "deepseek-v3", "qwen3-next-80b-a3b-instruct"])
def test_hf_to_mcore_never_imports_torch(hf_model_factory, tmp_path, family):
    """hf-to-mcore never imports torch (its import is most of a small model's conversion: 1.0-1.5 s on the 2-core
    box, 3-5 s on the GPU hosts): numpy arrays, torch.save's records and `.metadata` written by hand. torch's own
    readers read the result, tensor for tensor as the HF files hold them (mcore-to-hf reads them through torch)."""
    hf = hf_model_factory(family, layers=2)
    argv = ["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(tmp_path / "mcore"), "--tp", "2", "--ep", "2", "--workers", "2"]
    assert dcp_modules_imported_by(argv, "torch") == "[]"
    release = tmp_path / "mcore" / RELEASE
    assert FileSystemReader(release).read_metadata().state_dict_metadata
    assert torch.load(release / "common.pt", weights_only=False)["args"].params_dtype in (torch.bfloat16, torch.float32)
    main(["mcore-to-hf", "--load-dir", str(tmp_path / "mcore"), "--save-dir", str(tmp_path / "back"), "--quiet"])
    original, back = HFCheckpoint(hf), HFCheckpoint(tmp_path / "back")
    assert sorted(back.tensors) == sorted(original.tensors)
    for name in original.tensors:
        assert np.array_equal(back.read(name).view(np.uint8), original.read(name).view(np.uint8)), name


def test_safetensors_writer_takes_tensors_in_any_order(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(12, dtype=torch.int64).reshape(4, 3), "c": torch.randn(7).bfloat16()}
    writer = SafetensorsWriter(tmp_path, {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}, parse_size("110B"))  # a | b c
    writer.write("c", tensors["c"])
    for row in (3, 0, 2, 1):
        writer.write("b", tensors["b"][row], index=row)
    writer.write("a", tensors["a"])
    writer.finish()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 2
    loaded = {k: v for f in files for k, v in load_file(f).items()}
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20


def test_a_tied_model_does_not_leak_its_tie_into_the_next(hf_model_factory):
    """No state is kept between conversions: tied, untied, tied again, each as its own config says."""
    results = []
    for name in ("qwen2.5-7b-instruct-tied", "qwen2.5-7b-instruct", "qwen2.5-7b-instruct-tied"):
        hf = hf_dir(hf_model_factory, name)
        config = json.loads((hf / "config.json").read_text())
        hf_state = read_hf(hf)
        mcore_state = hf_to_mcore_state_dict(hf_state, config)
        back = mcore_to_hf_state_dict(mcore_state, config)
        results.append(("output_layer.weight" in mcore_state, "lm_head.weight" in back))
        assert all(torch.equal(back[k], hf_state[k]) for k in back)
    assert results == [(False, False), (True, True), (False, False)]


class CountingDCPCheckpoint(DCPCheckpoint):
    def __init__(self, directory):
        super().__init__(directory)
        self.reads: list[tuple[str, int]] = []

    def _read_raw(self, key, number, record, within, target):
        self.reads.append((key, number))
        return super()._read_raw(key, number, record, within, target)


def test_each_stored_chunk_is_read_once_straight_from_its_record(hf_model_factory, tmp_path):
    """Chunks cut across the pieces read (per TP rank here, several per layer) are each read exactly once,
    straight from their torch.save records, large ones (the embedding's, 512 KiB) included: their records'
    zip directories were once parsed from the records' last 64 KiB, which Python 3.12.3's zipfile refuses for a
    record larger than that (zip64 offsets pointing outside it; 3.12.1 and 3.13.0 accept it), so there every
    chunk went through torch.load."""
    from mconvert.converters.mcore_sources import TorchDistTensors
    from mconvert.converters.mcore_to_hf import hf_tensors, plan_export

    convert_hf_to_mcore(hf_model_factory("llama-3.1-8b", vocab_size=8192), tmp_path / "mcore", parallelism=Parallelism(tp=2))
    release = tmp_path / "mcore" / RELEASE
    dcp = CountingDCPCheckpoint(release)
    source = TorchDistTensors(dcp, read_args(release))
    plan, _ = plan_export(source)
    assert len(list(hf_tensors(plan, source))) == len(plan.hf_shapes())
    stored = [(key, n) for key in dcp.shapes for n in range(len(dcp.metadata.state_dict_metadata[key].chunks))]
    assert sorted(dcp.reads) == sorted(stored) and len(stored) > len(plan.pieces)


def test_expert_bias_stays_fp32_in_a_bf16_round_trip(hf_model_factory, tmp_path, capsys):
    """Megatron keeps the router's expert bias in fp32, as the hub's bf16 DeepSeek-V3 stores it: a bf16
    conversion must not round it, either way."""
    hf = tmp_path / "hf"
    make_hf_checkpoint(shrink(real_config("deepseek-v3")), hf, dtype="bfloat16")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2, ep=2))
    dcp = DCPCheckpoint(tmp_path / "mcore" / RELEASE)
    assert dcp.dtypes["decoder.layers.1.mlp.router.expert_bias"] == np.float32
    assert dcp.dtypes["decoder.layers.1.mlp.router.weight"] == dtypes.bfloat16
    export(capsys, tmp_path / "mcore", tmp_path / "back")
    original, back = read_hf(hf), read_hf(tmp_path / "back")
    assert original["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sorted(back) == sorted(original)
    assert all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)


def test_mtp_layers_convert_both_ways_or_are_left_out(tmp_path, capsys):
    """The hub's multi-token prediction layer (HF layer num_hidden_layers, with copies of the embedding and
    head) becomes megatron-core's mtp.layers.0 and comes back bit for bit; --no-mtp leaves it out and says so."""
    hf = add_mtp_layers(make_hf_checkpoint(shrink(real_config("deepseek-v3")), tmp_path / "hf"))
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(tmp_path / "mcore"), "--tp", "2", "--pp", "2", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "converted 1 multi-token prediction layer" in out and "--mtp-num-layers 1" in out and "num_nextn_predict_layers" not in out
    shapes = DCPCheckpoint(tmp_path / "mcore" / RELEASE).shapes
    assert shapes["mtp.layers.0.eh_proj.weight"] == (64, 128)
    assert "mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight" in shapes
    config = export(capsys, tmp_path / "mcore", tmp_path / "back")
    assert config["num_nextn_predict_layers"] == 1
    original, back = read_hf(hf), read_hf(tmp_path / "back")
    assert sorted(back) == sorted(original)
    assert all(torch.equal(original[k], back[k]) for k in original)

    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(tmp_path / "no-mtp"), "--no-mtp"]) == 0
    out = capsys.readouterr().out
    assert "left out 1 multi-token prediction layer" in out and "--mtp-num-layers" not in out
    assert not any(key.startswith("mtp.") for key in DCPCheckpoint(tmp_path / "no-mtp" / RELEASE).shapes)


def test_a_checkpoint_without_the_mtp_layers_its_config_names_converts_without_them_and_says_so(tmp_path, capsys):
    """transformers' save_pretrained drops the multi-token prediction layers; config.json still names them. The
    conversion is of what the checkpoint holds, and its summary says what config.json named (a peer converter
    saves randomly initialized MTP layers there, silently)."""
    hf = make_hf_checkpoint(shrink(real_config("deepseek-v3")), tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(tmp_path / "mcore")]) == 0
    out = capsys.readouterr().out
    assert f"note: config.json's num_nextn_predict_layers says 1 multi-token prediction layer(s), which {hf} does not hold" in out
    assert "--mtp-num-layers" not in out
    assert not any(key.startswith("mtp.") for key in DCPCheckpoint(tmp_path / "mcore" / RELEASE).shapes)


def test_a_save_without_megatron_lms_args_takes_the_model_from_hf_config_and_its_mtp_layers_from_its_keys(tmp_path, capsys):
    """Other tools' torch_dist saves: ms-swift stores its own training arguments where Megatron-LM's are (no model in
    them), Megatron-Bridge none. Given --hf-config, the export is bit-exact with the MTP layers the save holds, whether
    or not the HF config names them; without it, one line."""
    hf = add_mtp_layers(make_hf_checkpoint(shrink(real_config("deepseek-v3")), tmp_path / "hf"))
    for name, flags in (("mtp", []), ("no-mtp", ["--no-mtp"])):
        assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(tmp_path / name), "--ep", "2", *flags]) == 0
        torch.save({"args": argparse.Namespace(tensor_model_parallel_size=1, lr=1e-5), "iteration": 0}, tmp_path / name / RELEASE / "common.pt")
        capsys.readouterr()
        config = export(capsys, tmp_path / name, tmp_path / f"{name}-back", "--hf-config", str(hf))
        back, original = read_hf(tmp_path / f"{name}-back"), read_hf(hf)
        if name == "no-mtp":
            original = {k: v for k, v in original.items() if k in back}
            assert len(original) < len(read_hf(hf)) and config["num_nextn_predict_layers"] == 0
        assert sorted(back) == sorted(original) and all(torch.equal(original[k], back[k]) for k in original)
    assert main(["mcore-to-hf", "--load-dir", str(tmp_path / "mtp"), "--save-dir", str(tmp_path / "alone")]) == 1
    assert "no Megatron-LM args that describe the model" in capsys.readouterr().err


def test_ranks_are_given_whole_hf_files_to_fill_and_hash(hf_model_factory, tmp_path):
    """Under torchrun each rank converts the pieces of whole HF files (balanced by bytes), so that it alone
    writes them and hashes them as they fill; the ranks' shares differ by at most one file. The files break
    between pieces only (q, k and v, gate and up in one file), so no file is left for rank 0 to hash at the end."""
    from mconvert.converters.mcore_sources import TorchDistTensors
    from mconvert.converters.mcore_to_hf import (
        file_owners,
        files_written_only_by,
        piece_bytes,
        plan_export,
    )

    convert_hf_to_mcore(hf_model_factory("qwen3-30b-a3b"), tmp_path / "mcore")
    release = tmp_path / "mcore" / RELEASE
    source = TorchDistTensors(DCPCheckpoint(release), read_args(release))
    plan, _ = plan_export(source)
    dtypes = {ref.name: plan.dtype_of(piece) for piece in plan.pieces for ref in piece.sources}
    layout = {name: (dtypes[name], shape) for name, shape in plan.hf_shapes().items()}
    writer = SafetensorsWriter(tmp_path / "hf", layout, parse_size("100KB"), create=False, together=plan.hf_groups())
    sizes = piece_bytes(plan, source)
    owners = file_owners(plan, writer, sizes, 3)
    assert sorted(path for rank in range(3) for path in files_written_only_by(rank, plan, writer, owners)) == sorted(writer.files)
    # Without the groups some piece's tensors straddle two files here.
    loose = SafetensorsWriter(tmp_path / "hf", layout, parse_size("100KB"), create=False)
    assert any(len({loose.places[ref.name][0] for ref in piece.sources}) > 1 for piece in plan.pieces)
    by_file: dict = {}
    for piece, owner, size in zip(plan.pieces, owners, sizes):
        by_file.setdefault(writer.places[piece.sources[0].name][0], []).append((owner, size))
    assert len(by_file) == len(writer.files) > 6
    assert all(len({owner for owner, _ in pieces}) == 1 for pieces in by_file.values())
    share = [sum(size for owner, size in zip(owners, sizes) if owner == rank) for rank in range(3)]
    largest_file = max(sum(size for _, size in pieces) for pieces in by_file.values())
    assert min(share) > 0 and max(share) - min(share) <= largest_file
