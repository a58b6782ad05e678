# Generated from solutions/phase3_multi_node/ring_allreduce.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Ring all-reduce from point-to-point messages: reduce-scatter, then all-gather.

W ranks sit on a ring; each sends only to its right neighbour and receives only
from its left one. The tensor (N bytes, flattened) is cut into W chunks.

* reduce-scatter: W-1 steps. At each step every rank sends one chunk to the right
  and adds the chunk arriving from the left into its own copy. After W-1 steps
  rank r holds chunk r summed over all ranks. (ZeRO's gradient sharding.)
* all-gather: W-1 more steps pass the finished chunks around the ring, copying
  instead of adding. (ZeRO's parameter gathering.)

Each rank sends (W-1)/W * N per phase, 2(W-1)/W * N in all, whatever W is: the
bandwidth-optimal all-reduce. Time: 2(W-1) alpha + 2(W-1)/W * N * beta.
With uneven chunks (N % W != 0, sizes n_0 >= n_1 >= ...), rank r sends
(N - n_r) + (N - n_{r+1}) elements: everything but the chunk it finishes last and
the chunk its right neighbour finishes.

The plain version waits for each step before adding; ``ring_allreduce_pipelined``
cuts every chunk into slices and forwards each slice as soon as it has been added,
so sending, receiving and adding overlap (as NCCL does).
See phase3_multi_node/guidelines.md#ring-all-reduce.

Run the demo (checks, then a timing table against ``dist.all_reduce``):
``RUN_MODE=ring_allreduce ./entrypoint.sh``; ``IMPL=templates RUN_MODE=ring_allreduce
./entrypoint.sh`` runs your template.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab import p2p
from distlab.comm import check_reduce_op
from distlab.todo import todo


# --------------------------------------------------------------------------- helpers
def chunk_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """[start, end) of each rank's chunk; the first ``numel % world_size`` chunks get one extra
    element (``torch.tensor_split``'s rule), so chunks may be empty when numel < world_size."""
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def ring_exchange(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Send ``send`` to the right neighbour while receiving ``recv`` from the left one.

    One grouped launch (``distlab.p2p.send_recv``): posted one after the other, every
    rank would sit in its send (on NCCL a send waits for its receive) and the ring would
    deadlock; at W=2 both directions join the same two ranks. Empty tensors are skipped
    on both sides (both ends know the chunk sizes).

    Collective: all ranks of ``group`` call it together.
    Cost: ``send.nbytes`` out, ``recv.nbytes`` in.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    p2p.send_recv(send, (rank + 1) % world_size, recv, (rank - 1) % world_size, group)


_BUFFERS: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}  # (purpose, dtype, device)


def scratch(purpose: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable 1-D buffer of ``numel`` elements (one per purpose, dtype and device, grown on demand).

    Fresh buffers of tens of MiB on every call cost more in page faults than the ring's
    additions (a 64 MiB all-reduce ran 2.4x slower with them): keep them. Not thread-safe;
    its contents are garbage on entry.
    """
    key = (purpose, dtype, torch.device(device))
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


# --------------------------------------------------------------------------- the ring, step by step
def _ring_reduce_scatter_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In place on a flat contiguous tensor: afterwards chunk r of ``flat`` holds the sum over ranks
    (the other chunks hold partial sums)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)  # noqa: F841 (rank: for TODO 3.1)
    bounds = chunk_bounds(flat.numel(), world_size)
    incoming = scratch("incoming", bounds[0][1] - bounds[0][0], flat.dtype, flat.device)  # the largest chunk  # noqa: F841 (incoming: for TODO 3.1)
    # --- TODO 3.1: ring reduce-scatter ---
    # Goal: after W-1 ring steps, chunk `rank` of `flat` holds that chunk summed over all ranks.
    # At every step each rank passes one chunk to its right neighbour and adds the chunk that
    # arrives from its left into its own copy; which chunk travels at which step is the lesson.
    # Collective: all ranks of `group` step together, sending and receiving at once
    # (`ring_exchange`); chunks may differ in size by one, or be empty.
    raise todo("3.1 ring reduce-scatter", "guidelines.md#ring-all-reduce")
    # --- end TODO 3.1 ---


def _ring_all_gather_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In place on a flat contiguous tensor whose chunk r is final on rank r: afterwards every chunk
    is final everywhere."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)  # noqa: F841 (rank: for TODO 3.2)
    bounds = chunk_bounds(flat.numel(), world_size)  # noqa: F841 (bounds: for TODO 3.2)
    # --- TODO 3.2: ring all-gather ---
    # Goal: chunk c starts final on rank c only; after W-1 ring steps every chunk is final on
    # every rank. Each step forwards a chunk this rank already has to the right, and the chunk
    # from the left lands straight in its place in `flat`: copies only, no arithmetic.
    # Collective: all ranks of `group` step together (`ring_exchange`).
    raise todo("3.2 ring all-gather", "guidelines.md#ring-all-reduce")
    # --- end TODO 3.2 ---


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum",
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's chunk of the element-wise reduction of every rank's ``tensor``.

    Args:
        tensor: any shape, contiguous or not; not modified. Read flattened.
        op: "sum" or "avg" (floating tensors only).
        group: the process group (None: the whole world).

    Returns:
        A new 1-D tensor: elements ``chunk_bounds(N, W)[rank]`` of the reduced, flattened tensor
        (n_rank elements: the only allocation; the ring works in a reused buffer).

    Equivalent to: ``dist.reduce_scatter(out, list(tensor.flatten().tensor_split(W)))``.
    Collective: every rank of ``group`` must call it with the same numel and dtype.
    Cost: W-1 steps; sends N - n_rank elements ((W-1)/W * N bytes when W divides N).
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # The ring adds in place and `tensor` must stay intact: a working copy, in a reused buffer.
    flat = scratch("work", tensor.numel(), tensor.dtype, tensor.device)
    flat.copy_(tensor.detach().reshape(-1))
    _ring_reduce_scatter_(flat, group)
    start, end = chunk_bounds(flat.numel(), world_size)[rank]
    mine = flat[start:end].clone()
    if op == "avg":
        mine /= world_size
    return mine


def ring_all_gather(chunk: torch.Tensor, numel: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``chunk`` in rank order into a 1-D tensor of ``numel`` elements.

    Args:
        chunk: this rank's piece, ``chunk_bounds(numel, W)[rank]`` long.
        numel: the total length.

    Equivalent to: ``torch.cat`` of ``dist.all_gather`` (which needs equal sizes; this does not).
    Collective: every rank of ``group`` must call it with the same numel.
    Cost: W-1 steps; sends N - n_{rank+1} elements ((W-1)/W * N bytes when W divides N).
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    bounds = chunk_bounds(numel, world_size)
    start, end = bounds[rank]
    if chunk.numel() != end - start:
        raise ValueError(f"rank {rank} holds {chunk.numel()} elements, but chunk {rank} of {numel} elements "
                         f"split {world_size} ways has {end - start}")
    flat = torch.empty(numel, dtype=chunk.dtype, device=chunk.device)
    flat[start:end] = chunk.reshape(-1)
    _ring_all_gather_(flat, group)
    return flat


def ring_allreduce(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce in place: ring reduce-scatter, then ring all-gather.

    Equivalent to: ``dist.all_reduce(tensor)`` (then ``/ W`` for "avg").
    Collective: every rank of ``group`` must call it, with the same shape and dtype.
    Cost: 2(W-1) steps; sends 2(W-1)/W * N bytes per rank (N - n_r + N - n_{r+1} elements).
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)  # noqa: F841 (rank, world_size: for TODO 3.3)
    # Work in place when we can; a non-contiguous view needs a flat copy and a copy back.
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    # --- TODO 3.3: ring all-reduce ---
    # Goal: all-reduce `flat` in place by composing 3.1 and 3.2. For "avg", divide so that
    # each element is divided once and every rank ends bitwise equal (which chunk, and when?).
    raise todo("3.3 ring all-reduce", "guidelines.md#ring-all-reduce")
    # --- end TODO 3.3 ---
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --------------------------------------------------------------------------- pipelined

def _slices(start: int, end: int, per_slice: int) -> list[tuple[int, int]]:
    return [(s, min(s + per_slice, end)) for s in range(start, end, per_slice)]


def ring_allreduce_pipelined(tensor: torch.Tensor, op: str = "sum", group: dist.ProcessGroup | None = None,
                             slice_bytes: int = 1 << 22) -> torch.Tensor:
    """All-reduce in place, ring schedule, with slices streamed through the ring.

    Each chunk is cut into slices of ``slice_bytes``. A slice received in
    reduce-scatter step s is added and at once sent on as step s+1's slice, while
    the next slices are still on the wire; reduce-scatter receives go into a window
    of reused slot buffers, always posted ahead, and all-gather receives land directly
    in place. The last reduce-scatter step hands each finished slice straight to
    the all-gather, so the two phases overlap too.

    Equivalent to: ``dist.all_reduce(tensor)`` (then ``/ W`` for "avg").
    Collective: every rank of ``group`` must call it, with the same shape, dtype and slice_bytes.
    Cost: the same bytes as ``ring_allreduce`` (2(W-1)/W * N per rank), in more, smaller messages:
    2(W-1) * ceil(n / slice) sends; time ~ 2(W-1) alpha + 2(W-1)/W N beta + the adds, hidden.
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    bounds = chunk_bounds(flat.numel(), world_size)
    # Elements per slice, never more than the largest chunk (the same slices, smaller slots).
    per = max(1, min(slice_bytes // flat.element_size(), bounds[0][1] - bounds[0][0]))
    right, left = (rank + 1) % world_size, (rank - 1) % world_size  # noqa: F841 (right, left: for TODO 3.4)
    # Reduce-scatter receive slots, one slice each, one step's worth plus one (the launches in
    # flight), reused across calls: fresh buffers on every call cost more in page faults than the adds.
    window = -(-(bounds[0][1] - bounds[0][0]) // per) + 1
    slots = scratch("slots", window * per, flat.dtype, flat.device).view(window, per)  # noqa: F841 (slots: for TODO 3.4)
    # --- TODO 3.4: pipelined ring all-reduce ---
    # Goal: the result and the bytes of 3.3, but streamed: cut each chunk into slices of `per`
    # elements and never wait for a whole step. A slice is added and sent on at once while the
    # next ones are still on the wire; the last reduce-scatter step's slices start the all-gather.
    # Messages match by order only (no tags): the left neighbour sends its reduce-scatter
    # slices, then its all-gather slices, in (step, slice) order, and so does this rank. Launch j
    # (one `p2p.batch`) sends message j to the right and receives message j from the left, so
    # every send meets a posted receive (NCCL does not buffer); reduce-scatter slices land in
    # `slots` (slot j % window), all-gather slices straight in place.
    # Collective: every rank of `group` calls it with the same shape, dtype and slice_bytes.
    raise todo("3.4 pipelined ring all-reduce", "guidelines.md#pipelining-the-ring")
    # --- end TODO 3.4 ---
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
