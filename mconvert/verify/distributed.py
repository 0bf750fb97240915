"""Run a function on every rank of a megatron-core parallel layout (TP x PP, with EP and expert TP).

Either in child processes started here (gloo on CPU, NCCL on CUDA, one localhost rendezvous), or, when
the caller already runs under `torchrun` (RANK and WORLD_SIZE set), in this process as one of its ranks.
"""

import dataclasses
import datetime
import io
import math
import multiprocessing.context
import multiprocessing.queues
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mconvert.errors import ConversionError
from mconvert.verify.cpu_shims import define_missing_te_general_gemm, install_cpu_shims

Device = Literal["cpu", "cuda"]

# Seconds a finished rank gets to tear its process groups down before it is killed.
_EXIT_GRACE_S = 10.0


class RankFailed(RuntimeError):
    """A rank raised, or died, while running the function; the message holds its traceback."""


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor parallel size; megatron-core defaults it to tp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def world_size(self) -> int:
        """The smallest world megatron-core's initialize_model_parallel accepts for this layout.

        Per pipeline stage the world must split both into TP groups (dense layers, with data
        parallelism DP = world / (tp * pp)) and into expert groups of ETP x EP (expert layers, with
        their own expert DP): the stage size is a multiple of tp and of etp * ep. So EP=2 at TP=1 needs
        2 ranks per stage, EP=2 with TP=2 and ETP=1 also 2, EP=2 at TP=ETP=2 needs 4.
        """
        return math.lcm(self.tp, self.expert_tp * self.ep) * self.pp


def run_ranks(
    fn: Callable[..., Any],
    *args: Any,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    device: Device = "cpu",
    timeout_s: float = 600.0,
    seed: int = 1234,
) -> Any:
    """Run `fn(*args)` on every rank of the layout; return rank 0's return value.

    `fn` and `args` must be picklable (a module-level function) and rank 0's result too. A ConversionError
    in any rank is raised here as it is, any other exception as RankFailed with that rank's traceback;
    the other ranks are killed.
    Collectives time out after `timeout_s`, and a run still going after `timeout_s` is killed with a
    TimeoutError, so a broken rank never hangs the caller.

    Under torchrun (RANK and WORLD_SIZE set) this process is one of the ranks: megatron-core's parallel
    state is set up here unless it already is, and each rank gets its own `fn`'s return value.
    """
    layout = ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_in_this_torchrun_rank(fn, args, layout, device, timeout_s, seed)
    return _run_in_child_processes(fn, args, layout, device, timeout_s, seed)


def _run_in_this_torchrun_rank(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    layout: ParallelLayout,
    device: Device,
    timeout_s: float,
    seed: int,
) -> Any:
    from megatron.core import parallel_state

    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != layout.world_size:
        raise ValueError(
            f"torchrun started {world_size} ranks but {layout} needs {layout.world_size}"
        )
    if device == "cpu":
        install_cpu_shims()
    if not parallel_state.model_parallel_is_initialized():
        _init_rank(
            int(os.environ["RANK"]),
            int(os.environ.get("LOCAL_RANK", 0)),
            "env://",
            layout,
            device,
            timeout_s,
            seed,
        )
    elif (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_world_size(),
        parallel_state.get_expert_tensor_parallel_world_size(),
    ) != (layout.tp, layout.pp, layout.ep, layout.expert_tp):
        raise ValueError(f"megatron-core is already initialized with another layout than {layout}")
    return fn(*args)


