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

from distlab.comm import check_reduce_op


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

    Both are posted before either is waited on: with two blocking calls, every
    rank would sit in ``send`` (or every rank in ``recv``) and the ring would
    deadlock once messages are too large to buffer. Empty tensors are skipped on
    both sides (both ends know the chunk sizes).

    Collective: all ranks of ``group`` call it together.
    Cost: ``send.nbytes`` out, ``recv.nbytes`` in.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    works = []
    if send.numel():
        works.append(dist.isend(send, group=group, group_dst=(rank + 1) % world_size))
    if recv.numel():
        works.append(dist.irecv(recv, group=group, group_src=(rank - 1) % world_size))
    for work in works:
        work.wait()


# --------------------------------------------------------------------------- the ring, step by step
def _ring_reduce_scatter_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In place on a flat contiguous tensor: afterwards chunk r of ``flat`` holds the sum over ranks
    (the other chunks hold partial sums)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    bounds = chunk_bounds(flat.numel(), world_size)
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype, device=flat.device)  # the largest chunk
    # ### BEGIN SOLUTION 3.1: ring reduce-scatter [guidelines.md#ring-all-reduce]
    # Goal: after W-1 ring steps, chunk `rank` of `flat` holds that chunk summed over all ranks.
    # At every step each rank passes one chunk to its right neighbour and adds the chunk that
    # arrives from its left into its own copy; which chunk travels at which step is the lesson.
    # Collective: all ranks of `group` step together, sending and receiving at once
    # (`ring_exchange`); chunks may differ in size by one, or be empty.
    for step in range(world_size - 1):
        # Send the chunk finished last step; the chunk arriving is one further back.
        s0, s1 = bounds[(rank - step - 1) % world_size]
        r0, r1 = bounds[(rank - step - 2) % world_size]
        ring_exchange(flat[s0:s1], incoming[:r1 - r0], group)
        flat[r0:r1] += incoming[:r1 - r0]
    # ### END SOLUTION 3.1


