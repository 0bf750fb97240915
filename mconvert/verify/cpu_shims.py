"""The few patches megatron-core (0.13 to 0.19) needs to run a GPTModel forward on CPU, and the stand-ins for
what only Transformer Engine or CUDA kernels provide (gated delta-net's norms and L2 norm).

megatron-core assumes CUDA in a handful of places even when every tensor lives on the CPU
(`use_cpu_initialization=True`). These shims make those places work on CPU and change nothing else:
they only patch CUDA-only entry points that would otherwise raise without a GPU. Install them only in
processes that run megatron-core on CPU (never on CUDA ranks).
"""

import argparse
import contextlib
import copy
import types

import torch

from mconvert.megatron_lm.layer_specs import RMSNorm
from mconvert.verify.mamba import mamba_ssm_importable

_installed = False


def _cpu_device() -> str:
    return "cpu"


def _tensor_stays_on_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return self


def _no_op(*args: object, **kwargs: object) -> None:
    return None


def _null_rng_fork(self: object, name: str = "") -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


def _sliding_window_causal_mask_on_cpu(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """megatron.core.transformer.utils.get_sliding_window_causal_mask (True = masked out), which allocates
    its ones on "cuda": the same triangles, on the CPU."""
    ones = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(ones, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def define_missing_te_general_gemm() -> None:
    """The MoE router's gemm (moe_utils.router_gating_linear) tests `te_general_gemm`, a name moe_utils
    defines only when Transformer Engine imports: without TE it raises NameError, on CPU and CUDA
    alike. None selects its plain torch.mm path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def install_cpu_shims() -> None:
    """Patch the CUDA-only calls megatron-core makes on the CPU forward and save paths. Idempotent."""
    global _installed
    if _installed:
        return
    mamba_ssm_importable()  # before megatron-core's Mamba modules look for it

    from megatron.core.fusions import fused_softmax
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    # Activation buffers, rotary frequencies, TP gathers and MoE router tensors are allocated with
    # `device=torch.cuda.current_device()`; "cpu" is a valid device for all of those allocations.
    torch.cuda.current_device = _cpu_device

    # The tensor-parallel RNG tracker forks the CUDA RNG state (torch.cuda.get_rng_state) around
    # attention dropout and expert weight init; with no CUDA RNG there is nothing to fork.
    tp_random.CudaRNGStatesTracker.fork = _null_rng_fork

    # The MoE router's gemm uses Transformer Engine's `te_general_gemm` when moe_utils has one (and
    # raises NameError when TE is absent, see define_missing_te_general_gemm); TE's gemm needs CUDA,
    # None selects the plain torch.mm path.
    moe_utils.te_general_gemm = None

    # With tied embeddings and PP>1, LanguageModule.setup_embeddings_and_output_layer moves the
    # output-layer copy of the embedding with `.cuda()` before all-reducing it across the first and
    # last stages; on CPU the tensor must stay where it is.
    torch.Tensor.cuda = _tensor_stays_on_cpu

    # The local attention's sliding-window mask (window_size set: Mistral) is built on "cuda".
    fused_softmax.get_sliding_window_causal_mask = _sliding_window_causal_mask_on_cpu

    # megatron's own dist_checkpointing.save synchronizes the CUDA stream before writing.
    torch.cuda.synchronize = _no_op

    _installed = True


class _CudaRngOnCpu(types.ModuleType):
    """torch.cuda, but its RNG state is the CPU's: what a CPU rank has to save where a GPU's would be."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch.cuda, name)

    @staticmethod
    def get_rng_state(device: object = "cuda") -> torch.Tensor:
        return torch.get_rng_state()


class _TorchWithCudaTensorsOnCpu(types.ModuleType):
    """torch, but `torch.tensor(..., device="cuda")` makes a CPU tensor and the CUDA RNG state is the CPU's:
    for modules that build their small bookkeeping tensors on "cuda" by name (Megatron-LM's checkpointing:
    the iteration all-reduce, the RNG state it saves)."""

    cuda = _CudaRngOnCpu("torch.cuda")

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def tensor(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return torch.tensor(*args, **kwargs)


def install_megatron_lm_cpu_shims() -> None:
    """What Megatron-LM's own training code (megatron.training, megatron-core >= 0.19) needs on CPU ranks
    beyond megatron-core's shims. Idempotent."""
    install_cpu_shims()
    from megatron.training import checkpointing

    checkpointing.torch = _TorchWithCudaTensorsOnCpu("torch")


def local_mla_core_attention() -> type:
    """megatron-core 0.16.1's local core attention for multi-latent attention, which passes it `k_channels`
    and `v_channels` that DotProductAttention does not take. Queries and keys are as wide as the tensors
    given; only the output's width (heads x value width, not x kv_channels) needs the value width."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args: object, k_channels: int | None = None, v_channels: int | None = None, **kwargs: object):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def mla_without_transformer_engine() -> None:
    """megatron-core 0.16.1's MLA module decides HAVE_TE by importing megatron's TE extension, which imports
    without TE and leaves `TELinear` a placeholder that MLA then passes to isinstance: HAVE_TE must say
    whether TE itself is installed."""
    from megatron.core.transformer import multi_latent_attention

    try:
        import transformer_engine  # noqa: F401  (only probing whether it is installed)
    except ImportError:
        multi_latent_attention.HAVE_TE = False


def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6, **kwargs: object) -> torch.Tensor:
    """flash-linear-attention's l2norm (x / sqrt(sum x^2 + eps), in fp32), in torch."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).sum(dim, keepdim=True) + eps)).to(x.dtype)


def gated_delta_net_without_fla() -> None:
    """megatron-core's GatedDeltaNet refuses to build without flash-linear-attention (Triton kernels, CUDA only),
    though with `deterministic_mode` its forward runs its own PyTorch convolution and chunked delta rule and
    needs of that package only the queries' and keys' L2 norm: that, in torch. Idempotent."""
    import importlib

    try:  # megatron-core 0.19 splits the module into a package
        module = importlib.import_module("megatron.core.ssm.gated_delta_net.common")
    except ModuleNotFoundError:
        module = importlib.import_module("megatron.core.ssm.gated_delta_net")
    module.HAVE_FLA = True
    module.l2norm = _l2norm


def linear_attention_block_without_te(config: object, args: argparse.Namespace) -> object:
    """megatron-core's GPT block of a gated delta-net model (Qwen3-Next, Qwen3.5) built from its local modules, for
    CPU ranks: megatron-core builds these models only under Transformer Engine, whose fused norm-and-linear
    in_proj and zero-centred norms have no local module. This stage's layers are the local spec's (dense and MoE
    as the args mix them); the linear-attention ones get megatron-core's own GatedDeltaNet with a local in_proj
    after the layer's input norm, stored under the fused module's key (as the local spec stores every norm it
    unfuses), run by its PyTorch path (`deterministic_mode`: its convolution and chunked delta rule in torch,
    see gated_delta_net_without_fla); every norm is zero-centred where the args say."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_linear_attention_pattern
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    gated_delta_net_without_fla()
    config.deterministic_mode = True
    norm = RMSNorm
    block = _local_block_of_this_stage(config, args, norm)
    linear = get_linear_attention_pattern(config)  # 1 where a layer has linear attention
    offset = get_transformer_layer_offset(config)
    for number, layer in enumerate(block.layer_specs, offset):
        layer = layer.submodules
        keys = dict(layer.sharded_state_dict_keys_map or {})
        if linear[number]:
            layer.self_attention = local_gated_delta_net(norm)
            keys["input_layernorm."] = "self_attention.in_proj.layer_norm_"
        else:
            layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = norm
        layer.sharded_state_dict_keys_map = keys
    return block


def local_gated_delta_net(norm: type) -> object:
    """megatron-core's GatedDeltaNet from local modules: a local in_proj (the layer's input norm before it, as a
    module of its own), `norm` at its output, run by its PyTorch path (gated_delta_net_without_fla)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    gated_delta_net_without_fla()
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear, out_norm=norm, out_proj=RowParallelLinear),
    )


