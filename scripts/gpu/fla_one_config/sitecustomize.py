"""On the GPU machine's gated delta-net stages and the GPU tests' Megatron runs only (scripts/gpu/gpu_session.sh and
tests/gpu/gpu_evidence.py put this folder first on PYTHONPATH): every Triton autotuner that flash-linear-attention or
mamba_ssm makes keeps one of its configs, the one of fewest stages, warps and smallest blocks, so that Triton compiles
and runs that one instead of compiling and timing each (about 75 configs a pass for fla's, about 200 in mamba_ssm's
kernels, each a compile, on a machine that keeps no cache between sessions; a Nemotron-H training run took 198 s at
lr 0 with them all). Any config computes the same function; only the kernels' speed differs."""

from triton.runtime import autotuner


def _blocks(config) -> int:
    return sum(v for v in config.kwargs.values() if isinstance(v, int))


def _smallest(config) -> tuple:
    return (config.num_stages or 0, config.num_warps or 0, _blocks(config))


def _least_memory(config) -> tuple:
    """mamba_ssm's: smallest blocks first. Its lists hold 128 x 256 x 64 blocks at 3 stages, fewer stages than its
    small blocks have, whose fp32 operands would not fit a GPU's shared memory."""
    return (_blocks(config), config.num_stages or 0, config.num_warps or 0)


_init = autotuner.Autotuner.__init__


def _init_with_one_config(self, fn, arg_names, configs, *args, **kwargs):
    module = getattr(getattr(fn, "fn", fn), "__module__", "") or ""
    if module.startswith("fla.") and len(configs) > 1:
        configs = [min(configs, key=_smallest)]
    elif module.startswith("mamba_ssm.") and len(configs) > 1:
        configs = [min(configs, key=_least_memory)]
    _init(self, fn, arg_names, configs, *args, **kwargs)


autotuner.Autotuner.__init__ = _init_with_one_config
