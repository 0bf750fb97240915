"""`mconvert adapter-to-hf`: a LoRA, CanonicalLoRA or DoRA adapter that Megatron-Bridge saved, or a LoRA adapter
that ms-swift's Megatron training saved, as an HF PEFT adapter."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_adapter_to_hf(commands: argparse._SubParsersAction) -> None:
    to_peft = commands.add_parser("adapter-to-hf", help="Megatron-Bridge LoRA, CanonicalLoRA or DoRA, or ms-swift LoRA adapter save (torch_dist) -> HF PEFT adapter")
    to_peft.add_argument("--load-dir", required=True, help="the adapter-only checkpoint directory (with latest_checkpointed_iteration.txt; ms-swift's checkpoint-N with args.json, or the run's output folder holding them)")
    to_peft.add_argument("--save-dir", required=True, help="where to write adapter_config.json and adapter_model.safetensors")
    to_peft.add_argument("--iteration", type=int, default=None, help="the iter_NNNNNNN (ms-swift: checkpoint-N) to convert (default: the tracker file's; ms-swift: the newest)")
    to_peft.add_argument(
        "--hf-config", default=None, metavar="BASE_DIR",
        help="the HF base model the adapter was trained on (directory or hub id; default: the one the save's record names, ms-swift's args.json or Megatron-Bridge's run_config.yaml)",
    )
    to_peft.add_argument("--revision", default=None, help="branch, tag or commit of a --hf-config hub id")
    to_peft.add_argument("--overwrite", action="store_true", help="replace --save-dir if it exists")
    to_peft.set_defaults(run=_adapter_to_hf)


def _adapter_to_hf(options: argparse.Namespace) -> int:
    from mconvert.converters.adapters import export_adapter
    from mconvert.hub import resolve_hf_dir

    if options.hf_config is None:  # the save's own record of its base
        from mconvert.converters.adapters import recorded_base
        from mconvert.converters.save_folders import hf_folder

        options.hf_config, where = recorded_base(Path(options.load_dir), options.iteration)
        base = hf_folder(options.hf_config, where)
    else:
        base = resolve_hf_dir(options.hf_config, "--hf-config", weights=False, revision=options.revision)
    hub_id = None if Path(options.hf_config).exists() else options.hf_config
    result = export_adapter(
        options.load_dir, options.save_dir, base, iteration=options.iteration, overwrite=options.overwrite, base_name=hub_id
    )
    settings = result.settings
    print(
        f"wrote {options.save_dir}: a PEFT {'DoRA' if settings.kind == 'dora' else 'LoRA'} adapter of {len(result.modules)} {result.family.name} modules"
        f"{f' and {len(result.params)} expert parameters' if result.params else ''} "
        f"(r={settings.dim}, lora_alpha={settings.alpha:g}{', use_rslora' if settings.rslora else ''}, scale {settings.scale:g}), {result.tensors} tensors"
    )
    print("next:")
    print(f"  peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({str(options.hf_config)!r}), {str(Path(options.save_dir))!r})")
    return 0
