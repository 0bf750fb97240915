"""What mcore-to-hf loses, said or refused: before a byte is written, the save's side (every stored tensor read or the
optimizer's: check_stored); before the export is put in place, the HF side. The HF tensors the export writes are those transformers' class for the
config.json it writes holds, no fewer and no more (a peer's export that drops a layer's experts or the output layer
without a word is loaded by transformers with a warning and random weights); multi-token prediction layers are
written where the family's HF format has a place for them (DeepSeek-V3's and GLM's layers from num_hidden_layers on,
Qwen3.5's and Qwen3-Next's `mtp.`, Nemotron-H's `mtp.layers.`) and left out, said so, where it has none (a family
table without `mtp` entries: Llama, Qwen3, ... trained with Megatron-LM's --mtp-num-layers).

The HF side runs in a child process (TransformersCheck) started as the export starts, beside its writes, and is
joined before the atomic finish: importing torch and transformers takes seconds, more than a small model's
conversion, and needs only the config.json and the names the plan will write. A refusal leaves nothing in place.
What the class holds (class_verdict: its tensors' names, those it ties, where each written name loads) is kept per
config and transformers version (converters/class_verdicts.py), and the export judged against it (judge): a second
export of a config imports neither torch nor transformers, and is refused where the first would have been.
The class is built on the meta device (no memory, offline) as `mconvert verify` picks it (verify/hf_side.py): the one
config.json's `architectures` names, the transformers class a checkpoint shipping its own code is read as, or, for
an image-text model transformers has no class for (Kimi-K2.5), its language model's class from text_config, under
the language model's prefix. Each written name is taken to the class's own name as transformers' loading takes it
(its conversion mapping: v5 holds experts fused in memory, whichever layout the files have), and then:

- missing: a tensor of the class's state dict no written name loads, except those the class ties to another
  (`all_tied_weights_keys`: a tied lm_head, which transformers does not write either); buffers transformers
  recomputes (rope's inv_freq) are not persistent, so not in the state dict at all;
- extra: a written name that loads into nothing, except the multi-token prediction layers' (the plan's MTP pieces),
  which transformers' classes do not hold (they drop them on load: DeepSeek-V3's `_keys_to_ignore_on_load_unexpected`),
  and what the family copies back beside a class transformers lacks (Kimi-K2.5's vision tower).

A quantized export (--quantize as-source) is checked by the tensors it quantizes: their scales and packed parts are
written for them by the format (converters/quantized_export.py), and the class is built unquantized. Without
transformers, or where it has no class for the config or cannot build it, the check is skipped and the summary says
so: the check's absence is not an error of the export.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from mconvert.converters.class_verdicts import entry_path, read_verdict, verdict_key, write_verdict
from mconvert.converters.mcore_sources import stored_key
from mconvert.converters.plan import Plan
from mconvert.dependencies import importable
from mconvert.errors import ConversionError
from mconvert.mappings import language_model_of, remote_code_architecture

Shape = tuple[int, ...]
# How many names an error or note shows.
SHOWN = 3


def mtp_names(plan: Plan) -> set[str]:
    """The HF tensors of the plan's multi-token prediction layers: their own, their decoder layers' and their copies
    of the embedding and head."""
    return {ref.name for piece in plan.pieces if piece.copy or piece.key.startswith("mtp.") for ref in piece.sources}


def listed(names: list[str]) -> str:
    shown = ", ".join(f"'{name}'" for name in names[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


@contextlib.contextmanager
def quiet(transformers: Any) -> Iterator[None]:
    """transformers' warnings about building a model from a config (no weights yet) held back."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers.logging.set_verbosity(verbosity)


