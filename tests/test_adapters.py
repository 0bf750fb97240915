"""Megatron-Bridge's LoRA adapter saves (tests/fixtures/megatron_bridge_lora, made by its own code on CPU ranks at
TP 1 and 2) exported by `adapter-to-hf`: peft loads the adapter onto the HF base and gives Megatron-Bridge's own
model-with-adapter logits; peft's merged weights are Megatron-Bridge's merged weights; and an A/B orientation swap, a
wrong scaling and a q/k/v split in the wrong order each fail those checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.cli import main
from mconvert.converters.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from mconvert.dtypes import as_torch
from mconvert.formats.hf_checkpoint import HFCheckpoint, read_hf_config
from mconvert.mappings import get_mapping
from mconvert.mappings.transforms import QKVInterleave

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent / "fixtures" / "megatron_bridge_lora"
BASE = FIXTURE / "hf"
# fp32 on both sides: the logits agree to about 2e-6 (of values up to 3.7), a wrong adapter moves them by 0.1 or more.
LOGITS_TOLERANCE = 1e-4
WEIGHT_TOLERANCE = 1e-6


def read_hf(directory: Path) -> dict[str, torch.Tensor]:
    checkpoint = HFCheckpoint(directory)
    return {name: as_torch(checkpoint.read(name)) for name in checkpoint.tensors}


def export(tp: int, out: Path) -> Path:
    code = main(["adapter-to-hf", "--load-dir", str(FIXTURE / f"tp{tp}" / "checkpoint"), "--hf-config", str(BASE), "--save-dir", str(out)])
    assert code == 0
    return out


def peft_model(adapter: Path):
    base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter).eval()


def logits_error(adapter: Path, tp: int) -> float:
    """Largest difference between peft's logits of base + adapter and Megatron-Bridge's for the same tokens."""
    reference = load_file(FIXTURE / f"tp{tp}" / "logits.safetensors")
    with torch.no_grad():
        logits = peft_model(adapter)(reference["tokens"]).logits
    return (logits - reference["logits"]).abs().max().item()


def merged_error(adapter: Path) -> float:
    """Largest difference between peft's merged HF weights and Megatron-Bridge's merged ones (TP 1), the latter split
    into HF's tensors by the family table."""
    merged = peft_model(adapter).merge_and_unload().state_dict()
    family, spec = get_mapping(read_hf_config(BASE, "--hf-config"))
    worst = 0.0
    for name, weight in load_file(FIXTURE / "tp1" / "merged.safetensors").items():
        layer, module = name.removeprefix("decoder.layers.").split(".", 1)
        table_layer = family.table.layer(spec, int(layer))
        entry = next(e for e in table_layer.entries if e.mcore == module)
        for hf_name, part in zip(entry.hf_names, entry.to_hf(weight, spec)):
            worst = max(worst, (merged[table_layer.prefix + hf_name] - part).abs().max().item())
    return worst


@pytest.mark.parametrize("tp", [1, 2])
def test_peft_gives_megatron_bridges_logits_with_the_exported_adapter(tp, tmp_path):
    adapter = export(tp, tmp_path / "adapter")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16.0, False)
    assert logits_error(adapter, tp) < LOGITS_TOLERANCE
    # The adapter matters: the base alone is far from Megatron-Bridge's model with it.
    reference = load_file(FIXTURE / f"tp{tp}" / "logits.safetensors")
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)(reference["tokens"]).logits
    assert (base - reference["logits"]).abs().max().item() > 0.1


def test_peft_merges_into_megatron_bridges_merged_weights(tmp_path):
    assert merged_error(export(1, tmp_path / "adapter")) < WEIGHT_TOLERANCE


def _swap_orientation(adapter: Path) -> None:
    """lora_A written as lora_B's transpose and lora_B as lora_A's (where the shapes still load: o_proj's)."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    for name in [n for n in tensors if n.endswith("o_proj.lora_A.weight")]:
        b_name = name.replace("lora_A", "lora_B")
        tensors[name], tensors[b_name] = tensors[b_name].T.contiguous(), tensors[name].T.contiguous()
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS))


def _wrong_scaling(adapter: Path) -> None:
    """lora_alpha written as the rank: a scale of 1 where Megatron-Bridge's alpha / dim is 2."""
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(dict(config, lora_alpha=config["r"])))