def _init_rank(
    rank: int,
    local_rank: int,
    init_method: str,
    layout: ParallelLayout,
    device: Device,
    timeout_s: float,
    seed: int,
) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if device == "cpu":
        install_cpu_shims()
        # Ranks share the machine's cores; more threads than cores only slows them all down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world_size))
    else:
        define_missing_te_general_gemm()
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():  # under torchrun the caller may have done it
        dist.init_process_group(
            backend="gloo" if device == "cpu" else "nccl",
            init_method=init_method,
            rank=rank,
            world_size=layout.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=math.ceil(timeout_s / 60),
        # The extra gloo groups serve only the distributed optimizer.
        create_gloo_process_groups=False,
    )
    # As Megatron-LM seeds its ranks: torch's own generators alike on every rank, so that weights drawn from
    # them (a replicated router, say) are the same in every replica; on GPUs also megatron's CUDA RNG tracker,
    # which draws the tensor-parallel shards (without CUDA it cannot be seeded: the CPU shims make its fork a
    # no-op and CPU initialization draws from torch's CPU generator).
    torch.manual_seed(seed)
    if device != "cpu":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _run_in_child_processes(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    layout: ParallelLayout,
    device: Device,
    timeout_s: float,
    seed: int,
) -> Any:
    context = _process_context(device)
    reports = context.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    # Not daemonic: megatron's checkpoint writer may start processes of its own.
    ranks = [
        context.Process(
            target=_child_rank_main,
            args=(rank, init_method, layout, device, timeout_s, seed, fn, args, reports),
        )
        for rank in range(layout.world_size)
    ]
    succeeded = False
    try:
        for process in ranks:
            process.start()
        rank0_result = _collect_reports(ranks, reports, timeout_s)
        succeeded = True
    finally:
        _stop(ranks, grace_s=_EXIT_GRACE_S if succeeded else 0.0)
    return torch.load(io.BytesIO(rank0_result), weights_only=False)


def _process_context(device: Device) -> multiprocessing.context.BaseContext:
    """CPU ranks fork from a server process that has imported megatron-core once (seconds of
    imports otherwise paid by every rank of every run). CUDA ranks are spawned afresh: a process
    forked after CUDA was initialized (as importing Transformer Engine may do) cannot use CUDA."""
    if device != "cpu":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    # Takes effect when this process starts its fork server, i.e. on the first run.
    context.set_forkserver_preload(["mconvert.verify.megatron_side"])
    return context


def _child_rank_main(
    rank: int,
    init_method: str,
    layout: ParallelLayout,
    device: Device,
    timeout_s: float,
    seed: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    reports: multiprocessing.queues.Queue,
) -> None:
    try:
        _init_rank(rank, rank, init_method, layout, device, timeout_s, seed)
        result = fn(*args)
        reports.put((rank, True, _serialized(result) if rank == 0 else b""))
    except ConversionError as error:
        # Unusable input, found by a rank: the caller reports it as one line, as it would its own.
        reports.put((rank, False, error))
        return
    except BaseException:
        reports.put((rank, False, traceback.format_exc()))
        return
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _serialized(result: Any) -> bytes:
    """Tensors put on a queue as they are would be shared through this process's memory, which is
    gone once it exits: send them as bytes."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _collect_reports(
    ranks: list[mp.Process], reports: multiprocessing.queues.Queue, timeout_s: float
) -> bytes:
    """Wait for every rank's report; return rank 0's result. Raise at the first failure: a rank's
    ConversionError as it is, anything else as RankFailed with the rank's traceback."""
    deadline = time.monotonic() + timeout_s
    results: dict[int, bytes] = {}
    while len(results) < len(ranks):
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            missing = sorted(set(range(len(ranks))) - results.keys())
            raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
        try:
            rank, ok, payload = reports.get(timeout=min(1.0, remaining_s))
        except queue.Empty:
            for rank, process in enumerate(ranks):
                if rank not in results and process.exitcode is not None:
                    raise RankFailed(
                        f"rank {rank} exited with code {process.exitcode} without reporting"
                    ) from None
            continue
        if isinstance(payload, ConversionError):
            raise payload
        if not ok:
            raise RankFailed(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    return results[0]


def _stop(ranks: list[mp.Process], grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    for process in ranks:
        if process.pid is not None:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
