"""The megatron-side verification harness, checked against megatron-core itself.

Small GPTModels are built at TP=1 from Megatron-LM args and saved with megatron's own
`dist_checkpointing.save`; the harness then loads them at other layouts. Its view of the weights must
equal what is on disk, and its logits must equal the TP=1 ones. Each `run_ranks` call starts ranks and
process groups anew, so each layout loads all its models in one call.
"""

import argparse
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mconvert.errors import ConversionError
from mconvert.verify.distributed import ParallelLayout, RankFailed, run_ranks

TOKENS = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))


def dense_args(tied: bool) -> argparse.Namespace:
    """Qwen3-like: GQA, swiglu, RMSNorm, q/k norm, and a QKV bias to have one."""
    return argparse.Namespace(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=96,
        num_attention_heads=4,
        group_query_attention=True,
        num_query_groups=2,
        kv_channels=16,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=True,
        qk_layernorm=True,
        position_embedding_type="rope",
        rotary_base=10000,
        rotary_percent=1.0,
        untie_embeddings_and_output_weights=not tied,
        # 3 x 128: at TP=2 Megatron pads it to 512, so loading exercises the padded-vocab path.
        padded_vocab_size=384,
        max_position_embeddings=64,
        seq_length=8,
    )


def moe_args() -> argparse.Namespace:
    """Qwen2-MoE-like: shared expert with a sigmoid gate, softmax before top-k, dense layers mixed in."""
    return argparse.Namespace(
        **{
            **vars(dense_args(tied=False)),
            "num_layers": 4,
            "qk_layernorm": False,
            "padded_vocab_size": 256,
            "num_experts": 4,
            "moe_router_topk": 2,
            "moe_ffn_hidden_size": 32,
            "moe_shared_expert_intermediate_size": 48,
            "moe_shared_expert_gate": True,
            "moe_router_pre_softmax": True,
            # Pipeline stages of 2 layers each get one dense and one MoE layer.
            "moe_layer_freq": [0, 1, 1, 0],
            "moe_grouped_gemm": False,
            "moe_router_load_balancing_type": "none",
            "moe_token_dispatcher_type": "allgather",
        }
    )


MODELS = {"dense": dense_args(tied=False), "dense_tied": dense_args(tied=True), "moe": moe_args()}


# ---- functions run inside the ranks (module level, so that they pickle) ----


def save_reference_models(root: Path) -> dict[str, dict]:
    """At TP=1: build each model with random weights, save it as a release checkpoint, and return
    its logits, layer outputs and global state as the harness sees them. Also try load_model's
    strictness: on a checkpoint lacking a tensor, and on one with a tensor the model does not need."""
    # megatron-core 0.16.1's torch_dist save writes in forked workers that need psutil (not one of
    # its declared dependencies); without it a worker dies unreported and the save hangs.
    import psutil  # noqa: F401
    from megatron.core import dist_checkpointing

    from mconvert.verify.megatron_model import build_gpt_model
    from mconvert.verify.megatron_side import (
        forward_logits_and_hidden_states,
        gather_global_state,
        load_model,
    )

    references = {}
    for name, args in MODELS.items():
        model = build_gpt_model(args, torch.float32, True, True, transformer_impl="local")
        with torch.no_grad():
            for parameter in model.parameters():
                # Also the norms and biases, which megatron initializes to constants.
                parameter.normal_(1.0 if parameter.dim() == 1 else 0.0, 0.1)
        model.eval()
        release = root / name / "release"
        release.mkdir(parents=True)
        # As Megatron-LM saves: the model under "model", args and the like in common.pt.
        dist_checkpointing.save(
            {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0},
            str(release),
        )
        (root / name / "latest_checkpointed_iteration.txt").write_text("release")
        logits, hidden_states = forward_logits_and_hidden_states([model], TOKENS)
        references[name] = {
            "logits": logits,
            "hidden_states": hidden_states,
            "state": gather_global_state([model]),
        }

    incomplete = build_gpt_model(MODELS["dense"], torch.float32, True, True, "local")
    sharded_state_dict = incomplete.sharded_state_dict()
    del sharded_state_dict["decoder.final_layernorm.weight"]
    (root / "incomplete").mkdir()
    dist_checkpointing.save(sharded_state_dict, str(root / "incomplete"))
    strictness = {}
    try:
        load_model(root / "incomplete", MODELS["dense"], torch.float32, "cpu", "local")
        strictness["incomplete_load_error"] = ""
    except ConversionError as error:
        strictness["incomplete_load_error"] = str(error)

    # The untied checkpoint has an output layer the tied model does not ask for.
    (tied,) = load_model(root / "dense", MODELS["dense_tied"], torch.float32, "cpu", "local")
    strictness["tied_from_untied_embedding"] = tied.embedding.word_embeddings.weight.detach()
    return {"models": references, "strictness": strictness}


