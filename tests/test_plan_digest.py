"""The plan of every family, in the layouts the tests convert, held to a digest of what it was: every piece's keys,
offsets, shape, split, dtype, entry and HF sources in order, every key's global shape, the `_extra_state` keys, the
HF shapes and file groups, and the refusals. A change of how the plan is built that changes none of these keeps the
digest; one that changes any breaks it, and `python tests/test_plan_digest.py` prints the lines to compare."""

from __future__ import annotations

import dataclasses
import hashlib
import sys

from mconvert.converters.plan import build_plan
from mconvert.errors import ConversionError
from mconvert.mappings import get_mapping
from mconvert.mcore.parallelism import Parallelism
from mconvert.synthetic import CONFIGS, real_config, shrink

# Each config's plan lines (its label's, in every layout) as the old build_plan and tensor_layout gave them (commit
# 7846cda), and of each config shipped since as it was added: a family added is a line here, and a change of how the
# plan is built that changes no line keeps every digest. `python tests/test_plan_digest.py LABEL` prints the lines.
DIGESTS = {
    "deepseek-v2-lite": "10ac4cb268a9a722f26e3f6e1854b680318bab10d64263f80408d232f9b7500b",
    "deepseek-v2-lite+mtp": "802ec927b282d7c2f1142a4a8e13cf6363ee1e4e83c3af3eb25865d59048f966",
    "deepseek-v3": "abe1af44bc5202be265b80ab6b2ae7962316fb492070ae4db54487938666b5f1",
    "deepseek-v3+mtp": "0da054c46bca685ca9893fba1010a812b71c31ea999a53597525181b01f9db06",
    "deepseek-v3.2": "528071bb066728a5c79abcfa6117e0c8ab9672cb347c886c1941acc626d0d593",
    "dots.llm1.inst": "5eaeca789ba4924c5820330484b2d89dafe87519fbef4930f6c636191bea4d06",
    "dots.llm1.inst+mtp": "d77b9e81dd848db270efa4c93e0e3daaab7936f0edd48a9b108905082da231c3",
    "ernie-4.5-0.3b-pt": "987348f658745b7f59932cb654e0a5b5e5af9fd4e908d135198d5617f42741d8",
    "glm-4.5-air": "6d0f7c78a7818a7cea207b229447ebaa718ebf19bfb300b4be7491a7cd20bdaa",
    "glm-4.5-air+mtp": "7377e3c66d9120799c07d6047923f1d7c62d82ee262f4f0401352b9ce567c514",
    "glm-4.7-flash": "87c94a44c8a4cc729452dfb1a6e80f5e2ab26163860f7726d64f023f6cf98dd3",
    "glm-4.7-flash+mtp": "6088afeb84a8a29de1b289ef1f0badc7b849c6f19aebc6ef357f716418bb2be8",
    "glm-5.1": "6d5c4de115df79d4c0784944b159066a8bf26cce6e0959475699b8e167966a9f",
    "gpt-oss-20b": "01c4106464d6c4c8fb544aff819a74ef104254247dee030da58ffae9f4ba6223",
    "hy3-preview": "2d4bb0ee770a013202a09d1eed6253b56cd18bd0fdb23d75817453439547bbfa",
    "hy3-preview+mtp": "ca1f77f39c9b5ea8f6966cfc8650ff49eac7ab832ad1d84fa1ec9ee530969658",
    "kimi-k2-instruct": "458681f1b5b65bee4f433c56e78524820047bc12bf2211b38d797cb6db52fb93",
    "kimi-k2-instruct+mtp": "b4ffa06a3aa851e19841f6ab8870ad30b4f39f79ec5d20b90ff68f243822199f",
    "kimi-k2.5": "0a50b9f983ce19bd1177984ad51a8afaf1408af3be52b1884b444ee13a89885b",
    "kimi-k2.5+mtp": "e32a43b482449e38f20062154bf839beb5489349f58adc1d0d715a2dea773691",
    "llama-2-7b": "7aceaaef0d17918000cebeb93ee331d2f0be06803eaba97c120a55dfac139c3d",
    "llama-3.1-8b": "5a93f9f860008de8ca2eef112cf6db35506f0443ba5a3e2216962383f6fa76fe",
    "minimax-m2.7": "97071d24c54e7df393811b3960e1ffed16ea08df3964619a537f10e491d43df6",
    "mixtral-8x7b-v0.1": "447cabf0c425378f7f5d33f912f105a2a27bd75f14ffdacaadd6c0fa3dd167c4",
    "nemotron-3-nano-30b-a3b": "2353c643480cdea8aedefd5cc2f9b00c6ae1bd8e6692f7e37bd7750759b14a01",
    "nemotron-3-nano-30b-a3b+mtp": "3c1a23aa02e0d06d91d2d94693676a00faa345a906d7dbf24bf57545c69911e5",
    "nemotron-3-super-120b-a12b": "ce4c44d500291a1c06a18a2a3282151f59c7ca980b00bebff0d2fe265c975fbe",
    "nemotron-3-super-120b-a12b+mtp": "ddb1df4f8dd510bb2058fb5165e79020801b7294c0ec59218e075218a990d6ae",
    "olmo-2-1124-7b-instruct": "54e69e55b67c8620f1539cb93d6ff92278ca70d6bb98dc3d2cc43299704d01f2",
    "olmoe-1b-7b-0924": "0c614d76a64f112650c4abc4166c094eb6d7a8c74f12960d26bb8396ab585679",
    "qwen1.5-moe-a2.7b": "41247dc25fbbfc693a36c836454973340c65f40ef1a676aef6a077e122ef0d69",
    "qwen2.5-0.5b": "6e159c5b988e9399fb194620df40c72352613f1dff5e8c44b34fa47321df9d61",
    "qwen2.5-7b-instruct": "62587878201af5dd4851940ed41ada1c066313da862141b93744d68b43e0faf5",
    "qwen3-235b-a22b": "5863254efe694798fa532bf73965092994a2fd267cb9355e59341a7c83905eff",
    "qwen3-30b-a3b": "ba8f11288d045b2d9e8635984172283734e438f6c5f9959e25edec8c6ad2d074",
    "qwen3-8b": "539712a110d13ef270d020d113788b0802b33d90a77a6e89865b5e73d2c4ae4e",
    "qwen3-next-80b-a3b-instruct": "d4b26cbe6e89e1b4ad28631ae587ba765f9f15675e06b3a1e14ffe9832541a63",
    "qwen3.5-0.8b": "dea73534beae56b6905ce892ddcc2d16f5a4f562001a7340cef9c29f4b6221fb",
    "qwen3.5-35b-a3b": "67161939ef0f97365b8cb94f3d9909ae844e15d138a838d5461f9cc7fccb3eb5",
    "qwen3-30b-a3b+dense": "256201293b021d0e01be803336cadecb9c22f4419e1230d2e01773c643a6bf88",
    "qwen1.5-moe-a2.7b+dense": "c2b5f8d15ae74df30528130a9c87fff647ba65aa13075b1a37b7d45a98c512ca",
    "nemotron+blocks": "94e32f4a4fc4c010b514f9f630c07dfd91f368cf9133bd687b68ece4694c2bff",
    "nemotron+blocks+mtp": "9605210a4565bd3f96222666add212c529a68320abbc17a8ce54c576f22168c2",
    "qwen2.5-0.5b+window": "9b63fd8cdb241573111b52a250de0585ab1ef9e5aecddf59a0eef5b2df5f7fac",
    "deepseek-v2-lite+dense": "6b49c4e35999c98c6a4abcfd2b421f9986db62cbdd80b7711ded8d8a3658e539",
    "deepseek-v2-lite+dense+mtp": "2a3258052cb4fa77be8cff42fa6aac52b56afd392b40ef6eb695eb3324ec2832",
    "glm-5.1+shared": "47022fcecc96bf4c5757556f3c7b9035bed9c25b51b7de03dc164d1229f2bc86",
    "glm-4.7-flash+layer-types": "f5ef213ba02d4bd1f3e19e2496ea9acfb11e126410f2c265207e09bd3a845ae5",
    "glm-4.7-flash+layer-types+mtp": "c3469334ad6eadbb9792e94f77f76fa0b7c4c56b6ba4b9810cc0b0545a93ad48",
    "olmo-2+olmo3": "f9dd15e8ba417f8e894c8a8dbbb4e9af2d07d6285e16ab4f1b137a1c4d2d0ddb",
    "gemma-3-1b-pt": "6bed2a18103522317bfe30188621b1431076d512095faf9de9f0780b3e8d0e47",
    "gemma-3-4b-it": "25e3dd025dd402b9a53fb500771f402d04cc667540b5890b8c544ca85a32572f",
    "qwen3-vl-8b-instruct": "80b19992219d27c23f3c91805ad0d834e5e50db755619e24eecb89b60b1f9db0",
}

