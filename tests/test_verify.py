"""`mconvert verify` on CPU gloo ranks: passes for a faithful conversion of every family, fails for a
checkpoint of another model, and reports usage errors with exit code 2."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from mconvert.cli import main
from mconvert.converters.hf_to_mcore import convert_hf_to_mcore
from mconvert.mcore.parallelism import Parallelism, PipelineSplit
from mconvert.megatron_lm.flags import pipeline_split_flags

FAMILIES = {
    "llama": ("llama-3.1-8b", Parallelism(tp=2)),
    "qwen2": ("qwen2.5-7b-instruct", Parallelism(pp=2)),
    "qwen3": ("qwen3-8b", Parallelism(tp=2)),
    "qwen3_moe": ("qwen3-30b-a3b", Parallelism(ep=2)),
    "qwen2_moe": ("qwen1.5-moe-a2.7b", Parallelism(tp=2, ep=2, etp=1)),
    "mixtral": ("mixtral-8x7b-v0.1", Parallelism(pp=2, ep=2)),
    "deepseek_v3": ("deepseek-v3", Parallelism(tp=2, pp=2)),
    "deepseek_v2": ("deepseek-v2-lite", Parallelism(ep=2)),
    "glm4_moe": ("glm-4.5-air", Parallelism(tp=2, ep=2)),
    # The layouts of 4 and 8 GPUs, on 4 CPU ranks.
    "llama-mha-tp4": ("llama-2-7b", Parallelism(tp=4)),
    "qwen3-tp2-pp2": ("qwen3-8b", Parallelism(tp=2, pp=2)),
    "qwen3_moe-tp2-ep4": ("qwen3-30b-a3b", Parallelism(tp=2, ep=4, etp=1)),
    # Layers split unevenly over the pipeline stages, as Megatron-LM's flags say.
    "qwen3-pp2-first-stage-1": ("qwen3-8b", Parallelism(pp=2, pipeline=PipelineSplit(first_stage_layers=1))),
    "qwen2-pp2-layout": ("qwen2.5-7b-instruct", Parallelism(pp=2, pipeline=PipelineSplit(layout="Et|tttL"))),
    # DeepSeek-V3's experts beside other attention, weights at std 0.1 (tests/test_sigmoid_moe_families.py converts
    # the same models): GLM-4.7-Flash's dense layer where mlp_layer_types says, its MTP layer loaded too; dots.llm1's
    # 8-token window from max_window_layers on, shorter than the prompts; Hy3's own names, its MTP layer.
    "glm4_moe_lite": ("glm-4.7-flash", Parallelism(tp=2, ep=2),
                      dict(layers=3, mtp=True, weight_std=0.1, mlp_layer_types=["sparse", "dense", "sparse"])),
    "dots1": ("dots.llm1.inst", Parallelism(tp=2, ep=2), dict(weight_std=0.1, sliding_window=8, max_window_layers=1)),
    "hy_v3": ("hy3-preview", Parallelism(tp=2, ep=2), dict(mtp=True, weight_std=0.1)),
}


def verify(capsys, hf, mcore, *flags):
    code = main(["verify", "--hf", str(hf), "--mcore", str(mcore), "--device", "cpu", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("family", FAMILIES)
def test_verify_passes_for_a_faithful_conversion(family, hf_model_factory, tmp_path, capsys):
    config, parallelism, *made = FAMILIES[family]  # made: hf_model_factory's arguments where not the defaults
    hf = hf_model_factory(config, **{"layers": 4 if parallelism.pp > 1 else 2, **(made[0] if made else {})})
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=parallelism)
    report = tmp_path / "report.json"
    sizes = ["--tp", str(parallelism.tp), "--pp", str(parallelism.pp), "--ep", str(parallelism.ep)]
    if parallelism.etp:
        sizes += ["--etp", str(parallelism.etp)]
    sizes += [word for flag in pipeline_split_flags(parallelism.pipeline) for word in shlex.split(flag)]
    code, out, _ = verify(capsys, hf, tmp_path / "mcore", *sizes, "--json", str(report))
    assert code == 0, out
    assert out.strip().endswith("PASS")
    result = json.loads(report.read_text())
    assert result["passed"] and len(result["prompts"]) == 4
    assert all(p["top1_agreement"] == 1.0 and p["kl"] < 1e-8 for p in result["prompts"])
    # On CPU the local spec runs (Transformer Engine needs GPUs), and the report says so.
    assert result["spec"] == "local" and "megatron-core layer spec: local" in out


def test_verify_fails_for_another_model(hf_model_factory, tmp_path, capsys):
    """Negative control: same architecture, other weights."""
    hf = hf_model_factory("qwen3-8b")
    other = hf_model_factory("qwen3-8b", seed=1)
    convert_hf_to_mcore(other, tmp_path / "other", parallelism=Parallelism())
    code, out, _ = verify(capsys, hf, tmp_path / "other")
    assert code == 1
    assert "FAIL" in out and "first diverge at decoder layer 0" in out


def test_verify_fails_for_another_architecture(hf_model_factory, tmp_path, capsys):
    convert_hf_to_mcore(hf_model_factory("qwen3-8b", layers=3), tmp_path / "deeper", parallelism=Parallelism())
    code, _, err = verify(capsys, hf_model_factory("qwen3-8b"), tmp_path / "deeper")
    assert code == 1 and "num_layers: checkpoint 3, HF 2" in err


def test_verify_usage_errors(hf_model_factory, tmp_path, capsys):
    hf = hf_model_factory("qwen3-8b")
    code, _, err = verify(capsys, hf, tmp_path / "nothing")
    assert code == 2 and "nothing" in err
    if not torch.cuda.is_available():
        code, _, err = verify(capsys, hf, tmp_path, "--device", "cuda")
        assert code == 2 and "--device cuda" in err


def test_verify_spec_flag(hf_model_factory, tmp_path, capsys):
    """--spec local runs the local spec; --spec te without Transformer Engine, or on CPU, is a usage error."""
    from mconvert.verify.megatron_model import HAVE_TRANSFORMER_ENGINE

    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism())
    report = tmp_path / "report.json"
    code, out, _ = verify(capsys, hf, tmp_path / "mcore", "--spec", "local", "--json", str(report))
    assert code == 0 and json.loads(report.read_text())["spec"] == "local", out
    code, out, err = verify(capsys, hf, tmp_path / "mcore", "--spec", "te")
    expected = "--spec te needs --device cuda" if HAVE_TRANSFORMER_ENGINE else "--spec te: transformer_engine is not installed"
    assert code == 2 and not out and err.startswith("mconvert verify: error: " + expected) and len(err.splitlines()) == 1


def test_verify_text_prompts_with_the_models_tokenizer(hf_model_factory, tmp_path, capsys):
    """--prompts: text, tokenized by the tokenizer in the HF directory (one is built here: no network)."""
    import shutil

    from mconvert.synthetic import write_word_tokenizer

    hf = tmp_path / "hf"
    shutil.copytree(hf_model_factory("qwen3-8b"), hf)
    write_word_tokenizer(hf, 1000)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("w1 w2 w3 w500 w998\n\nw7 unknown w42\n")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism())
    report = tmp_path / "report.json"
    code, out, _ = verify(capsys, hf, tmp_path / "mcore", "--prompts", str(prompts), "--json", str(report))
    assert code == 0, out
    assert [p["tokens"] for p in json.loads(report.read_text())["prompts"]] == [5, 3]


def test_verify_text_prompts_need_a_tokenizer(hf_model_factory, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n")
    hf = hf_model_factory("qwen3-8b")
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism())
    code, _, err = verify(capsys, hf, tmp_path / "mcore", "--prompts", str(prompts))
    assert code == 2 and "--prompts needs a tokenizer" in err


def test_verify_bf16_is_calibrated_on_the_hf_models_own_bf16_error(hf_model_factory, tmp_path, capsys):
    """In bf16 both a faithful conversion passes and another model fails, on a random-init model whose
    near-flat distributions make fixed bf16 limits meaningless."""
    hf = hf_model_factory("qwen3-8b", layers=4)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    report = tmp_path / "report.json"
    code, out, _ = verify(capsys, hf, tmp_path / "mcore", "--tp", "2", "--dtype", "bf16", "--json", str(report))
    assert code == 0, out
    result = json.loads(report.read_text())
    # Megatron in bf16 is about as far from the fp32 reference as transformers' own bf16 run (measured: 0.6 to 1.2
    # times its KL), well within the 4 times allowed.
    assert len(result["hf_bf16_error"]) == 4
    assert all(0 < p["kl"] <= 2 * own["kl"] for p, own in zip(result["prompts"], result["hf_bf16_error"])), result
    convert_hf_to_mcore(hf_model_factory("qwen3-8b", layers=4, seed=1), tmp_path / "other", parallelism=Parallelism())
    code, out, _ = verify(capsys, hf, tmp_path / "other", "--dtype", "bf16")
    assert code == 1 and "first diverge at decoder layer 0" in out


def test_verify_compares_a_sliding_window_model_within_its_window(hf_model_factory, tmp_path, capsys):
    hf = hf_model_factory("llama-2-7b", model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    convert_hf_to_mcore(hf, tmp_path / "mcore", parallelism=Parallelism(tp=2))
    code, out, _ = verify(capsys, hf, tmp_path / "mcore", "--tp", "2", "--json", str(tmp_path / "report.json"))
    assert code == 0, out
    assert "note: sliding window of 8 tokens: prompts cut to the window" in out
    result = json.loads((tmp_path / "report.json").read_text())
    assert [p["tokens"] for p in result["prompts"]] == [7, 8, 8, 8]
    assert result["notes"] == ["sliding window of 8 tokens: prompts cut to the window"]


def test_the_verify_lines_a_conversion_prints_run_as_printed(hf_model_factory, tmp_path, capsys):
    """After each conversion the `next:` lines name a verify command; on a box without GPUs, with the
    --device its comment gives, it runs and passes, both ways."""
    import shlex

    def printed_verify(out: str) -> list[str]:
        (line,) = [line for line in out.splitlines() if line.strip().startswith("mconvert verify")]
        command, comment = line.split("#")
        assert comment.strip() == "--device cpu without GPUs"
        args = shlex.split(command)[1:]
        assert args[args.index("--device") + 1] == "cuda"
        args[args.index("--device") + 1] = "cpu"
        return args

    hf, mcore, back = hf_model_factory("qwen3-8b"), tmp_path / "mcore", tmp_path / "back"
    assert main(["hf-to-mcore", "--load-dir", str(hf), "--save-dir", str(mcore), "--tp", "2", "--quiet"]) == 0
    assert main(printed_verify(capsys.readouterr().out)) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")
    assert main(["mcore-to-hf", "--load-dir", str(mcore), "--save-dir", str(back), "--quiet"]) == 0
    assert main(printed_verify(capsys.readouterr().out)) == 0
    assert capsys.readouterr().out.strip().endswith("PASS")
