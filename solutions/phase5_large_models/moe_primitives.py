"""Expert parallelism's communication primitive: an all-to-all with uneven splits, differentiable.

In an all-to-all every rank sends a (possibly different) number of rows to every
rank, itself included. ``dist.all_to_all_single(output, input, output_split_sizes,
input_split_sizes)`` sends ``input``'s j-th block of ``input_split_sizes[j]`` rows to
rank j and writes the block received from rank i into ``output``'s i-th block of
``output_split_sizes[i]`` rows. The sizes are uneven in a mixture-of-experts layer (a
router sends more tokens to some experts than to others), so every rank must know
what it will receive before the call: the layer exchanges the counts first.

The forward is a permutation of rows across ranks; its backward is the transpose of
that permutation: the gradient of each received row goes back where the row came
from, which is the same all-to-all with the two split lists swapped:

    forward : input  [in_splits]  --all-to-all-->  output [out_splits]
    backward: grad_in [in_splits] <--all-to-all--  grad_out [out_splits]

Why a hand-written autograd Function, not torch's differentiable functional collectives
(``torch.distributed._functional_collectives.all_to_all_single_autograd``): the
Function makes the transpose explicit (the lesson), and it calls
``dist.all_to_all_single``, which ``distlab.comm.CommLedger`` counts; the functional
collectives go through ``torch.ops._c10d_functional`` and bypass the ledger.
``torch.distributed.nn.functional.all_to_all_single`` is torch's twin of this function
(same signature); the template of moe.py uses it, so exercise 5.5 is graded on its own.

Cost per rank: forward sends |input| bytes (the block for itself never leaves the
rank), backward sends |output| bytes. See phase5_large_models/guidelines_experts.md#the-all-to-all.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAllSingle(torch.autograd.Function):
    """Uneven all-to-all forward; the same all-to-all with the splits swapped backward."""

    @staticmethod
    def forward(ctx, output, input, output_split_sizes, input_split_sizes, group):
        ctx.group = group
        ctx.input_shape = input.shape
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        # ### BEGIN SOLUTION 5.5a: all-to-all forward [guidelines_experts.md#the-all-to-all]
        # Goal: rank j receives input's j-th block (input_split_sizes[j] rows); the block that
        # came from rank i lands in output's i-th block (output_split_sizes[i] rows). Return output.
        # Collective: every rank of `group` calls it, and rank i's input_split_sizes[j] equals
        # rank j's output_split_sizes[i] (else a hang or an error).
        dist.all_to_all_single(output, input.contiguous(), output_split_sizes=output_split_sizes,
                               input_split_sizes=input_split_sizes, group=group)
        return output
        # ### END SOLUTION 5.5a

    @staticmethod
    def backward(ctx, grad_output):
        # ### BEGIN SOLUTION 5.5b: all-to-all backward [guidelines_experts.md#the-all-to-all]
        # Each output row is a copy of one input row of some rank: its gradient belongs to that
        # row, on that rank. Return the gradient of `input` (shape ctx.input_shape) in the
        # position of `input`, None for the other arguments (output, the two split lists, group).
        # Collective: every rank of the group runs this backward.
        grad_input = grad_output.new_empty(ctx.input_shape)
        dist.all_to_all_single(grad_input, grad_output.contiguous(), output_split_sizes=ctx.input_split_sizes,
                               input_split_sizes=ctx.output_split_sizes, group=ctx.group)
        return None, grad_input, None, None, None
        # ### END SOLUTION 5.5b


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None,
                      group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable ``dist.all_to_all_single`` with uneven splits along dim 0.

    Args:
        output: ``[sum(output_split_sizes), *rest]``, written in place and returned.
        input: ``[sum(input_split_sizes), *rest]``; block j goes to group rank j.
        output_split_sizes, input_split_sizes: rows per rank (None: equal blocks).
        group: the expert-parallel group (None: WORLD).

    Equivalent to: ``torch.distributed.nn.functional.all_to_all_single`` (same arguments);
    on one rank, ``output.copy_(input)``. Gradients flow to ``input`` (not to ``output``'s
    previous contents).
    Collective: every rank of ``group`` calls it, forward and backward, with matching
    sizes (rank i's ``input_split_sizes[j]`` == rank j's ``output_split_sizes[i]``).
    Cost: forward sends |input| bytes per rank, backward |output| bytes (the block a rank
    keeps for itself included, as ``CommLedger.bytes`` counts it).
    """
    return _AllToAllSingle.apply(output, input, output_split_sizes, input_split_sizes, group)