def load_and_run(root: Path, names: list[str]) -> dict[str, dict]:
    """Load each model at this layout; return what the harness sees of it, and for the dense model
    the first layer's fc1 as each rank of rank 0's TP group holds it."""
    from megatron.core import parallel_state

    from mconvert.verify.megatron_side import (
        forward_logits,
        forward_logits_and_hidden_states,
        gather_global_state,
        load_model,
    )

    results = {}
    for name in names:
        model = load_model(root / name, MODELS[name], torch.float32, "cpu", "local")
        logits_too, hidden_states = forward_logits_and_hidden_states(model, TOKENS)
        results[name] = {
            "logits": forward_logits(model, TOKENS),
            "logits_too": logits_too,
            "hidden_states": hidden_states,
            "state": gather_global_state(model),
        }
        if name == "dense":
            local_fc1 = model[0].decoder.layers[0].mlp.linear_fc1.weight.detach()
            tp_group = parallel_state.get_tensor_model_parallel_group()
            per_rank = [torch.empty_like(local_fc1) for _ in range(tp_group.size())]
            dist.all_gather(per_rank, local_fc1, group=tp_group)
            results[name]["fc1_per_tp_rank"] = per_rank
    return results


def fail_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")
    dist.barrier()  # rank 0 would wait here forever: the parent must kill it


def refuse_on_rank_1() -> None:
    if dist.get_rank() == 1:
        raise ConversionError("rank 1 cannot use this checkpoint")
    dist.barrier()


# ---- tests ----


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict]]:
    root = tmp_path_factory.mktemp("megatron_checkpoints")
    return root, run_ranks(save_reference_models, root, timeout_s=180)


@pytest.fixture(scope="module")
def checkpoints(saved: tuple[Path, dict[str, dict]]) -> tuple[Path, dict[str, dict]]:
    """The checkpoint root and each model's reference (TP=1) results."""
    root, outcome = saved
    return root, outcome["models"]


@pytest.fixture(scope="module")
def strictness(saved: tuple[Path, dict[str, dict]]) -> dict:
    return saved[1]["strictness"]


