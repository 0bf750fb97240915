"""The settings table (mconvert.megatron_lm.settings) held to Megatron-LM itself (Python 3.12 environment): every row's
flag, kind and default are its parser's, and the TransformerConfig that verify derives from a conversion's stored
args is, field for field, the one Megatron-LM derives from the printed flags (core_transformer_config_from_args)."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shlex

import pytest

if os.environ.get("MCONVERT_REQUIRE_MEGATRON_LM") != "1":
    pytest.importorskip("megatron.training", reason="Megatron-LM's training package: the Python 3.12 environment")

import torch  # noqa: E402
from test_megatron_lm import MODELS, world_size  # noqa: E402

from mconvert.mappings import get_mapping  # noqa: E402
from mconvert.megatron_lm.args import megatron_args  # noqa: E402
from mconvert.megatron_lm.flags import megatron_flags, settings_without_flags, unnormalized_mla_query  # noqa: E402
from mconvert.megatron_lm.settings import SETTINGS  # noqa: E402
from mconvert.synthetic import real_config, shrink  # noqa: E402
from mconvert.verify.distributed import ParallelLayout  # noqa: E402
from mconvert.verify.megatron_lm import CPU_FLAGS, RUN_FLAGS, parse_megatron_lm_args  # noqa: E402
from mconvert.verify.megatron_model import transformer_config_from_args, yarn_settings  # noqa: E402

ACTIONS = {"value": "_StoreAction", "words": "_StoreAction", "switch": "_StoreTrueAction", "negated": "_StoreFalseAction",
           "boolean": "_StoreTrueAction"}


def megatron_lm_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    return add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))


def test_every_flag_is_megatron_lms():
    """Each row's flag sets the row's arg in Megatron-LM's parser, by the kind of action the row says, from the
    default the row says; a boolean row's --no- form clears it."""
    parser = megatron_lm_parser()
    defaults = parser.parse_args([])
    wrong = []
    for setting in SETTINGS:
        if setting.flag is None:
            continue
        action = parser._option_string_actions.get(setting.flag_name)
        if action is None or action.dest != setting.arg or type(action).__name__ != ACTIONS[setting.kind]:
            wrong.append((setting.arg, setting.flag_name, action and (action.dest, type(action).__name__)))
        elif getattr(defaults, setting.arg) != setting.default:
            wrong.append((setting.arg, "default", getattr(defaults, setting.arg), setting.default))
        elif setting.kind == "words" and action.nargs not in ("*", "+"):
            wrong.append((setting.arg, "nargs", action.nargs))
        elif setting.kind == "boolean":
            negative = parser._option_string_actions.get("--no-" + setting.flag_name[2:])
            if negative is None or negative.dest != setting.arg or type(negative).__name__ != "_StoreFalseAction":
                wrong.append((setting.arg, "no boolean --no- form"))
    assert not wrong, wrong


def test_the_rows_without_a_flag_are_args_megatron_lm_keeps():
    """A row without a printed flag is still an arg Megatron-LM's parser has (or its validation sets, as
    params_dtype and padded_vocab_size), or a field of the config it copies args into (MLA's YaRN fields)."""
    from megatron.core.transformer import MLATransformerConfig

    dests = {action.dest for action in megatron_lm_parser()._actions}
    derived = {"params_dtype", "padded_vocab_size", "virtual_pipeline_model_parallel_size"}
    fields = set(MLATransformerConfig.__dataclass_fields__)
    missing = [s.arg for s in SETTINGS if s.flag is None and s.arg not in dests | derived | fields]
    assert not missing


def printed_argv(args: argparse.Namespace) -> list[str]:
    """MODEL_ARGS as bash gives them to Megatron-LM, and a CPU run's flags."""
    return shlex.split(" ".join(megatron_flags(args))) + RUN_FLAGS + CPU_FLAGS


# TransformerConfig's fields of the run, not the model: dtypes, initialization, the attention backend and layer
# implementation (verify's CPU ranks run the local spec, the printed flags name Transformer Engine), fusions,
# communication and sharding, the sampling seed.
RUN_FIELDS = {
    "params_dtype", "pipeline_dtype", "autocast_dtype", "bf16", "fp16", "attention_softmax_in_fp32", "perform_initialization",
    "attention_backend", "transformer_impl", "moe_grouped_gemm", "bias_activation_fusion", "deallocate_pipeline_outputs",
    "cp_comm_type", "overlap_p2p_comm", "batch_p2p_comm", "tensor_parallel_num_weight_shards",
    "expert_tensor_parallel_num_weight_shards", "inference_sampling_seed",
    "deterministic_mode",  # verify runs gated delta-net's PyTorch rule, which a run asks for by --deterministic-mode
}


def comparable(config: object) -> dict:
    """Every field of a TransformerConfig (the activation by its name; YaRN's attributes where it has them), but
    those of the run."""
    values = {name: plain(value) for name, value in vars(config).items() if name not in RUN_FIELDS}
    values["class"] = type(config).__name__
    return values


def plain(value: object) -> object:
    """A config's value as something that compares by what it is: functions by name, partials by their parts."""
    if isinstance(value, functools.partial):
        return plain(value.func), value.args, sorted(value.keywords.items())
    return getattr(value, "__qualname__", value) if callable(value) else value


def test_verify_builds_the_config_megatron_lm_builds_from_the_printed_flags():
    """For every model the Megatron-LM tests convert: the stored args through verify's derivation, and the printed
    flags through Megatron-LM's parser, validation and core_transformer_config_from_args, give the same model
    fields (the run's parallel sizes, dtype, fusions and dropout aside), once the settings Megatron-LM's flags cannot
    set are set as megatron_args.sh says."""
    from megatron.training.arguments import core_transformer_config_from_args

    differing = {}
    for name, (config_name, layers, overrides, parallelism) in MODELS.items():
        if overrides.get("mtp"):
            continue  # the checkpoint's MTP layers, not a setting
        _, spec = get_mapping(shrink(real_config(config_name), layers=layers, **overrides))
        args = megatron_args(spec, parallelism, torch.bfloat16, "transformer_engine")
        if unnormalized_mla_query(args):
            continue  # megatron-core 0.19 builds another model (test_megatron_lm.py: verify refuses it)
        parsed = parse_megatron_lm_args(printed_argv(args), world_size(parallelism))
        for line in settings_without_flags(args):  # what megatron_args.sh says to set beside the flags
            for field, value in re.findall(r"args\.(\w+) = ([0-9.e+-]+)", line):
                setattr(parsed, field, float(value))
        theirs = comparable(core_transformer_config_from_args(parsed))
        layout = ParallelLayout(parallelism.tp, parallelism.pp, parallelism.ep, parallelism.etp)
        config = transformer_config_from_args(args, torch.float32, "local", perform_initialization=False, layout=layout)
        yarn_settings(config, args)
        ours = comparable(config)
        differing[name] = {field: (ours.get(field), theirs.get(field)) for field in ours.keys() | theirs.keys()
                           if ours.get(field) != theirs.get(field)}
    assert not {name: fields for name, fields in differing.items() if fields}
