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

# What the old build_plan and tensor_layout gave (commit 7846cda), with the plans of the configs shipped since.
DIGEST = "bea5bf1073c7da16521262d89fa629c2c76aefb60d99f8c55439e2cca975a74b"

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


def plan_lines() -> list[str]:
    lines = []
    for label, family, spec in specs():
        everything = frozenset(range(spec.num_layers + spec.mtp_layers))
        for layout, parallelism in LAYOUTS.items():
            for fused in (None, everything, frozenset()) if spec.moe is not None else (None,):
                lines.append(f"== {label} {family.name} {layout} fused={sorted(fused) if fused is not None else None}")
                try:
                    plan = build_plan(family, spec, parallelism, fused_expert_layers=fused)
                except ConversionError as e:
                    lines.append(f"refused: {e}")
                    continue
                lines.append(f"dtype {plan.dtype}")
                for piece in plan.pieces:
                    entry, layout_ = piece.entry, piece.layout
                    lines.append(
                        f"{piece.keys} {piece.offsets} {layout_.shape} {layout_.split_axis} {layout_.fragments} "
                        f"{layout_.real_rows} {layout_.dtype} {type(entry).__name__} {entry.mcore} {entry.hf_names} "
                        f"{[(ref.name, ref.index) for ref in piece.sources]} {piece.copy}"
                    )
                lines += [f"shape {key} {shape}" for key, shape in plan.shapes.items()]
                lines += [f"extra {key}" for key in plan.extra_state_keys]
                lines += [f"hf {name} {shape}" for name, shape in plan.hf_shapes().items()]
                lines.append(f"groups {plan.hf_groups()}")
    return lines


def test_every_family_and_layout_plans_as_before():
    lines = plan_lines()
    assert len(lines) > 10_000
    assert hashlib.sha256("\n".join(lines).encode()).hexdigest() == DIGEST


if __name__ == "__main__":
    sys.stdout.write("\n".join(plan_lines()) + "\n")