def local_gated_delta_net_layer(dense_layer: object, norm: type) -> object:
    """HybridModel's gated delta-net layer (`G`) from a local GPT layer spec: its input norm and local_gated_delta_net,
    no MLP; the norm stored under the fused in_proj's key, as Transformer Engine's layer stores it."""
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    layer = copy.deepcopy(dense_layer)
    layer.submodules.self_attention = local_gated_delta_net(norm)
    layer.submodules.pre_mlp_layernorm = layer.submodules.mlp = IdentityOp
    layer.submodules.mlp_bda = IdentityFuncOp
    layer.submodules.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    return layer


def _local_block_of_this_stage(config: object, args: argparse.Namespace, norm: type) -> object:
    """The local spec's layers of this pipeline stage (dense and MoE as the args mix them), as for a model without
    the attention variant (megatron-core 0.19 refuses it there), each a copy of its own (the local spec repeats one
    spec object for alike layers), with every norm `norm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    plain = copy.copy(config)
    plain.experimental_attention_variant = None
    block = get_gpt_decoder_block_spec(plain, use_transformer_engine=False, normalization=args.normalization)
    block.layer_specs = [copy.deepcopy(layer) for layer in block.layer_specs]
    for layer in block.layer_specs:
        layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = norm
    block.layer_norm = norm
    return block


def duplicated_linear() -> type:
    """A linear layer whose whole weight every tensor-parallel rank holds: what Transformer Engine's
    `parallel_mode="duplicated"` TELinear is (the sparse-attention indexer's projections), which the local spec
    has no module for. Returns (output, None) as megatron's linears do; stored whole, one replica per TP rank."""
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    class DuplicatedLinear(MegatronModule):
        def __init__(self, input_size: int, output_size: int, *, config: object, init_method: object, bias: bool, **kwargs: object):
            super().__init__(config)
            if bias:
                raise ValueError("the duplicated linears of the models converted (the indexer's, latent MoE's) have no bias")
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(self.weight)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return torch.nn.functional.linear(x, self.weight), None

        def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: object = None) -> dict:
            return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets)

    return DuplicatedLinear


def moe_latent_projections_without_te() -> None:
    """megatron-core's MoE layer builds latent MoE's projections (moe_latent_size: Nemotron 3 Super) as Transformer
    Engine's TELinear in its "duplicated" mode and asserts Transformer Engine for them, under the local spec too:
    duplicated_linear stands in for TELinear there, on CPU ranks. Idempotent."""
    from megatron.core.transformer.moe import moe_layer

    moe_layer.HAVE_TE = True
    moe_layer.TELinear = duplicated_linear()


def sparse_attention_block_without_te(config: object, args: argparse.Namespace) -> object:
    """megatron-core's GPT block of a DeepSeek Sparse Attention model (DeepSeek-V3.2, GLM-5.1) built from its local
    modules, for CPU ranks: megatron-core builds the `dsa` variant only under Transformer Engine. This stage's
    layers are the local spec's multi-latent ones (dense and MoE as the args mix them), each with megatron-core's
    own absorbed MLA and DSAttention as its DSA spec makes them, from local modules: the indexer's duplicated
    linears (duplicated_linear) and the down projections as the local MLA has them (column-parallel, gathered)."""
    norm = norm_under_sequence_parallelism()
    attention = local_sparse_attention(config, norm)
    block = _local_block_of_this_stage(config, args, norm)
    for layer in block.layer_specs:
        layer.submodules.self_attention = attention
    return block


def local_sparse_attention(config: object, norm: type) -> object:
    """megatron-core's absorbed MLA with DSAttention as its DSA spec makes them, from local modules (see
    sparse_attention_block_without_te), every norm `norm`."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_dsa_module_spec_for_backend
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class LocalWithDuplicatedLinear(LocalSpecProvider):
        def linear(self) -> type:
            return duplicated_linear()

    attention = get_dsa_module_spec_for_backend(config, backend=LocalWithDuplicatedLinear())
    attention.submodules.linear_q_down_proj = attention.submodules.linear_kv_down_proj = ColumnParallelLinear
    attention.submodules.q_layernorm = attention.submodules.kv_layernorm = norm
    # The indexer builds its key norm as a LayerNorm (its config's normalization), which only megatron-core's torch
    # norm follows: an RMSNorm `norm` would compute another function and leave its bias unloaded.
    attention.submodules.core_attention.submodules.indexer.submodules.k_norm = norm_under_sequence_parallelism()
    return attention


def local_sparse_attention_layer(mla_attention_layer: object, config: object, norm: type) -> object:
    """HybridModel's sparse-attention layer (`D`) from a local MLA attention layer spec."""
    layer = copy.deepcopy(mla_attention_layer)
    layer.submodules.self_attention = local_sparse_attention(config, norm)
    return layer


def norm_under_sequence_parallelism() -> type:
    """megatron-core's torch norm (RMSNorm or LayerNorm, as the config it is given says), built where the model runs
    with sequence parallelism, which that module refuses: under it, a norm's weight gradient must be summed over the
    TP ranks, which the forward passes of the CPU checks never take."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    class TorchNorm:
        def __new__(cls, config: object, hidden_size: int, eps: float = 1e-5, **kwargs: object) -> torch.nn.Module:
            unsplit = copy.copy(config)
            unsplit.sequence_parallel = False
            return WrappedTorchNorm(unsplit, hidden_size, eps, **kwargs)

    return TorchNorm


def experimental_block_without_te(config: object, args: argparse.Namespace) -> object:
    """The GPT block of a model with megatron-core's experimental attention variant (gated delta-net or DeepSeek
    Sparse Attention), built from its local modules for CPU ranks."""
    if config.experimental_attention_variant == "dsa":
        return sparse_attention_block_without_te(config, args)
    return linear_attention_block_without_te(config, args)