def _ring_all_gather_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In place on a flat contiguous tensor whose chunk r is final on rank r: afterwards every chunk
    is final everywhere."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    bounds = chunk_bounds(flat.numel(), world_size)
    # ### BEGIN SOLUTION 3.2: ring all-gather [guidelines.md#ring-all-reduce]
    # Goal: chunk c starts final on rank c only; after W-1 ring steps every chunk is final on
    # every rank. Each step forwards a chunk this rank already has to the right, and the chunk
    # from the left lands straight in its place in `flat`: copies only, no arithmetic.
    # Collective: all ranks of `group` step together (`ring_exchange`).
    for step in range(world_size - 1):
        # Forward the chunk received last step (own chunk first), straight into place.
        s0, s1 = bounds[(rank - step) % world_size]
        r0, r1 = bounds[(rank - step - 1) % world_size]
        ring_exchange(flat[s0:s1], flat[r0:r1], group)
    # ### END SOLUTION 3.2


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum",
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """This rank's chunk of the element-wise reduction of every rank's ``tensor``.

    Args:
        tensor: any shape, contiguous or not; not modified. Read flattened.
        op: "sum" or "avg" (floating tensors only).
        group: the process group (None: the whole world).

    Returns:
        A new 1-D tensor: elements ``chunk_bounds(N, W)[rank]`` of the reduced, flattened tensor.

    Equivalent to: ``dist.reduce_scatter(out, list(tensor.flatten().tensor_split(W)))``.
    Collective: every rank of ``group`` must call it with the same numel and dtype.
    Cost: W-1 steps; sends N - n_rank elements ((W-1)/W * N bytes when W divides N).
    """
    check_reduce_op(op, tensor)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    flat = tensor.detach().reshape(-1).clone()  # a private, contiguous working copy
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
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    # Work in place when we can; a non-contiguous view needs a flat copy and a copy back.
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.reshape(-1).clone()
    # ### BEGIN SOLUTION 3.3: ring all-reduce [guidelines.md#ring-all-reduce]
    # Goal: all-reduce `flat` in place by composing 3.1 and 3.2. For "avg", divide so that
    # each element is divided once and every rank ends bitwise equal (which chunk, and when?).
    _ring_reduce_scatter_(flat, group)
    if op == "avg":  # only the finished chunk: 1/W of the divisions, and every rank agrees bitwise
        start, end = chunk_bounds(flat.numel(), world_size)[rank]
        flat[start:end] /= world_size
    _ring_all_gather_(flat, group)
    # ### END SOLUTION 3.3
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --------------------------------------------------------------------------- pipelined
_RS, _AG = 0, 1  # message tags: reduce-scatter and all-gather slices never match each other
_WINDOW = 4  # reduce-scatter receives kept in flight (slot buffers of one slice each)


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
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    # Reduce-scatter receive slots, one slice each, reused: few, small allocations (a fresh
    # chunk-sized buffer per call would cost more in page faults than the adds).
    slots = torch.empty(_WINDOW, per, dtype=flat.dtype, device=flat.device)
    # ### BEGIN SOLUTION 3.4: pipelined ring all-reduce [guidelines.md#pipelining-the-ring]
    # Goal: the result and the bytes of 3.3, but streamed: cut each chunk into slices of `per`
    # elements and never wait for a whole step. A slice is added and sent on at once while the
    # next ones are still on the wire; receives are posted ahead (up to _WINDOW in `slots`);
    # the last reduce-scatter step's slices already start the all-gather. W == 1 works too.
    # Collective: every rank of `group` calls it with the same shape, dtype and slice_bytes.
    if world_size > 1:
        sends = []  # waited for at the very end: a sent slice is never written again

        def send(lo: int, hi: int, tag: int) -> None:
            sends.append(dist.isend(flat[lo:hi], group=group, group_dst=right, tag=tag))

        # gloo moves data only once both ends have posted (a rendezvous per message), so
        # receives are posted early. All-gather receives land in place, and only after
        # this rank has sent that region on (causality), so they are all posted now;
        # a separate tag keeps them from matching reduce-scatter messages.
        gathers = [(step, lo, hi, dist.irecv(flat[lo:hi], group=group, group_src=left, tag=_AG))
                   for step in range(world_size - 1)
                   for lo, hi in _slices(*bounds[(rank - step - 1) % world_size], per)]
        # Reduce-scatter slices arrive in (step, slice) order into the window of slots,
        # `window` receives always posted.
        incoming = [(step, lo, hi) for step in range(world_size - 1)
                    for lo, hi in _slices(*bounds[(rank - step - 2) % world_size], per)]
        window = min(_WINDOW, len(incoming))

        def post(i: int):
            _, lo, hi = incoming[i]
            return dist.irecv(slots[i % window, :hi - lo], group=group, group_src=left, tag=_RS)

        for lo, hi in _slices(*bounds[(rank - 1) % world_size], per):
            send(lo, hi, _RS)  # step 0: our own chunk r-1, as it is
        posted = [post(i) for i in range(window)]
        for i, (step, lo, hi) in enumerate(incoming):
            posted[i % window].wait()
            flat[lo:hi] += slots[i % window, :hi - lo]
            if i + window < len(incoming):
                posted[i % window] = post(i + window)  # the slot is free again
            last = step == world_size - 2
            if last and op == "avg":
                flat[lo:hi] /= world_size  # this slice of chunk r is final
            send(lo, hi, _AG if last else _RS)  # next step's data; all-gather step 0 when final
        # --- all-gather: forward each slice as it lands, except in the last step.
        for step, lo, hi, work in gathers:
            work.wait()
            if step < world_size - 2:
                send(lo, hi, _AG)
        for work in sends:
            work.wait()
    elif op == "avg":
        flat /= world_size
    # ### END SOLUTION 3.4
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor
