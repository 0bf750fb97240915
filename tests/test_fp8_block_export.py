"""`mcore-to-hf --quantize fp8-block`: a bf16 model's export written as DeepSeek-V3's FP8 release is written, its
source unquantized.

Two shrunk models, Qwen3 (dense) and Qwen3-MoE (8 experts), random bf16 weights at 0.1, go to Megatron (bf16, TP 2)
and back twice: unquantized in bf16 (`plain`), and with `--quantize fp8-block` (`fp8`). Every width is a multiple of
128, as transformers' dequantization at load needs (it takes the block size from the scales' grid). Each quantized
weight is held bit for bit to compressed-tensors' block FP8 quantizer (tests/test_fp8_export.py's reference, 128 x 128
blocks), every other tensor to the unquantized export's; transformers loads the FP8 export with its FineGrainedFP8
integration, dequantizing at load (`dequantize: True`, as tests/gpu/test_quantized_exports.py loads FP8 on a
machine without its kernels): its logits are those of the reference-dequantized weights bit for bit, and the dense
model's are held to the format's error against the unquantized export's. A DeepSeek-V3 shrunk below 128 checks the
partial blocks at the edges."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.quantizers.auto import AutoQuantizationConfig
from transformers.quantizers.quantizers_utils import should_convert_module

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.converters.mcore_to_hf import convert_mcore_to_hf
from mconvert.converters.quantized_export import FP8_BLOCK_CONFIG, is_fp8_on_the_hub
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import make_hf_checkpoint, real_config, shrink
from tests.cli_runner import assert_nothing_left
from tests.test_fp8_export import bits, headers, reference_quantize, tensors, ue8m0_quantize

BLOCK = (128, 128)
SIZES = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256, "num_key_value_heads": 4, "moe_intermediate_size": 128}
MODELS = {"qwen3": "qwen3-8b", "qwen3-moe": "qwen3-30b-a3b"}
# The FP8 export's logits against the bf16 export's, as the largest difference relative to the largest logit. transformers
# dequantizes at load (q * scale in fp32, rounded once to bf16): its logits are those of the bf16 model whose linear
# weights are the reference quantizer's values so dequantized, bit for bit (the test holds them to that), so the
# difference is the format's own rounding of the weights (e4m3: 3 bits of mantissa), nothing else. Measured on the CPU
# (transformers 5.24, the prompt below): 0.146 for Qwen3 (top-1 0.82) and 0.721 for Qwen3-MoE (top-1 0.59: its random
# routers, fed values moved by that rounding, choose other experts). The bound, held for the dense model alone (the
# MoE's rounding already moves its logits nearly as far as a fault does), is a quarter of the largest logit: e4m3's
# relative error, up to 2^-4 a weight, through two layers of random weights; every scale doubled (the fault, a
# factor 2 on each weight) moves them 0.644 (top-1 0.36; the MoE's 0.940, top-1 0.16).
FORMAT_ERROR = 0.25
PROMPT = (2, 48)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """model -> directory with `source` (bf16), `mcore` (bf16, TP 2), `plain` and `fp8` (the exports), and for Qwen3
    `fp8-ue8m0` (--quantize fp8-block-ue8m0)."""
    made = {}
    for model, name in MODELS.items():
        root = tmp_path_factory.mktemp(model)
        config = shrink(real_config(name), **SIZES)
        make_hf_checkpoint(config, root / "source", dtype="bfloat16", weight_std=0.1)
        convert_hf_to_mcore(root / "source", root / "mcore", parallelism=Parallelism(tp=2), dtype=torch.bfloat16)
        convert_mcore_to_hf(root / "mcore", root / "plain", hf_config_dir=root / "source", dtype=torch.bfloat16)
        args = ["mcore-to-hf", "--load-dir", str(root / "mcore"), "--save-dir", str(root / "fp8"), "--hf-config", str(root / "source")]
        assert main([*args, "--quantize", "fp8-block"]) == 0
        if model == "qwen3":
            args[4] = str(root / "fp8-ue8m0")
            assert main([*args, "--quantize", "fp8-block-ue8m0"]) == 0
        made[model] = root
    return made


def quantized_names(directory) -> set[str]:
    return {name.removesuffix("_scale_inv") for name in headers(directory) if name.endswith("_scale_inv")}


@pytest.mark.parametrize("model", MODELS)
def test_the_decoders_linear_layers_are_fp8_with_deepseeks_config(work, model):
    plain, fp8 = headers(work[model] / "plain"), headers(work[model] / "fp8")
    names = quantized_names(work[model] / "fp8")
    assert names == {name for name in plain if ".layers." in name and is_fp8_on_the_hub(name)}
    assert {name: fp8[name] for name in names} == {name: ("F8_E4M3", plain[name][1]) for name in names}
    assert all(fp8[name + "_scale_inv"] == ("F32", tuple(-(-n // 128) for n in plain[name][1])) for name in names)
    assert {name: fp8[name] for name in plain if name not in names} == {name: plain[name] for name in plain if name not in names}
    quantization = json.loads((work[model] / "fp8" / "config.json").read_text())["quantization_config"]
    assert {key: quantization[key] for key in FP8_BLOCK_CONFIG} == FP8_BLOCK_CONFIG
    assert "lm_head" in quantization["modules_to_not_convert"]
    if model == "qwen3-moe":
        assert len(names) > 8 * 3 * 2 and "mlp.gate" in quantization["modules_to_not_convert"]


def mismatches(fp8_dir, plain_dir, reference=reference_quantize) -> list[str]:
    """The tensors of the FP8 export that are not the `reference` quantizer's output for the bf16 export's tensor
    (bytes, and scales as fp32), or, unquantized, not that tensor bit for bit."""
    fp8, plain = tensors(fp8_dir), tensors(plain_dir)
    wrong = sorted(set(plain) ^ {name for name in fp8 if not name.endswith("_scale_inv")})
    for name, tensor in plain.items():
        if name + "_scale_inv" in fp8:
            q, scale = reference(tensor, BLOCK)
            if not (torch.equal(bits(fp8[name]), bits(q)) and torch.equal(fp8[name + "_scale_inv"], scale.float())):
                wrong.append(name)
        elif not torch.equal(fp8[name], tensor):
            wrong.append(name)
    return wrong


@pytest.mark.parametrize("model", MODELS)
def test_each_tensor_is_the_reference_quantizers_or_the_bf16_exports_bit_for_bit(work, model):
    assert mismatches(work[model] / "fp8", work[model] / "plain") == []


def test_ue8m0_scales_are_deepgemms_powers_of_two_bit_for_bit(work, tmp_path):
    """--quantize fp8-block-ue8m0: the same tensors, scale_fmt ue8m0 in the config, scales (fp32) rounded up to powers
    of two as DeepGEMM's per_block_cast_to_fp8 with use_ue8m0 rounds them; transformers runs it as its dequantized
    weights. The fp8-block export is not that (its scales are amax / 448)."""
    directory, plain = work["qwen3"] / "fp8-ue8m0", work["qwen3"] / "plain"
    assert quantized_names(directory) == quantized_names(work["qwen3"] / "fp8")
    assert json.loads((directory / "config.json").read_text())["quantization_config"]["scale_fmt"] == "ue8m0"
    assert mismatches(directory, plain, ue8m0_quantize) == []
    assert mismatches(work["qwen3"] / "fp8", plain, ue8m0_quantize) != []
    assert torch.equal(logits(directory), logits(dequantized(directory, tmp_path / "exact")))


def test_a_doubled_scale_or_a_changed_norm_is_caught(work, tmp_path):
    root = work["qwen3-moe"]
    for fault in ("scale", "norm"):
        broken = tmp_path / fault
        shutil.copytree(root / "fp8", broken)
        path = next(iter(sorted(broken.glob("*.safetensors"))))
        loaded = tensors(broken)
        name = next(n for n in sorted(loaded) if (n.endswith("_scale_inv") if fault == "scale" else n.endswith("norm.weight")))
        for stale in broken.glob("*.safetensors"):
            stale.unlink()
        loaded[name] = loaded[name] * 2
        save_file(loaded, path, metadata={"format": "pt"})
        (broken / "model.safetensors.index.json").unlink(missing_ok=True)
        assert mismatches(broken, root / "plain") == [name.removesuffix("_scale_inv")]


def skipped_as_written(work, model: str, fault: str | None = None) -> bool:
    """Whether transformers' FineGrainedFP8 (which, given modules_to_not_convert, skips those alone) makes an FP8
    layer of exactly each nn.Linear whose weight is FP8, and leaves every other one (lm_head, routers) alone."""
    config = json.loads((work[model] / "fp8" / "config.json").read_text())
    skip = [pattern for pattern in config["quantization_config"]["modules_to_not_convert"] if pattern != fault] + ([fault] if fault == "mlp.down_proj" else [])
    names = quantized_names(work[model] / "fp8")
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(work[model] / "plain"))
    linears = [name for name, module in hf.named_modules() if type(module) is nn.Linear]
    return bool(linears) and all(should_convert_module(name, skip) == (name + ".weight" in names) for name in linears)


@pytest.mark.parametrize("model", MODELS)
def test_transformers_skips_exactly_the_modules_left_unquantized(work, model):
    assert skipped_as_written(work, model)


@pytest.mark.parametrize("fault", ["lm_head", "mlp.down_proj"])
def test_a_wrong_modules_to_not_convert_is_caught(work, fault):
    """lm_head left out (transformers would make an FP8 layer of a bf16 weight), or an FP8 projection skipped (it would be loaded as bf16 without its scales)."""
    assert not skipped_as_written(work, "qwen3", fault)


def logits(directory, scale: float = 1.0) -> torch.Tensor:
    config = json.loads((directory / "config.json").read_text())
    options = {}
    if "quantization_config" in config:
        options["quantization_config"] = AutoQuantizationConfig.from_dict({**config["quantization_config"], "dequantize": True})
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, **options).eval()
    prompt = torch.randint(3, model.config.vocab_size, PROMPT, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(prompt).logits.float()


def dequantized(directory, out, scale: float = 1.0):
    """`directory`'s FP8 export with each FP8 weight as the reference dequantizes it (q * `scale` x its scale, in fp32,
    rounded to bf16): a bf16 checkpoint, config.json without the quantization_config."""
    loaded = tensors(directory)
    values = {}
    for name, tensor in loaded.items():
        if name + "_scale_inv" in loaded:
            factors = scale * loaded[name + "_scale_inv"].repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)
            assert factors.shape == tensor.shape  # whole blocks, as transformers' dequantization needs
            values[name] = (tensor.float() * factors).to(torch.bfloat16)
        elif not name.endswith("_scale_inv"):
            values[name] = tensor
    out.mkdir()
    save_file(values, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({key: value for key, value in config.items() if key != "quantization_config"}))
    return out


@pytest.mark.parametrize("model", MODELS)
def test_transformers_runs_the_fp8_export_as_its_dequantized_weights(work, model, tmp_path):
    """The logits of the FP8 export equal, bit for bit, those of its weights dequantized by the reference; with every
    scale doubled (the fault) they do not. The dense model's differ from the bf16 export's by FP8's rounding alone."""
    fp8 = logits(work[model] / "fp8")
    assert torch.equal(fp8, logits(dequantized(work[model] / "fp8", tmp_path / "exact")))
    assert not torch.equal(fp8, logits(dequantized(work[model] / "fp8", tmp_path / "doubled", scale=2.0)))
    plain = logits(work[model] / "plain")
    error = ((fp8 - plain).abs().max() / plain.abs().max()).item()
    print(f"{model}: largest logit difference / largest logit {error:.4f}, top-1 {(fp8.argmax(-1) == plain.argmax(-1)).float().mean():.3f}")
    if model == "qwen3":
        assert error < FORMAT_ERROR
        doubled = logits(dequantized(work[model] / "fp8", tmp_path / "doubled-check", scale=2.0))
        assert ((doubled - plain).abs().max() / plain.abs().max()).item() > FORMAT_ERROR


