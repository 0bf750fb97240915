"""On the GPU machine's gated delta-net stages only (scripts/gpu/gpu_session.sh puts this folder first on
PYTHONPATH): every Triton autotuner that flash-linear-attention makes keeps one of its configs, the one of fewest
stages, warps and smallest blocks, so that Triton compiles and runs that one instead of compiling and timing each
(about 75 configs a pass, each a compile, on a machine that keeps no cache between sessions). Any config computes
the same function; only the kernels' speed differs."""

from triton.runtime import autotuner


def _smallest(config) -> tuple:
    return (config.num_stages or 0, config.num_warps or 0, sum(v for v in config.kwargs.values() if isinstance(v, int)))


_init = autotuner.Autotuner.__init__


def _init_with_one_config(self, fn, arg_names, configs, *args, **kwargs):
    module = getattr(getattr(fn, "fn", fn), "__module__", "") or ""
    if module.startswith("fla.") and len(configs) > 1:
        configs = [min(configs, key=_smallest)]
    _init(self, fn, arg_names, configs, *args, **kwargs)


autotuner.Autotuner.__init__ = _init_with_one_config