def _kv_swapped(to_hf):
    return lambda self, tensor, spec: (lambda q, k, v: [q, v, k])(*to_hf(self, tensor, spec))


def _not_by_query_group(to_hf):
    """The fused rows taken as all queries, then all keys, then all values (not group by group)."""
    def split(self, tensor, spec):
        q, k, v = to_hf(self, tensor, spec)
        return np.split(tensor, [q.shape[0], q.shape[0] + k.shape[0]])
    return split


@pytest.mark.parametrize("fault", ["orientation", "scaling", "kv_order", "qkv_ungrouped"])
def test_each_fault_fails_the_checks(fault, tmp_path, monkeypatch):
    if fault in ("kv_order", "qkv_ungrouped"):
        wrong = _kv_swapped if fault == "kv_order" else _not_by_query_group
        monkeypatch.setattr(QKVInterleave, "to_hf", wrong(QKVInterleave.to_hf))
    adapter = export(1, tmp_path / "adapter")
    monkeypatch.undo()  # the check's own split of Megatron-Bridge's merged weights is the right one
    if fault == "orientation":
        _swap_orientation(adapter)
    elif fault == "scaling":
        _wrong_scaling(adapter)
    assert logits_error(adapter, 1) > 100 * LOGITS_TOLERANCE
    assert merged_error(adapter) > 100 * WEIGHT_TOLERANCE