# Configs beside every shipped one at 4 layers: layers mixed dense and MoE, a pattern with each Nemotron-H block, a
# window, layers that share the indexer's top-k.
VARIANTS = {
    "qwen3-30b-a3b+dense": ("qwen3-30b-a3b", {"mlp_only_layers": [0, 3]}),
    "qwen1.5-moe-a2.7b+dense": ("qwen1.5-moe-a2.7b", {"decoder_sparse_step": 2}),
    "nemotron+blocks": ("nemotron-3-nano-30b-a3b", {"hybrid_override_pattern": "M*-E"}),
    "qwen2.5-0.5b+window": ("qwen2.5-0.5b", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    "deepseek-v2-lite+dense": ("deepseek-v2-lite", {"first_k_dense_replace": 2}),
    "glm-5.1+shared": ("glm-5.1", {"indexer_types": ["full", "shared", "full", "shared"]}),
    "glm-4.7-flash+layer-types": ("glm-4.7-flash", {"mlp_layer_types": ["sparse", "dense", "sparse", "dense"]}),
    "olmo-2+olmo3": ("olmo-2-1124-7b-instruct", {"model_type": "olmo3", "sliding_window": 8, "num_key_value_heads": 2}),
}

LAYOUTS = {
    "tp1": Parallelism(),
    "tp2": Parallelism(tp=2, make_vocab_size_divisible_by=64),
    "tp2-ep2-etp1": Parallelism(tp=2, ep=2, etp=1),
    "tp4-ep4": Parallelism(tp=4, ep=4),
    "hybrid-tp2": Parallelism(tp=2, model_class="hybrid"),
}


def specs():
    configs = {name: (name, {}) for name in CONFIGS} | VARIANTS
    for label, (name, overrides) in configs.items():
        config = shrink(real_config(name), layers=4, **overrides)
        family, spec = get_mapping(config)
        yield label, family, spec
        if family.table.mtp and not family.table.mtp_left_out:
            yield label + "+mtp", family, dataclasses.replace(spec, mtp_layers=1)


def plan_lines(only: str | None = None) -> dict[str, list[str]]:
    """Each label's plan lines (`only`: that label's alone)."""
    lines: dict[str, list[str]] = {}
    for label, family, spec in specs():
        if only is not None and label != only:
            continue
        block = lines[label] = []
        everything = frozenset(range(spec.num_layers + spec.mtp_layers))
        for layout, parallelism in LAYOUTS.items():
            for fused in (None, everything, frozenset()) if spec.moe is not None else (None,):
                block.append(f"== {label} {family.name} {layout} fused={sorted(fused) if fused is not None else None}")
                try:
                    plan = build_plan(family, spec, parallelism, fused_expert_layers=fused)
                except ConversionError as e:
                    block.append(f"refused: {e}")
                    continue
                block.append(f"dtype {plan.dtype}")
                for piece in plan.pieces:
                    entry, layout_ = piece.entry, piece.layout
                    block.append(
                        f"{piece.keys} {piece.offsets} {layout_.shape} {layout_.split_axis} {layout_.fragments} "
                        f"{layout_.real_rows} {layout_.dtype} {type(entry).__name__} {entry.mcore} {entry.hf_names} "
                        f"{[(ref.name, ref.index) for ref in piece.sources]} {piece.copy}"
                    )
                block += [f"shape {key} {shape}" for key, shape in plan.shapes.items()]
                block += [f"extra {key}" for key in plan.extra_state_keys]
                block += [f"hf {name} {shape}" for name, shape in plan.hf_shapes().items()]
                block.append(f"groups {plan.hf_groups()}")
    return lines


def digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_every_family_and_layout_plans_as_before():
    lines = plan_lines()
    assert sum(map(len, lines.values())) > 10_000
    digests = {label: digest(block) for label, block in lines.items()}
    changed = sorted(label for label in digests.keys() & DIGESTS.keys() if digests[label] != DIGESTS[label])
    assert not changed, f"plans changed: {changed}"
    assert digests.keys() == DIGESTS.keys(), f"configs without a digest: {sorted(digests.keys() - DIGESTS.keys())}"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.stdout.write("\n".join(plan_lines(sys.argv[1])[sys.argv[1]]) + "\n")
    else:
        sys.stdout.write("".join(f'    "{label}": "{digest(lines)}",\n' for label, lines in plan_lines().items()))
