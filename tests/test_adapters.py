"""Megatron-Bridge's adapter saves (tests/fixtures/megatron_bridge_lora, made by its own code on CPU ranks at TP 1
and 2: LoRA, CanonicalLoRA and DoRA) exported by `adapter-to-hf`: peft loads the adapter onto the HF base and gives
Megatron-Bridge's own model-with-adapter logits; peft's merged weights are Megatron-Bridge's merged weights; and an
A/B orientation swap, a wrong scaling, a q/k/v split in the wrong order, CanonicalLoRA's gate/up rows left in their
TP 2 storage order and DoRA's magnitudes dropped or misplaced each fail those checks."""

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
from tests.adapter_faults import swap_orientation, wrong_scaling

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


def saved(save: int | str) -> Path:
    """A fixture save's directory: the LoRA one at TP `save`, or the one of that name (`canonical-tp2`)."""
    return FIXTURE / (f"tp{save}" if isinstance(save, int) else save)


def base_of(save: int | str) -> Path:
    """The HF base model of a fixture save: the MoE saves' (`moe-lora/hf`), else the dense one."""
    return FIXTURE / "moe-lora" / "hf" if str(save).startswith("moe-lora") else BASE


def logits_of(save: int | str) -> dict[str, torch.Tensor]:
    """Megatron-Bridge's tokens and model-with-adapter logits of a fixture save (the EP 2 MoE save holds the EP 1
    save's adapter, whose logits it is checked against)."""
    return load_file(saved("moe-lora" if save == "moe-lora-ep2" else save) / "logits.safetensors")


def export(save: int | str, out: Path) -> Path:
    code = main(["adapter-to-hf", "--load-dir", str(saved(save) / "checkpoint"), "--hf-config", str(base_of(save)), "--save-dir", str(out)])
    assert code == 0
    return out


def peft_model(adapter: Path, base_dir: Path = BASE):
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, adapter).eval()


def logits_error(adapter: Path, save: int | str) -> float:
    """Largest difference between peft's logits of base + adapter and Megatron-Bridge's for the same tokens."""
    reference = logits_of(save)
    with torch.no_grad():
        logits = peft_model(adapter, base_of(save))(reference["tokens"]).logits
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


SAVES = [1, 2, "canonical-tp1", "canonical-tp2", "dora-tp1"]


@pytest.mark.parametrize("save", SAVES)
def test_peft_gives_megatron_bridges_logits_with_the_exported_adapter(save, tmp_path):
    adapter = export(save, tmp_path / "adapter")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (8, 16.0, False)
    assert config["use_dora"] == (save == "dora-tp1")
    assert logits_error(adapter, save) < LOGITS_TOLERANCE
    if str(save).startswith("canonical"):  # one adapter per projection, each its own lora_A
        tensors = load_file(adapter / ADAPTER_WEIGHTS)
        q, k = (tensors[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_A.weight"] for p in "qk")
        assert not torch.equal(q, k)
    # The adapter matters: the base alone is far from Megatron-Bridge's model with it.
    reference = logits_of(save)
    with torch.no_grad():
        base = transformers.AutoModelForCausalLM.from_pretrained(base_of(save), dtype=torch.float32)(reference["tokens"]).logits
    assert (base - reference["logits"]).abs().max().item() > 0.1


def test_peft_merges_into_megatron_bridges_merged_weights(tmp_path):
    assert merged_error(export(1, tmp_path / "adapter")) < WEIGHT_TOLERANCE


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
        swap_orientation(adapter)
    elif fault == "scaling":
        wrong_scaling(adapter)
    assert logits_error(adapter, 1) > 100 * LOGITS_TOLERANCE
    assert merged_error(adapter) > 100 * WEIGHT_TOLERANCE


def test_canonical_gate_up_rows_in_another_layout_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """The gate/up reordering undoes 2 x TP stored row blocks; a lora_B stored otherwise (here: said to be in TP
    blocks, as a save without the SwiGLU sharding would be) is refused, not reordered."""
    from mconvert.converters import bridge_adapters

    counted = bridge_adapters.stored_chunks
    monkeypatch.setattr(
        bridge_adapters, "stored_chunks",
        lambda dcp, key, offsets: counted(dcp, key, offsets) // (2 if "adapter_gate.linear_out" in key else 1),
    )
    save = saved("canonical-tp2") / "checkpoint"
    assert main(["adapter-to-hf", "--load-dir", str(save), "--hf-config", str(BASE), "--save-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    expected = "'decoder.layers.mlp.linear_fc1.adapter.adapter_gate.linear_out.weight': stored in 2 row blocks at TP 2, not the 2 x TP"
    assert expected in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def _magnitudes_dropped(adapter: Path) -> None:
    """A plain LoRA adapter written for a DoRA save: the magnitudes left out."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    save_file({n: t for n, t in tensors.items() if "magnitude" not in n}, str(adapter / ADAPTER_WEIGHTS))
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    (adapter / ADAPTER_CONFIG).write_text(json.dumps(dict(config, use_dora=False)))


def _magnitudes_of_the_other_half(adapter: Path) -> None:
    """gate_proj's magnitudes written for up_proj and up_proj's for gate_proj (fc1's magnitude not split as its lora_B)."""
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    for gate in [n for n in tensors if "gate_proj.lora_magnitude_vector" in n]:
        up = gate.replace("gate_proj", "up_proj")
        tensors[gate], tensors[up] = tensors[up], tensors[gate]
    save_file(tensors, str(adapter / ADAPTER_WEIGHTS))


@pytest.mark.parametrize("fault", ["gate_up_rows_as_stored", "dora_magnitudes_dropped", "dora_magnitudes_swapped"])
def test_each_canonical_and_dora_fault_fails_the_check(fault, tmp_path, monkeypatch):
    from mconvert.converters import bridge_adapters

    if fault == "gate_up_rows_as_stored":  # CanonicalLoRA's gate and up lora_B rows read as TP 2 stored them
        monkeypatch.setattr(bridge_adapters, "_gated_half_rows", lambda b, tp: b)
        adapter = export("canonical-tp2", tmp_path / "adapter")
        assert logits_error(adapter, "canonical-tp2") > 100 * LOGITS_TOLERANCE
        assert logits_error(export("canonical-tp1", tmp_path / "tp1"), "canonical-tp1") < LOGITS_TOLERANCE  # the identity at TP 1
        return
    adapter = export("dora-tp1", tmp_path / "adapter")
    (_magnitudes_dropped if fault == "dora_magnitudes_dropped" else _magnitudes_of_the_other_half)(adapter)
    assert logits_error(adapter, "dora-tp1") > 100 * LOGITS_TOLERANCE


def test_megatron_bridges_dora_at_tp_2_is_refused_in_one_line(tmp_path, capsys):
    """Its row-parallel linears' magnitudes are per TP shard there (Megatron-Bridge's own TP 2 save)."""
    code = main(["adapter-to-hf", "--load-dir", str(FIXTURE / "dora-tp2" / "checkpoint"), "--hf-config", str(BASE), "--save-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    expected = "'decoder.layers.self_attention.linear_proj.adapter.weight_magnitude': Megatron-Bridge's DoRA saved at TP 2; only its TP 1 saves are exported"
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
        # A PEFT transform adapter-to-hf does not know (a made-up name).
        ("peft:\n  _target_: megatron.bridge.peft.vera.VeRA\n  dim: 8\n  alpha: 16\n", {}, "peft is megatron.bridge.peft.vera.VeRA; adapter-to-hf reads megatron.bridge.peft.lora.LoRA, megatron.bridge.peft.canonical_lora.CanonicalLoRA, megatron.bridge.peft.dora.DoRA adapters only"),
        # The LoRA save read as DoRA: its first adapter, on linear_qkv, which has q/k/v biases in Qwen2.
        ("peft:\n  _target_: megatron.bridge.peft.dora.DoRA\n  dim: 8\n  alpha: 16\n", {}, "'decoder.layers.self_attention.linear_qkv.adapter.weight_magnitude': Megatron-Bridge's DoRA scales linear_qkv's bias by m / ||W + s B A||, PEFT's does not"),
        ("model: {}\n", {}, "no peft: section"),
        (None, {"intermediate_size": 96}, "do not adapt a [192, 64] weight, mlp.linear_fc1's of the base model"),
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


@pytest.mark.parametrize("save", [*SAVES, "moe-lora", "moe-lora-ep2"])
def test_the_merged_export_is_megatron_bridges_model_with_the_adapter(save, tmp_path, capsys):
    """mcore-to-hf of the base (converted at TP 2) with the adapter merged in: transformers' logits of it are
    Megatron-Bridge's model-with-adapter logits; for LoRA at TP 1 its weights are Megatron-Bridge's merged weights."""
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
    from mconvert.mcore.parallelism import Parallelism

    convert_hf_to_mcore(base_of(save), tmp_path / "base", parallelism=Parallelism(tp=2))
    out = tmp_path / "merged"
    flags = ["--load-dir", str(tmp_path / "base"), "--adapter", str(saved(save) / "checkpoint"), "--hf-config", str(base_of(save)), "--dtype", "fp32"]
    assert main(["mcore-to-hf", *flags, "--save-dir", str(out)]) == 0, capsys.readouterr().err
    reference = logits_of(save)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert (model(reference["tokens"]).logits - reference["logits"]).abs().max().item() < LOGITS_TOLERANCE
    if save == 1:
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


def _dora_norm_of_the_base(merged):
    """DoRA merged as m / ||W|| x (W + s B A): the norm taken before the adapter is added."""
    from mconvert.converters.bridge_adapters import Part

    def wrong(weight, part, scale):
        unit = np.asarray(part.magnitude, dtype=np.float32) / np.linalg.norm(np.asarray(weight, dtype=np.float32), axis=1)
        return merged(weight, Part(part.hf_name, part.a, part.b), scale) * unit[:, None]
    return wrong


@pytest.mark.parametrize(
    "fault, save", [("scaling", "tp1"), ("dora_norm_of_the_base", "dora-tp1"), ("gate_up_rows_as_stored", "canonical-tp2")]
)
def test_each_fault_in_the_merged_export_fails_the_check(fault, save, tmp_path, monkeypatch, capsys):
    from mconvert.converters import adapters, bridge_adapters
    from mconvert.converters.hf_to_mcore import convert_hf_to_mcore

    if fault == "scaling":
        monkeypatch.setattr(adapters.LoraSettings, "scale", property(lambda self: 1.0))  # alpha / dim is 2
    elif fault == "dora_norm_of_the_base":
        monkeypatch.setattr(adapters, "merged", _dora_norm_of_the_base(bridge_adapters.merged))
    else:
        monkeypatch.setattr(bridge_adapters, "_gated_half_rows", lambda b, tp: b)
    convert_hf_to_mcore(BASE, tmp_path / "base")
    flags = ["--load-dir", str(tmp_path / "base"), "--adapter", str(FIXTURE / save / "checkpoint"), "--dtype", "fp32"]
    assert main(["mcore-to-hf", *flags, "--save-dir", str(tmp_path / "merged")]) == 0, capsys.readouterr().err
    reference = logits_of(save)
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
    expected = "'decoder.layers.mlp.linear_fc1.adapter.linear_in.weight' [8, 64] and 'decoder.layers.mlp.linear_fc1.adapter.linear_out.weight' [256, 8] do not adapt a [192, 64] weight"
    assert expected in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "merged").exists()


def test_target_modules_are_named_in_whole_where_short_names_would_adapt_more():
    from mconvert.converters.adapters import adapter_config
    from mconvert.converters.bridge_adapters import LoraSettings

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
