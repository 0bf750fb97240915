"""The Setting: one Megatron-LM arg of a converted model, what mconvert.megatron_lm.settings declares a row of."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from mconvert.errors import ConversionError
from mconvert.mappings.spec import ModelSpec
from mconvert.mcore.parallelism import Parallelism


@dataclass(frozen=True)
class Target:
    """What a conversion writes beside the model: its parallel layout, the weights' dtype, the layer implementation
    Megatron-LM is told to use, and the HF directory whose tokenizer files it names (None without them)."""

    par: Parallelism
    dtype: np.dtype
    transformer_impl: str
    tokenizer: Path | None = None


Getter = Callable[[str], Any]


@dataclass(frozen=True)
class Setting:
    """One Megatron-LM arg.

    Written from the ModelSpec field `spec` names (a dotted path into its sub-specs: "moe.top_k"), through `encode`
    where the arg's form differs; read back through `read` (given the stored args, defaults filled in) where it
    needs more than the arg itself. Args no one spec field holds are written by `value` and not read back.
    `feature`: the features whose models have the arg (their args hold it, its flag is printed); empty for all.
    `flag` "" is "--" + the arg with dashes; None: Megatron-LM has no flag for it. `kind`: "value", "switch"
    (store_true), "negated" (a store_false flag: --disable-bias-linear sets add_bias_linear False), "boolean"
    (--x and --no-x), "words" (one flag, several words). `show`: when the flag is printed: "changed" (its value
    differs from the parser's default), "always" (whenever the model has it), or a test of the args (as `get` reads them).
    `config`: the TransformerConfig field ("" the arg's own name, as Megatron-LM copies args into the config;
    None where megatron-core takes it otherwise). `stored_as`: the arg's name in Megatron-LM before 0.19, written
    too and read as well. `run`: a setting of the run (layout, dtype, tokenizer) rather than of the model.
    `accepts`: the values mconvert reads back (a family has them); others are an error."""

    arg: str
    default: Any = None
    spec: str | None = None
    encode: Callable[[Any], Any] | None = None
    read: Callable[[Getter], Any] | None = None
    value: Callable[[ModelSpec, Target], Any] | None = None
    feature: tuple[str, ...] = ()
    flag: str | None = ""
    kind: str = "value"
    show: str | Callable[[Getter], bool] = "changed"
    config: str | None = ""
    stored_as: str | None = None
    run: bool = False
    accepts: tuple[Any, ...] | None = None

    @property
    def flag_name(self) -> str | None:
        return "--" + self.arg.replace("_", "-") if self.flag == "" else self.flag

    @property
    def config_field(self) -> str | None:
        return self.arg if self.config == "" else self.config

    def write(self, spec: ModelSpec, target: Target) -> Any:
        if self.value is not None:
            return self.value(spec, target)
        value = spec_field(spec, self.spec)
        return self.encode(value) if self.encode is not None else value

    def flag_text(self, value: Any) -> str:
        """The flag with `value` as Megatron-LM's parser takes it."""
        if self.kind in ("switch", "negated"):
            return self.flag_name
        if self.kind == "boolean":
            return self.flag_name if value else "--no-" + self.flag_name[2:]
        if self.kind == "words":
            return " ".join([self.flag_name, *value])
        if isinstance(value, list):
            return f"{self.flag_name} '" + str(value).replace(" ", "") + "'"
        if isinstance(value, tuple):
            return f"{self.flag_name} " + ",".join(map(str, value))
        if isinstance(value, float):
            # Short where that is exact; else every digit, so that the parser reads back the same float.
            return f"{self.flag_name} {value:g}" if float(f"{value:g}") == value else f"{self.flag_name} {value!r}"
        return f"{self.flag_name} {shlex.quote(str(value))}"

    def shown(self, value: Any, get: Getter) -> bool:
        if callable(self.show):
            return self.show(get)
        if self.show == "always":
            return value is not None and (self.kind not in ("switch", "negated") or value != self.default)
        if self.kind == "boolean":
            return value is not None
        return value != self.default


def spec_field(spec: Any, path: str) -> Any:
    """The field at a dotted path of a ModelSpec; None where a sub-spec on the way is (a dense model's experts)."""
    for name in path.split("."):
        spec = getattr(spec, name) if spec is not None else None
    return spec


def integral(value: float, flag: str, field: str) -> int:
    """`value` as the int Megatron-LM's parser declares `flag` to be; a fraction would be rounded there, so it is an
    error here."""
    if value != int(value):
        raise ConversionError(f"{field} {value:g}: Megatron-LM's {flag} takes only integers, so this model cannot be described")
    return int(value)
