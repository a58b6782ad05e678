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

Run the demo: ``RUN_MODE=ring_allreduce ./entrypoint.sh`` (or ``torchrun
--nproc_per_node=4 -m solutions.phase3_multi_node.ring_allreduce``).
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

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
    incoming = torch.empty(bounds[0][1] - bounds[0][0], dtype=flat.dtype, device=flat.device)
    # --- TODO 3.1: ring reduce-scatter ---
    # W-1 steps. At step s, rank r sends chunk (r - s - 1) % W (the one it finished adding
    # last step; at step 0 its own data) to the right and receives chunk (r - s - 2) % W
    # from the left into `incoming[:size]`, then adds it into flat[start:end] of that chunk.
    # After the last step chunk r is the full sum. Use ring_exchange(send, recv, group), and
    # bounds[c] = (start, end) of chunk c; chunks may be empty (ring_exchange skips them).
    raise todo("3.1 ring reduce-scatter", "guidelines.md#ring-all-reduce")
    # --- end TODO 3.1 ---


def _ring_all_gather_(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """In place on a flat contiguous tensor whose chunk r is final on rank r: afterwards every chunk
    is final everywhere."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    bounds = chunk_bounds(flat.numel(), world_size)
    # --- TODO 3.2: ring all-gather ---
    # W-1 steps. At step s, rank r sends chunk (r - s) % W (its own first, then the one it
    # received last step) to the right and receives chunk (r - s - 1) % W from the left,
    # straight into its place in `flat` (no temporary, no arithmetic).
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
    # --- TODO 3.3: ring all-reduce = reduce-scatter + all-gather ---
    # Reduce-scatter `flat` in place (_ring_reduce_scatter_), divide only this rank's
    # finished chunk by world_size for "avg" (chunk_bounds(...)[rank]), then all-gather
    # in place (_ring_all_gather_). Division before the all-gather means every rank
    # ends with bitwise the same tensor.
    raise todo("3.3 ring all-reduce", "guidelines.md#ring-all-reduce")
    # --- end TODO 3.3 ---
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
    # --- TODO 3.4: pipelined ring ---
    # Same schedule as 3.1 + 3.3, but in slices of `per = max(1, slice_bytes // element_size)`
    # elements (_slices(start, end, per) lists them), never waiting for a whole step:
    #   1. reduce-scatter step 0: isend every slice of chunk (r-1) % W to the right at once
    #      (keep the Work objects in a list; wait for all sends at the very end).
    #   2. reduce-scatter receives: the slices of chunk (r - s - 2) % W for s = 0..W-2, in that
    #      order, all from the left with tag=_RS. Keep _WINDOW of them posted at once, each into
    #      its own slot of `slots = torch.empty(window, per)`; re-post a slot as soon as it is used.
    #   3. wait slice by slice: add it into `flat`, and isend that same slice to the right at
    #      once (it is step s+1's data; in the last step it is final: divide for "avg" first,
    #      and send it with tag=_AG: it is the all-gather's step 0).
    #   4. all-gather: irecv (tag=_AG) every slice of chunk (r - s - 1) % W for each step s
    #      straight into `flat`, posted BEFORE step 1 (gloo moves data only when both ends have
    #      posted); wait in order and forward each slice (tag=_AG) except in the last step.
    # W == 1: no communication; just divide for "avg".
    raise todo("3.4 pipelined ring all-reduce", "guidelines.md#pipelining-the-ring")
    # --- end TODO 3.4 ---
    if not tensor.is_contiguous():
        tensor.copy_(flat.view(tensor.shape))
    return tensor


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    from benchmarks.common import median, time_repeats
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.25, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        torch.set_num_threads(1)  # one core per rank for the adds; gloo's I/O threads need the rest
        W = env.world_size
        contenders = {"ring": ring_allreduce, "ring pipelined": ring_allreduce_pipelined,
                      "dist.all_reduce": lambda t: dist.all_reduce(t)}
        # Correctness first: a size that does not divide by W, against the built-in.
        for name, fn in contenders.items():
            x = torch.randn(1001, generator=torch.Generator().manual_seed(env.rank)).to(env.device)
            expected = x.clone()
            dist.all_reduce(expected)
            fn(x)
            torch.testing.assert_close(x, expected)  # summation order differs: float32 rounding
        log0(f"correct on {W} ranks: ring and pipelined ring match dist.all_reduce (1001 floats)")
        rows = []
        for mb in args.sizes_mb:
            x = torch.randn(int(mb * (1 << 20)) // 4).to(env.device)
            row = {"size": format_bytes(x.nbytes)}
            for name, fn in contenders.items():
                t = median(time_repeats(lambda: fn(x), args.repeats, sync=dist.barrier))
                row[f"{name} ms"] = f"{t * 1e3:.2f}"
                row[f"{name} busbw GB/s"] = f"{x.nbytes / t * 2 * (W - 1) / W / 1e9:.2f}"
            rows.append(row)
        log0(f"\n== all-reduce on {W} ranks ({env.backend}), median of {args.repeats} ==")
        log0(format_table(rows))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