def stored_tensors(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a torch_dist checkpoint, read with plain torch.distributed.checkpoint."""
    reader = dcp.FileSystemReader(str(checkpoint_dir))
    tensors = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


LAYOUTS = [
    pytest.param(ParallelLayout(tp=2), ["dense", "dense_tied", "moe"], id="tp2"),
    pytest.param(ParallelLayout(pp=2), ["dense", "dense_tied", "moe"], id="pp2"),
    pytest.param(ParallelLayout(ep=2), ["moe"], id="ep2"),
    pytest.param(ParallelLayout(tp=2, ep=2, etp=1), ["moe"], id="tp2_ep2_etp1"),
]


@pytest.mark.parametrize("layout, names", LAYOUTS)
def test_reloaded_at_another_layout_matches_tp1(
    checkpoints: tuple[Path, dict[str, dict]], layout: ParallelLayout, names: list[str]
) -> None:
    root, references = checkpoints
    results = run_ranks(
        load_and_run, root, names, tp=layout.tp, pp=layout.pp, ep=layout.ep, etp=layout.etp,
        timeout_s=180,
    )
    for name in names:
        reference, result = references[name], results[name]
        vocab = MODELS[name].padded_vocab_size

        on_disk = stored_tensors(root / name / "release")
        assert result["state"].keys() == on_disk.keys() == reference["state"].keys()
        for key, stored in on_disk.items():
            gathered = result["state"][key]
            # Rows padded for a larger TP are zero (embeddings and output layer only).
            assert torch.equal(gathered[: stored.shape[0]], stored), (name, key)
            assert not gathered[stored.shape[0] :].any(), (name, key)

        logits = result["logits"]
        assert logits.dtype == torch.float32
        assert logits.shape[:2] == TOKENS.shape
        torch.testing.assert_close(logits[..., :vocab], reference["logits"], rtol=0, atol=1e-5)
        assert torch.equal(result["logits_too"], logits)
        assert not logits[..., vocab:].any()
        if name == "dense":
            # Each TP rank holds [gate_r; up_r]; the assembled global fc1 is still [gate; up].
            gate, up = reference["state"]["decoder.layers.mlp.linear_fc1.weight"][0].chunk(2)
            tp = len(result["fc1_per_tp_rank"])
            for rank, local in enumerate(result["fc1_per_tp_rank"]):
                local_gate, local_up = local.chunk(2)
                assert torch.equal(local_gate, gate.chunk(tp)[rank])
                assert torch.equal(local_up, up.chunk(tp)[rank])

        assert len(result["hidden_states"]) == MODELS[name].num_layers
        for layer, (hidden, reference_hidden) in enumerate(
            zip(result["hidden_states"], reference["hidden_states"])
        ):
            torch.testing.assert_close(hidden, reference_hidden, rtol=0, atol=1e-5, msg=f"{layer}")


def test_reference_state_is_what_was_saved(checkpoints: tuple[Path, dict[str, dict]]) -> None:
    root, references = checkpoints
    for name in MODELS:
        on_disk = stored_tensors(root / name / "release")
        state = references[name]["state"]
        assert state.keys() == on_disk.keys()
        for key, stored in on_disk.items():
            assert torch.equal(state[key], stored), (name, key)


def test_key_names_follow_the_format(checkpoints: tuple[Path, dict[str, dict]]) -> None:
    _, references = checkpoints
    dense, tied, moe = (references[name]["state"] for name in ("dense", "dense_tied", "moe"))
    # ng * (nq/ng + 2) * d = 2 * 4 * 16 rows: stacked over the 2 layers.
    assert dense["decoder.layers.self_attention.linear_qkv.weight"].shape == (2, 128, 64)
    assert dense["decoder.layers.self_attention.linear_qkv.bias"].shape == (2, 128)
    assert dense["decoder.layers.self_attention.q_layernorm.weight"].shape == (2, 16)
    assert dense["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 192, 64)
    assert dense["decoder.layers.self_attention.linear_qkv.layer_norm_weight"].shape == (2, 64)
    assert dense["output_layer.weight"].shape == (384, 64)
    assert "output_layer.weight" not in tied
    # Mixed dense and MoE layers: per-layer keys; the experts' fc1 is [E, 2F, H].
    assert moe["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].shape == (4, 64, 64)
    assert moe["decoder.layers.1.mlp.experts.experts.linear_fc2.weight"].shape == (4, 64, 32)
    assert moe["decoder.layers.1.mlp.router.weight"].shape == (4, 64)
    assert moe["decoder.layers.1.mlp.shared_experts.gate_weight"].shape == (1, 64)
    assert moe["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96 * 2, 64)
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in moe


def test_missing_tensor_fails_to_load_with_one_line_naming_it(strictness: dict) -> None:
    error = strictness["incomplete_load_error"]
    assert "decoder.final_layernorm.weight" in error and "(local spec) cannot load it" in error
    assert "\n" not in error


def test_tensors_the_model_does_not_need_are_ignored(
    checkpoints: tuple[Path, dict[str, dict]], strictness: dict
) -> None:
    _, references = checkpoints
    embedding = references["dense"]["state"]["embedding.word_embeddings.weight"]
    assert torch.equal(strictness["tied_from_untied_embedding"], embedding)


def test_a_failing_rank_is_reported_and_the_others_killed() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed:(.|\n)*rank 1 gives up"):
        run_ranks(fail_on_rank_1, tp=2, timeout_s=120)
    assert time.monotonic() - started < 60


def test_a_rank_refusing_the_input_is_a_one_line_error() -> None:
    """A ConversionError in a rank reaches the caller as itself (the CLI prints it as one line)."""
    with pytest.raises(ConversionError, match="^rank 1 cannot use this checkpoint$"):
        run_ranks(refuse_on_rank_1, tp=2, timeout_s=120)


@pytest.mark.parametrize(
    "layout, world_size",
    [
        (ParallelLayout(tp=2, pp=2), 4),
        (ParallelLayout(ep=2), 2),
        (ParallelLayout(tp=2, ep=2, etp=1), 2),
        (ParallelLayout(tp=2, ep=2), 4),
        (ParallelLayout(tp=2, ep=4, etp=1, pp=2), 8),
    ],
)
def test_world_size(layout: ParallelLayout, world_size: int) -> None:
    assert layout.world_size == world_size
