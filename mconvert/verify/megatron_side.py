"""megatron-core as the reference for a torch_dist checkpoint: load it, run it, read it back.

Every function here runs inside a rank set up by `mconvert.verify.distributed.run_ranks` (or any
megatron-core process with `parallel_state` initialized) and must be called by all ranks together.
"""

import argparse
import contextlib
import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
from megatron.core.dist_checkpointing.validation import StrictHandling

from mconvert.converters.rank_export import model_sharded_state_dict
from mconvert.errors import ConversionError
from mconvert.mcore import hybrid
from mconvert.mcore.checkpoint import iteration_dir
from mconvert.verify.hybrid_model import build_hybrid_model
from mconvert.verify.megatron_model import MEGATRON_CORE_VERSION, TransformerImpl, build_gpt_model

ModelChunks = list[torch.nn.Module]  # a GPTModel or HybridModel a stage


def load_model(
    ckpt_dir: str | Path,
    args: argparse.Namespace,
    params_dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    transformer_impl: TransformerImpl = "transformer_engine",
) -> ModelChunks:
    """Build this rank's GPTModel (HybridModel, where `args` name a hybrid layer pattern) from `args` and load the
    checkpoint into it, in eval mode.

    Every tensor the model asks for must be in the checkpoint (a missing one raises); tensors the
    model does not ask for are ignored, as Megatron-LM does.
    """
    build = build_hybrid_model if getattr(args, "hybrid_layer_pattern", None) else build_gpt_model
    model = build(
        args,
        params_dtype,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        transformer_impl=transformer_impl,
        # Every weight is overwritten by the checkpoint.
        perform_initialization=False,
    ).to(device)
    try:
        state_dict = dist_checkpointing.load(
            # Nested as Megatron-LM nests it: the checkpoint's common state (args, iteration, ...) comes
            # back beside "model". The tensors' checkpoint keys do not depend on the nesting.
            {"model": model_sharded_state_dict(model)},
            str(iteration_dir(Path(ckpt_dir))),
            # megatron's "unexpected" keys are those the model asks for and the checkpoint lacks.
            strict=StrictHandling.RAISE_UNEXPECTED,
        )
    except CheckpointingException as error:
        # The model megatron-core builds from the stored args is not the one the checkpoint holds (another
        # megatron-core, another spec): megatron's own account of it, on one line.
        raise ConversionError(
            f"{ckpt_dir}: megatron-core {MEGATRON_CORE_VERSION} ({transformer_impl} spec) cannot load it into the "
            f"model it builds from the checkpoint's args: {' '.join(str(error).split())[:600]}"
        ) from None
    model.load_state_dict(state_dict["model"], strict=True)
    model.eval()
    return [model]


def forward_logits(model: ModelChunks, tokens: torch.Tensor) -> torch.Tensor:
    """fp32 logits [batch, seq, padded_vocab] of a causal forward over `tokens` [batch, seq].

    All ranks pass the same tokens; the result is valid on rank 0.
    """
    logits, _ = _forward(model, tokens, record_hidden_states=False)
    return logits