def transformers_model(config: dict[str, Any]) -> tuple[Any, str] | str:
    """(transformers' model of `config` on the meta device, the prefix of its tensors in the checkpoint), or why
    there is none."""
    try:
        import torch
        import transformers
    except ImportError as error:
        return f"{error.name or 'transformers'} is not installed"
    fields = {key: value for key, value in config.items() if key not in ("auto_map", "model_type")}
    prefix, model_type = "", config.get("model_type")
    taken, inside = remote_code_architecture(config), language_model_of(config)
    if inside is not None:
        text = config["text_config"]
        family, architecture, prefix = inside
        fields = {key: value for key, value in text.items() if key not in ("auto_map", "model_type")}
        fields["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        model_type = family.hf_model_type(text)
    elif taken is not None:
        family, architecture = taken
        model_type = family.hf_model_type(config)
    else:
        architecture = (config.get("architectures") or ["?"])[0]
    fields.pop("quantization_config", None)  # built unquantized: the quantized tensors are checked as their weights
    # As transformers reads a config.json: its encoding of inf and NaN (Nemotron-H's time_step_limit) decoded.
    fields = getattr(transformers.PretrainedConfig, "_decode_special_floats", lambda fields: fields)(fields)
    model_class = getattr(transformers, architecture, None)
    if model_class is None:
        return f"transformers {transformers.__version__} has no class {architecture}"
    try:
        with quiet(transformers), torch.device("meta"):
            model = model_class._from_config(transformers.AutoConfig.for_model(model_type, **fields))
    except Exception as error:  # noqa: BLE001 (any failure to build it is the class's, not the export's)
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"transformers {transformers.__version__} cannot build {architecture} from it ({reason})"
    return model, prefix


def loaded_names(model: Any, names: Iterable[str]) -> dict[str, str]:
    """Each checkpoint name, and the name of the model's tensor transformers' loading puts it in (itself where it
    puts it nowhere)."""
    state = model.state_dict()
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
    except ImportError:  # transformers before v5 loads checkpoints by the model's own names
        return {name: name for name in names}
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    loaded = {}
    for name in names:
        renamed, _ = rename_source_key(name, renamings, converters, model.base_model_prefix, state)
        loaded[name] = name if renamed not in state and name in state else renamed
    return loaded


def mtp_layers_stored(shapes: dict[str, Shape]) -> int:
    """The multi-token prediction layers a checkpoint holds (`mtp.layers.<m>.`, GPTModel's and HybridModel's)."""
    return len({key.split(".")[2] for key in shapes if key.startswith("mtp.layers.")})


def check_stored(plan: Plan, shapes: dict[str, Shape], location: str) -> None:
    """Every tensor the plan reads is stored with the shape the model implies (vocabulary rows: at least the
    real vocabulary, padded however the saver padded), and no stored model weight is left unread."""
    for piece in plan.pieces:
        key = stored_key(piece, shapes)
        if key not in shapes:
            raise ConversionError(f"{location}: tensor '{key}' is missing from the checkpoint")
        expected, stored = plan.shapes[piece.key], shapes[key]
        rows = len(piece.offsets)
        if piece.layout.real_rows is not None and len(stored) == len(expected) and stored[rows] >= piece.layout.real_rows:
            expected = (*expected[:rows], stored[rows], *expected[rows + 1 :])
        if tuple(stored) != tuple(expected):
            raise ConversionError(
                f"{location}: tensor '{key}' has shape {list(stored)}, the model's config implies {list(expected)}"
            )
    used = {key for piece in plan.pieces for key in piece.keys}
    if not plan.spec.untie_embeddings:
        # With tied embeddings and PP > 1, the last stage keeps a copy of the embedding as its output layer
        # (legacy checkpoints store it): it is the embedding.
        used.add("output_layer.weight")
    unused = sorted(set(shapes) - used)
    if unused:
        raise ConversionError(
            f"{location}: tensor '{unused[0]}' is not used by the {plan.family.name} mapping "
            f"({len(unused)} such tensors; is the architecture right?)"
        )


def whole_export_notes(plan: Plan, checked: str, mtp_stored: int) -> tuple[str, ...]:
    """What the summary says of the export's tensors, from a save holding `mtp_stored` MTP layers: what they were
    `checked` against (TransformersCheck), and the MTP layers left out."""
    notes = (checked,)
    if mtp_stored and not plan.family.table.mtp:
        notes += (f"left out {mtp_stored} multi-token prediction layer(s) of the save: the {plan.family.name} HF format has no place for them",)
    return notes


def check_request(plan: Plan, config: dict[str, Any], written: Iterable[str]) -> dict[str, Any]:
    """What the check of the export's HF tensors `written` (the plan's and those copied back) needs besides
    transformers, as plain data: the config, the names, those of the MTP layers and those copied back beside a class
    transformers lacks (and what they are), all known from the plan before a byte is written."""
    written = sorted(written)
    inside = language_model_of(config)
    prefix = inside[2] if inside is not None else ""
    beside = [name for name in written if plan.family.table.left_out_by(name) and not name.startswith(prefix)] if prefix else []
    kinds = [what for start, what in plan.family.table.left_out if any(name.startswith(start) for name in beside)]
    mtp = mtp_names(plan)
    return {"config": config, "family": plan.family.name, "written": written, "mtp": [name for name in written if name in mtp],
            "beside": beside, "beside_kinds": kinds}


def own_names(request: dict[str, Any], prefix: str) -> dict[str, str]:
    """The written names the class itself holds (those copied back beside it left out), by their names in the class
    (its prefix in the checkpoint taken off)."""
    beside = set(request["beside"])
    return {name.removeprefix(prefix): name for name in request["written"] if name not in beside}


def class_verdict(request: dict[str, Any]) -> dict[str, Any]:
    """What transformers' class for the request's config holds, as plain data that judge() holds an export against
    without transformers (and class_verdicts keeps): its name, its prefix in the checkpoint, its state dict's names,
    those it ties to another, and the name each of the request's written names loads into; or why it was not built."""
    built = transformers_model(request["config"])
    if isinstance(built, str):
        return {"skipped": built}
    model, prefix = built
    return {"architecture": type(model).__name__, "prefix": prefix, "held": sorted(model.state_dict()),
            "tied": sorted(getattr(model, "all_tied_weights_keys", None) or {}),
            "loads": loaded_names(model, own_names(request, prefix))}


def well_formed(verdict: Any) -> bool:
    """Whether `verdict` (read back from a file) is as class_verdict makes one of a class it built."""
    if not isinstance(verdict, dict):
        return False
    names, loads = [verdict.get(field) for field in ("held", "tied")], verdict.get("loads")
    return (isinstance(verdict.get("architecture"), str) and isinstance(verdict.get("prefix"), str) and isinstance(loads, dict)
            and all(isinstance(each, list) and all(isinstance(name, str) for name in each) for each in names)
            and all(isinstance(into, str) for into in loads.values()))


def knows(verdict: Any, request: dict[str, Any]) -> bool:
    """Whether `verdict` is well formed and knows where each name the request writes loads."""
    return well_formed(verdict) and set(own_names(request, verdict["prefix"])) <= set(verdict["loads"])


def judge(request: dict[str, Any], verdict: dict[str, Any]) -> str:
    """Refuse an export whose HF tensors (check_request) miss a tensor that transformers' class for its config holds
    (its `verdict`), or hold one it does not; the line the summary prints: what was checked, or why not."""
    if "skipped" in verdict:
        return f"not checked against transformers' class: {verdict['skipped']}"
    architecture, family = verdict["architecture"], request["family"]
    own = own_names(request, verdict["prefix"])
    loaded = {name: verdict["loads"][name] for name in own}
    held = set(verdict["held"])
    missing = sorted(held - set(loaded.values()) - set(verdict["tied"]))
    if missing:
        raise ConversionError(
            f"the export would leave out {len(missing)} tensor(s) that transformers' {architecture} holds: {listed(missing)} "
            f"(the {family} mapping writes nothing that loads into them)"
        )
    mtp = set(request["mtp"])
    unheld = [own[name] for name, into in loaded.items() if into not in held]
    extra = [name for name in unheld if name not in mtp]
    if extra:
        raise ConversionError(
            f"the export would write {len(extra)} tensor(s) that transformers' {architecture} does not hold: {listed(extra)}"
        )
    notes = [f"{len(unheld)} of the multi-token prediction layers, which it does not hold"] if unheld else []
    if request["beside"]:
        notes.append(f"{len(request['beside'])} copied back beside it ({' and '.join(request['beside_kinds'])}), which transformers has no class for")
    also = f" (beside them: {'; '.join(notes)})" if notes else ""
    return f"checked against transformers' {architecture}: every tensor it holds is written, and no other{also}"


def imported_versions() -> dict[str, str]:
    """The versions of torch and transformers as imported (those a verdict was made with)."""
    return {name: sys.modules[name].__version__ for name in ("transformers", "torch") if name in sys.modules}


class TransformersCheck:
    """judge() of an export against class_verdict() of its config: the verdict kept for the config from an earlier
    export (class_verdicts), where there is one that knows every written name, without importing torch or
    transformers; else made in a child process (`python -m mconvert.converters.whole_export REQUEST.json`, which
    prints it as one JSON line) started when made, so that torch's and transformers' imports run beside the
    export's writes, and kept; `result()` joins it. Where torch or transformers is not installed, no process is
    started; where the exporting process has both imported already (a library caller, the tests), the verdict is
    made in it, at once: a child would only import them again. Used as a context manager, a child still running on
    exit (the export failed or was interrupted) is killed; it runs in its own session, so that a Ctrl-C reaches the
    export alone."""

    def __init__(self, plan: Plan, config: dict[str, Any], written: Iterable[str]) -> None:
        self.process: subprocess.Popen | None = None
        self.checked: str | None = None
        self.skipped = next((f"{name} is not installed" for name in ("torch", "transformers") if not importable(name)), None)
        if self.skipped is not None:
            return
        self.request = check_request(plan, config, written)
        self.key = verdict_key(config)
        self.kept = read_verdict(self.key)
        if knows(self.kept, self.request):
            self.checked = f"{judge(self.request, self.kept)} (the class's tensors as kept in {entry_path(self.key)})"
            return
        if "torch" in sys.modules and "transformers" in sys.modules:
            self.checked = self.judged(class_verdict(self.request), imported_versions())
            return
        descriptor, request = tempfile.mkstemp(prefix="mconvert-check-", suffix=".json")
        self.request_file = Path(request)
        with os.fdopen(descriptor, "w") as f:
            json.dump(self.request, f)
        package_root = str(Path(__file__).resolve().parents[2])  # the child imports this mconvert, however started
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.request_file)], env=env, start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

    def __enter__(self) -> "TransformersCheck":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process is not None:
            self.request_file.unlink(missing_ok=True)

    def judged(self, verdict: dict[str, Any], versions: dict[str, str]) -> str:
        """judge() with a verdict just made, kept first where it was made with the versions its key names (with the
        names of the verdict kept before, which it did not know every written name of). Why a class was not built
        is not kept: it may be this environment's (a package its module needs), not the config's."""
        if self.key is not None and "skipped" not in verdict and versions == {name: self.key[name] for name in ("transformers", "torch")}:
            if well_formed(self.kept):
                verdict["loads"] = {**self.kept["loads"], **verdict["loads"]}
            write_verdict(self.key, verdict)
        return judge(self.request, verdict)

    def result(self) -> str:
        """The summary's line of what the export was checked against; a refusal raised as the export's error."""
        if self.checked is not None:
            return self.checked
        if self.process is None:
            return f"not checked against transformers' class: {self.skipped}"
        out, err = self.process.communicate()
        self.request_file.unlink(missing_ok=True)
        lines = out.strip().splitlines()
        outcome = json.loads(lines[-1]) if self.process.returncode == 0 and lines else None
        if outcome is None:
            said = (err.strip().splitlines() or [f"exit code {self.process.returncode}"])[-1]
            raise ConversionError(f"the check against transformers' class failed in its process ({said})")
        return self.judged(outcome["verdict"], outcome["versions"])


if __name__ == "__main__":
    verdict = class_verdict(json.loads(Path(sys.argv[1]).read_text()))
    print(json.dumps({"verdict": verdict, "versions": imported_versions()}))
