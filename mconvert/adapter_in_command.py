"""`mconvert adapter-to-mcore`: an HF PEFT LoRA adapter as a Megatron-Bridge adapter-only checkpoint or an ms-swift
adapter save; and the registration of both adapter commands."""

from __future__ import annotations

import argparse
from pathlib import Path

from mconvert.adapter_command import add_adapter_to_hf


def add_adapter_commands(commands: argparse._SubParsersAction) -> None:
    add_adapter_to_hf(commands)
    to_mcore = commands.add_parser("adapter-to-mcore", help="HF PEFT LoRA adapter -> Megatron-Bridge adapter-only checkpoint or ms-swift adapter save (torch_dist)")
    to_mcore.add_argument("--adapter", required=True, metavar="ADAPTER_DIR", help="the PEFT adapter (adapter_config.json, adapter_model.safetensors)")
    to_mcore.add_argument("--save-dir", required=True, help="where to write the checkpoint (megatron-bridge: release/ with run_config.yaml; ms-swift: iter_0000001/ and args.json; and the tracker file)")
    to_mcore.add_argument("--hf-config", required=True, metavar="BASE_DIR", help="the HF base model the adapter is of (directory or hub id)")
    to_mcore.add_argument("--revision", default=None, help="branch, tag or commit of a --hf-config hub id")
    to_mcore.add_argument("--layout", choices=("megatron-bridge", "ms-swift"), default="megatron-bridge", help="whose adapter save to write (default: megatron-bridge)")
    to_mcore.add_argument(
        "--tp", type=int, default=1,
        help="the tensor-parallel size the save records (megatron-bridge: any TP loads it; ms-swift: linear_fc1's lora_B rows are laid out for this TP, which the run must use)",
    )
    to_mcore.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists")
    to_mcore.set_defaults(run=_adapter_to_mcore)


def _adapter_to_mcore(options: argparse.Namespace) -> int:
    from mconvert.converters.adapters_in import import_adapter
    from mconvert.hub import resolve_hf_dir

    base = resolve_hf_dir(options.hf_config, "--hf-config", weights=False, revision=options.revision)
    hub_id = None if Path(options.hf_config).exists() else options.hf_config
    result = import_adapter(options.adapter, options.save_dir, base, tp=options.tp, overwrite=options.overwrite, layout=options.layout, base_name=hub_id)
    settings = result.settings
    if options.layout == "ms-swift":
        print(
            f"wrote {options.save_dir}: an ms-swift LoRA adapter save of a {result.family.name} model on {', '.join(result.targets)} "
            f"(lora_rank={settings.dim}, lora_alpha={settings.alpha:g}{', use_rslora' if settings.rslora else ''}, scale {settings.scale:g}) "
            f"at TP {options.tp}, {len(result.keys)} keys"
        )
        print(
            f"next: megatron sft --model {options.hf_config} --mcore_adapter {options.save_dir} --tensor_model_parallel_size {options.tp} "
            f"--tuner_type lora --target_modules {' '.join(result.targets)} --lora_rank {settings.dim} --lora_alpha {settings.alpha:g}"
            f"{' --use_rslora true' if settings.rslora else ''} ..."
        )
        return 0
    print(
        f"wrote {options.save_dir}: a Megatron-Bridge LoRA adapter of a {result.family.name} model on "
        f"{', '.join(result.targets)} (dim={settings.dim}, alpha={settings.alpha:g}, scale {settings.scale:g}), {len(result.keys)} keys"
    )
    print("next: Megatron-Bridge's LoRA with the run_config.yaml peft: settings, and checkpoint.load set to this directory")
    return 0