def forward_logits_and_hidden_states(
    model: ModelChunks, tokens: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """As forward_logits, and each decoder layer's output [batch, seq, hidden] (fp32, global layer
    order), to locate the first layer where two models diverge. Valid on rank 0."""
    return _forward(model, tokens, record_hidden_states=True)


@contextlib.contextmanager
def _without_mtp(chunk: torch.nn.Module):
    """The forward of the main model alone. Multi-token prediction layers predict later tokens from the main
    model's hidden states and never change its logits; megatron-core 0.16.1 runs them only with labels."""
    if not getattr(chunk, "mtp_process", False):
        yield
        return
    mtp_process, mtp_num_layers = chunk.mtp_process, chunk.config.mtp_num_layers
    chunk.mtp_process, chunk.config.mtp_num_layers = False, None
    try:
        yield
    finally:
        chunk.mtp_process, chunk.config.mtp_num_layers = mtp_process, mtp_num_layers


def _forward(
    model: ModelChunks, tokens: torch.Tensor, record_hidden_states: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    (chunk,) = model  # one chunk per rank: no virtual pipeline stages
    device = next(chunk.parameters()).device
    tokens = tokens.to(device)
    prompt_length = tokens.shape[1]
    # Under sequence parallelism the TP ranks split the sequence evenly: the prompt is padded at its end to a
    # multiple of TP, which changes no earlier position's logits (attention is causal, routing per token).
    split = parallel_state.get_tensor_model_parallel_world_size() if chunk.config.sequence_parallel else 1
    tokens = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], -prompt_length % split)], dim=1)
    batch, seq = tokens.shape
    position_ids = torch.arange(seq, device=device).expand(batch, seq)
    # True = masked out. megatron's own default causal mask is allocated on "cuda", so pass one.
    causal_mask = torch.ones(seq, seq, dtype=torch.bool, device=device).triu(1)[None, None]
    is_first_stage = parallel_state.is_pipeline_first_stage()
    is_last_stage = parallel_state.is_pipeline_last_stage()

    layer_outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(_recorder(layer_outputs, index, chunk.config.sequence_parallel))
        for index, layer in (_decoder_layers(chunk) if record_hidden_states else [])
    ]
    # One microbatch through the stages, as megatron's forward-only schedule runs it; the schedule
    # itself cannot run on CPU (0.16.1 allocates its token counter with device="cuda"). The stages
    # pass activations with plain send/recv: megatron's own wrappers changed API between versions
    # (module functions in 0.13, P2PCommunicator from 0.14).
    try:
        with torch.no_grad():
            if not is_first_stage:
                # Under sequence parallelism each TP rank holds and passes on its part of the sequence.
                received = torch.empty(
                    (seq // split, batch, chunk.config.hidden_size), dtype=chunk.config.pipeline_dtype, device=device
                )
                dist.recv(received, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(received)
            # TP logits are gathered by the output layer itself.
            with _without_mtp(chunk):
                output = chunk(tokens, position_ids, causal_mask, runtime_gather_output=True)
            if not is_last_stage:
                dist.send(output, dst=parallel_state.get_pipeline_model_parallel_next_rank())
    finally:
        for hook in hooks:
            hook.remove()

    logits = _from_last_pipeline_stage(
        output.float() if is_last_stage else None,
        shape=(batch, seq, chunk.vocab_size),
        device=device,
    )
    hidden_states = _hidden_states_of_all_stages(layer_outputs) if record_hidden_states else []
    return logits[:, :prompt_length].cpu(), [hidden[:, :prompt_length] for hidden in hidden_states]


def _decoder_layers(chunk: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(the global decoder layer index, the module whose output ends that layer) of this stage: a GPT layer, or a
    HybridModel's MLP layer, which ends the GPT layer it is the second half of (every layer where the pattern has
    Mamba layers: each is an HF layer)."""
    types = getattr(chunk.decoder, "layer_type_list", None)
    if types is None or hybrid.MAMBA in types:  # GPT layers, or hybrid layers that are one HF layer each
        return [(layer.layer_number - 1, layer) for layer in chunk.decoder.layers]
    return [
        ((layer.layer_number - 1) // 2, layer) for layer, symbol in zip(chunk.decoder.layers, types) if symbol in hybrid.MLP_SYMBOLS
    ]


def _recorder(outputs: dict[int, torch.Tensor], layer_index: int, sequence_parallel: bool):
    def record(module: torch.nn.Module, inputs: object, output: object) -> None:
        hidden = output[0] if isinstance(output, tuple) else output  # [seq, batch, hidden]
        if sequence_parallel:  # each TP rank holds its part of the sequence
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        outputs[layer_index] = hidden.detach().transpose(0, 1).float().cpu()

    return record


def _from_last_pipeline_stage(
    logits: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return logits
    if logits is None:
        logits = torch.empty(shape, dtype=torch.float32, device=device)
    dist.broadcast(
        logits,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return logits


def _hidden_states_of_all_stages(layer_outputs: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    stages: list[dict[int, torch.Tensor]] = [
        {} for _ in range(parallel_state.get_pipeline_model_parallel_world_size())
    ]
    dist.all_gather_object(
        stages, layer_outputs, group=parallel_state.get_pipeline_model_parallel_group()
    )
    merged = {index: hidden for stage in stages for index, hidden in stage.items()}
    return [merged[index] for index in sorted(merged)]


@dataclasses.dataclass
class _Shard:
    key: str
    global_shape: tuple[int, ...]
    global_slice: tuple[int | slice, ...]
    main_replica: bool
    data: torch.Tensor


def gather_global_state(model: ModelChunks) -> dict[str, torch.Tensor]:
    """megatron's view of the loaded model as whole tensors keyed by checkpoint key, on rank 0.

    Assembled from every rank's `sharded_state_dict()` (factories applied, so e.g. a swiglu fc1 under
    TP arrives as its gate and up fragments) using only megatron-core's sharding metadata: each main
    replica is written at its global offset, every element must be written exactly once, and every
    other replica must equal what the main one wrote. Gathers the whole model on rank 0: meant for
    small models. Other ranks get {}.
    """
    shards = []
    for chunk in model:
        sharded_state_dict = model_sharded_state_dict(chunk)
        apply_factories(sharded_state_dict)
        shards += [
            _Shard(
                key=sharded.key,
                global_shape=tuple(sharded.global_shape),
                global_slice=sharded.global_slice(),
                main_replica=is_main_replica(sharded.replica_id),
                data=sharded.data.detach().cpu(),
            )
            for sharded in nested_values(sharded_state_dict)
            if isinstance(sharded, ShardedTensor)
        ]
    is_rank0 = dist.get_rank() == 0
    all_shards = [[] for _ in range(dist.get_world_size())] if is_rank0 else None
    dist.gather_object(shards, all_shards, dst=0)
    if not is_rank0:
        return {}
    return _assemble([shard for rank_shards in all_shards for shard in rank_shards])


def _assemble(shards: list[_Shard]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    writes: dict[str, torch.Tensor] = {}
    for shard in filter(lambda shard: shard.main_replica, shards):
        if shard.key not in tensors:
            tensors[shard.key] = torch.zeros(shard.global_shape, dtype=shard.data.dtype)
            writes[shard.key] = torch.zeros(shard.global_shape, dtype=torch.int32)
        if tensors[shard.key].shape != shard.global_shape:
            raise ValueError(
                f"{shard.key}: shards disagree on the global shape "
                f"({tuple(tensors[shard.key].shape)} and {shard.global_shape})"
            )
        tensors[shard.key][shard.global_slice] = shard.data
        writes[shard.key][shard.global_slice] += 1
    for key, count in writes.items():
        if not bool((count == 1).all()):
            raise ValueError(
                f"{key}: the main replicas write some elements {int(count.min())} and some "
                f"{int(count.max())} times instead of each exactly once"
            )
    for shard in filter(lambda shard: not shard.main_replica, shards):
        if shard.key not in tensors:
            raise ValueError(f"{shard.key}: only non-main replicas")
        if not torch.equal(tensors[shard.key][shard.global_slice], shard.data):
            raise ValueError(f"{shard.key}: a replica differs from the main replica")
    return tensors