def test_hf_to_mcore_reads_the_fp8_export_back_and_requantizing_gives_its_bytes(work, tmp_path):
    root = work["qwen3"]
    convert_hf_to_mcore(root / "fp8", tmp_path / "mcore", parallelism=Parallelism(tp=2), dtype=torch.float32)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "again", hf_config_dir=root / "fp8", quantize="fp8-block")
    first, again = tensors(root / "fp8"), tensors(tmp_path / "again")
    assert first.keys() == again.keys()
    assert [name for name in first if not torch.equal(bits(first[name]), bits(again[name]))] == []
    quantization = [json.loads((directory / "config.json").read_text())["quantization_config"] for directory in (root / "fp8", tmp_path / "again")]
    assert quantization[0] == quantization[1]


def test_a_fused_projection_written_in_parts_is_one_line(tmp_path, capsys):
    """Nemotron-H's Mamba in_proj is written in sections of rows (megatron-core stores them apart), whose blocks would
    straddle them: refused, nothing written."""
    config = shrink(real_config("nemotron-3-nano-30b-a3b"), layers=1)
    make_hf_checkpoint(config, tmp_path / "source", dtype="bfloat16")
    convert_hf_to_mcore(tmp_path / "source", tmp_path / "mcore", parallelism=Parallelism(model_class="hybrid"), dtype=torch.bfloat16)
    args = ["mcore-to-hf", "--load-dir", str(tmp_path / "mcore"), "--save-dir", str(tmp_path / "out"), "--hf-config", str(tmp_path / "source")]
    capsys.readouterr()  # the source's writing
    code = main([*args, "--quantize", "fp8-block"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and err.startswith("mconvert: error: --quantize fp8-block: tensor '"), err
    assert "is written in parts" in err, err
    assert_nothing_left(tmp_path / "out")


def test_partial_blocks_are_written_as_deepseeks_release_writes_them(tmp_path):
    """DeepSeek-V3 shrunk (MLA's widths, 24 to 112, below 128, a hidden size of 160): each linear layer quantized as
    the reference quantizes it, the edge blocks partial, the scales' grid rounded up, as the release's 576-row
    kv_a_proj_with_mqa has them; routers, norms, embeddings and the output layer as the bf16 export's."""
    config = shrink(real_config("deepseek-v3"), hidden_size=160)
    make_hf_checkpoint(config, tmp_path / "source", dtype="bfloat16", weight_std=0.1)
    convert_hf_to_mcore(tmp_path / "source", tmp_path / "mcore", parallelism=Parallelism(tp=2), dtype=torch.bfloat16)
    for out, quantize in (("plain", None), ("fp8", "fp8-block")):
        convert_mcore_to_hf(tmp_path / "mcore", tmp_path / out, hf_config_dir=tmp_path / "source", dtype=torch.bfloat16, quantize=quantize)
    assert mismatches(tmp_path / "fp8", tmp_path / "plain") == []
    written = headers(tmp_path / "fp8")
    names = quantized_names(tmp_path / "fp8")
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in names and "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert written["model.layers.0.mlp.down_proj.weight_scale_inv"] == ("F32", (2, 1))  # 160 rows: 128 and 32
    assert not any(".gate." in name or "norm" in name or "embed" in name or "head" in name for name in names)
