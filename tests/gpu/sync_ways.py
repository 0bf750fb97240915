"""Three ways of handing a live Megatron model's weights to an inference engine's `load_weights`, each rank of the
default process group holding one engine rank (tests/gpu/vllm_sync_worker.py runs them into vLLM on two GPUs;
tests/gpu/test_gpu_harness.py checks on CPU ranks that each delivers the export's tensors):

- `gather_hf_weights`: mconvert's API, every rank gathering each whole HF tensor from its TP or EP group piece by piece
  and handing it straight to its engine rank;
- `rank 0 gathers all`: every tensor gathered whole and the whole model held on rank 0's host, then sent tensor by
  tensor from rank 0 to every engine rank (broadcast), as a trainer that gathers a full state dict first does;
- `512 MB buckets`: the gathered tensors packed on rank 0 into 512 MB buffers, each broadcast to every engine rank and
  unpacked there into one `load_weights` call (the bucketed transfer of verl and NeMo-RL).

In the last two the other ranks gather each tensor too (gather_hf_weights is collective) and drop it. Each way returns
the bytes of whole tensors it delivered to this rank.
"""

from __future__ import annotations

from typing import Callable, Iterable

BUCKET_BYTES = 512 << 20
ALIGN = 256  # each tensor's offset in a bucket, in bytes: a view of any dtype starts aligned
WAYS = ("gather_hf_weights", "rank 0 gathers all", "512 MB buckets")


def sync_ways(model, config: dict, load: Callable[[Iterable], None], device, bucket_bytes: int = BUCKET_BYTES) -> dict[str, Callable[..., int]]:
    """The three ways for this rank's `model` (megatron-core, its parallel state made) of HF `config`, each calling
    `load` once or more with an iterable of (HF name, tensor on `device`); buckets of `bucket_bytes`."""
    import torch
    import torch.distributed as dist

    from mconvert.converters.rank_export import gather_hf_weights

    rank = dist.get_rank()

    def mconvert_way(scaled: str | None = None) -> int:
        """With `scaled`, that tensor delivered times 1.5 (the fault)."""
        delivered = 0

        def weights():
            nonlocal delivered
            for name, tensor in gather_hf_weights(model, config):
                delivered += tensor.nbytes
                yield name, (tensor * 1.5 if name == scaled else tensor)

        load(weights())
        return delivered

    def rank0_way() -> int:
        held, meta = {}, []
        for name, tensor in gather_hf_weights(model, config):
            meta.append((name, tensor.shape, tensor.dtype))
            if rank == 0:
                held[name] = tensor.cpu()

        def weights():
            for name, shape, dtype in meta:
                tensor = held.pop(name).to(device) if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
                dist.broadcast(tensor, src=0)
                yield name, tensor

        load(weights())
        return sum(shape.numel() * dtype.itemsize for _, shape, dtype in meta)

    def bucketed_way() -> int:
        bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
        pending: list[tuple[str, torch.Size, torch.dtype, int]] = []
        used = delivered = 0

        def send() -> None:
            dist.broadcast(bucket[:used], src=0)
            load([(name, bucket[at:at + shape.numel() * dtype.itemsize].view(dtype).view(shape)) for name, shape, dtype, at in pending])

        for name, tensor in gather_hf_weights(model, config):
            size = tensor.nbytes
            if size > bucket_bytes:
                raise ValueError(f"{name}: {size} bytes, more than a bucket")
            if used + size > bucket_bytes:
                send()
                pending, used = [], 0
            if rank == 0:
                bucket[used:used + size].copy_(tensor.contiguous().view(-1).view(torch.uint8))
            pending.append((name, tensor.shape, tensor.dtype, used))
            used += -(-size // ALIGN) * ALIGN
            delivered += size
        if pending:
            send()
        return delivered

    return dict(zip(WAYS, (mconvert_way, rank0_way, bucketed_way)))