@pytest.mark.parametrize(
    "save, expected",
    [
        ("experts", "'decoder.layers.mlp.experts.experts.linear_fc1.adapter.linear_in.weight': adapters on experts are not exported yet"),
        ("router", "'decoder.layers.mlp.router.adapter.linear_in.weight': adapters on the MoE router are not exported yet"),
    ],
)
def test_megatron_bridges_moe_adapters_are_refused_in_one_line(save, expected, tmp_path, capsys):
    """Megatron-Bridge's own saves of a Qwen3-MoE model's LoRA on its experts, and on its router."""
    moe = FIXTURE / "moe"
    code = main(["adapter-to-hf", "--load-dir", str(moe / save / "checkpoint"), "--hf-config", str(moe), "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def _save_with(tmp_path: Path, run_config: str | None) -> Path:
    """The TP 1 fixture save copied, its run_config.yaml replaced (kept where None)."""
    save = tmp_path / "save"
    shutil.copytree(FIXTURE / "tp1" / "checkpoint", save)
    if run_config is not None:
        (save / "iter_0000010" / "run_config.yaml").write_text(run_config)
    return save


@pytest.mark.parametrize(
    "run_config, base_overrides, expected",
    [
        ("peft:\n  _target_: megatron.bridge.peft.dora.DoRA\n  dim: 8\n  alpha: 16\n", {}, "peft is megatron.bridge.peft.dora.DoRA; adapter-to-hf exports megatron.bridge.peft.lora.LoRA adapters only"),
        ("model: {}\n", {}, "no peft: section"),
        (None, {"intermediate_size": 96}, "do not adapt a [192, 64] weight, mlp.linear_fc1's in the --hf-config model"),
    ],
)
def test_what_is_not_exported_is_refused_in_one_line(run_config, base_overrides, expected, tmp_path, capsys):
    save = _save_with(tmp_path, run_config)
    base = BASE
    if base_overrides:
        base = tmp_path / "base"
        shutil.copytree(BASE, base)
        config = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps(dict(config, **base_overrides)))
    code = main(["adapter-to-hf", "--load-dir", str(save), "--hf-config", str(base), "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tp", [1, 2])
def test_the_merged_export_is_megatron_bridges_model_with_the_adapter(tp, tmp_path, capsys):
    """mcore-to-hf of the base (converted at TP 2) with the adapter merged in: transformers' logits of it are
    Megatron-Bridge's model-with-adapter logits; at TP 1 its weights are Megatron-Bridge's merged weights."""
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.parallelism import Parallelism

    convert_hf_to_mcore(BASE, tmp_path / "base", parallelism=Parallelism(tp=2))
    adapter = FIXTURE / f"tp{tp}" / "checkpoint"
    out = tmp_path / "merged"
    flags = ["--load-dir", str(tmp_path / "base"), "--adapter", str(adapter), "--hf-config", str(BASE), "--dtype", "fp32"]
    assert main(["mcore-to-hf", *flags, "--save-dir", str(out)]) == 0, capsys.readouterr().err
    reference = load_file(FIXTURE / f"tp{tp}" / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert (model(reference["tokens"]).logits - reference["logits"]).abs().max().item() < LOGITS_TOLERANCE
    if tp == 1:
        family, spec = get_mapping(read_hf_config(BASE, "--hf-config"))
        exported = read_hf(out)
        for name, weight in load_file(FIXTURE / "tp1" / "merged.safetensors").items():
            layer, module = name.removeprefix("decoder.layers.").split(".", 1)
            table_layer = family.table.layer(spec, int(layer))
            entry = next(e for e in table_layer.entries if e.mcore == module)
            for hf_name, part in zip(entry.hf_names, entry.to_hf(weight, spec)):
                assert (exported[table_layer.prefix + hf_name] - part).abs().max().item() < WEIGHT_TOLERANCE, hf_name
    # In the base's own dtype (bf16) the sum is rounded once: the export is the fp32 one rounded to bf16.
    bf16 = tmp_path / "merged-bf16"
    assert main(["mcore-to-hf", *flags[:-2], "--save-dir", str(bf16)]) == 0, capsys.readouterr().err
    fp32 = read_hf(out)
    for name, tensor in read_hf(bf16).items():
        assert torch.equal(tensor, fp32[name].to(torch.bfloat16)), name


def test_a_wrong_scaling_in_the_merged_export_fails_the_check(tmp_path, monkeypatch, capsys):
    from mconvert.converters import adapters
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore

    monkeypatch.setattr(adapters.LoraSettings, "scale", property(lambda self: 1.0))  # alpha / dim is 2
    convert_hf_to_mcore(BASE, tmp_path / "base")
    flags = ["--load-dir", str(tmp_path / "base"), "--adapter", str(FIXTURE / "tp1" / "checkpoint"), "--dtype", "fp32"]
    assert main(["mcore-to-hf", *flags, "--save-dir", str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    reference = load_file(FIXTURE / "tp1" / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        assert (model(reference["tokens"]).logits - reference["logits"]).abs().max().item() > 100 * LOGITS_TOLERANCE


def test_an_adapter_of_another_model_is_refused_before_the_merged_export(tmp_path, capsys):
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.synthetic import make_hf_checkpoint, real_config, shrink

    other = make_hf_checkpoint(shrink(real_config("qwen2.5-0.5b"), vocab_size=256, intermediate_size=96), tmp_path / "other")
    convert_hf_to_mcore(other, tmp_path / "base")
    capsys.readouterr()  # transformers' progress bars
    flags = ["--load-dir", str(tmp_path / "base"), "--adapter", str(FIXTURE / "tp1" / "checkpoint")]
    assert main(["mcore-to-hf", *flags, "--save-dir", str(tmp_path / "merged")]) == 1
    err = capsys.readouterr().err
    assert "'decoder.layers.mlp.linear_fc1' lora_A [2, 8, 64] and lora_B [2, 256, 8] do not adapt its weight [2, 192, 64]" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "merged").exists()


def test_target_modules_are_named_in_whole_where_short_names_would_adapt_more():
    from mconvert.converters.adapters import LoraSettings, adapter_config

    every = [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]
    settings = LoraSettings(dim=8, alpha=16, dropout=0.0)
    assert adapter_config(settings, every, "base", layers=2)["target_modules"] == ["q_proj", "v_proj"]
    first_layer = every[:2]  # a run that adapted layer 0 only
    assert adapter_config(settings, first_layer, "base", layers=2)["target_modules"] == sorted(first_layer)


def test_without_pyyaml_adapter_to_hf_says_what_to_install_in_one_line(tmp_path):
    import tomllib

    from cli_runner import REPO, assert_one_line_error, run_cli

    from mconvert.dependencies import ADAPTERS, ADAPTERS_INSTALL

    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n\nclass _NotInstalled:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'yaml':\n            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n\n"
        "sys.meta_path.insert(0, _NotInstalled())\n"
    )
    flags = ["--load-dir", FIXTURE / "tp1" / "checkpoint", "--hf-config", BASE, "--save-dir", tmp_path / "out"]
    result = run_cli("adapter-to-hf", *flags, python_path=(tmp_path,))
    assert_one_line_error(result, "adapter-to-hf needs pyyaml>=5.1 (not installed)", ADAPTERS_INSTALL, code=2)
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["adapters"]
    assert {f"{r.distribution}>={r.minimum}" for r in ADAPTERS} <= set(extra)
