"""The course's tensor parallelism and 2D grid, re-expressed with DeviceMesh, DTensor and FSDP2.

Phase 2 built Megatron's layers by hand: ``ColumnParallelLinear`` (rows of A per rank,
the conjugate f at its input), ``RowParallelLinear`` (columns of A, g = all-reduce at
its output), ``ParallelMLP``/``ParallelSelfAttention`` (enter the region once, leave it
once), sequence parallelism (all-gather/reduce-scatter along T instead), and a
``RankGrid`` of dp x tp process groups. Phase 3 built ZeRO-3. PyTorch names each piece:

    course (phases 2-3)                    torch.distributed
    RankGrid / build_grid                  init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    grid.tp_group, grid.dp_group           mesh["tp"], mesh["dp"]  (.get_group())
    ColumnParallelLinear                   ColwiseParallel()            weight Shard(0)
    RowParallelLinear                      RowwiseParallel()            weight Shard(1), bias Replicate
    copy_to_region once for q, k, v        PrepareModuleInput(..., use_local_output=False) on attn
    gather/reduce-scatter along T          SequenceParallel() on the LayerNorms + Shard(1) layouts
    FullyShardedDataParallel (ZeRO-3)      fully_shard(block, mesh=mesh["dp"]) per unit, then the root

A *plan* maps module paths to styles; ``parallelize_module`` swaps each named Linear's
weight for a DTensor (a local shard plus its placement on the mesh) and installs the
input/output hooks that redistribute activations: the same collectives as Phase 2.

Cost per block, per rank (B*T*d activations): tensor parallel, 2 all-reduces forward and
2 backward; with sequence parallelism 2 all-gathers + 2 reduce-scatters of B*T*d/W each
way instead (the same bytes on a ring). FSDP2 on the dp axis adds Phase 3's ZeRO-3
volume: two all-gathers and one reduce-scatter of the unit's parameters per step.
See phase5_large_models/guidelines_mesh.md.
Run: ``NPROC=4 RUN_MODE=device_mesh ./entrypoint.sh`` (demos/device_mesh.py).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from distlab.models import TinyGPT
from distlab.lessons.sync import check_divisible


def tinygpt_tp_plan(n_layer: int, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The parallelize plan of ``distlab.models.TinyGPT``'s blocks: module path -> style.

    Args:
        n_layer: number of blocks (``blocks.0`` ... ``blocks.{n_layer-1}``).
        sequence_parallel: keep the LayerNorms and residual stream split along the
            sequence (dim 1) between the blocks' parallel regions (Phase 2's 2.23-2.24).

    Embeddings, ``ln_f`` and the tied head stay replicated. The block input is a plain
    replicated (B, T, d) tensor and so is the last block's output.

    Equivalent to: Phase 2's ``ParallelBlock`` for every block (``ParallelSelfAttention``,
    ``ParallelMLP``; with sequence parallelism, ``sequence_parallel.py``'s block).
    Collective: the plan itself is data; the parallelized model's forward and backward
    run on every rank of the mesh.
    Cost per block: forward and backward each 2 all-reduces of B*T*d elements (with
    sequence_parallel: 2 all-gathers of B*T*d/W inputs and 2 reduce-scatters of B*T*d).
    """
    plan: dict[str, ParallelStyle] = {}
    # ### BEGIN SOLUTION 5.9: tensor-parallel plan for TinyGPT [guidelines_mesh.md#the-plan]
    # Goal: for every block, the styles that make it Phase 2's ParallelBlock: q, k, v and
    # fc column-parallel, both proj row-parallel (output whole again), and ONE entry into the
    # region for attention and one for the MLP (Phase 2's single copy_to_region: the test
    # counts one all-reduce per region backward, not one per Linear). With sequence_parallel:
    # the LayerNorms run on a sequence shard (dim 1), the regions gather it on entry and
    # reduce-scatter back to it on exit, the first block splits its input along the
    # sequence and the last gathers its output: plain replicated tensors outside the blocks.
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    for i in range(n_layer):
        b = f"blocks.{i}"
        for region in ("attn", "mlp"):
            # Inputs stay DTensors inside the region: q, k and v share one backward all-reduce.
            plan[f"{b}.{region}"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                       use_local_output=False)
        for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
            plan[f"{b}.{name}"] = ColwiseParallel()
        for name in ("attn.proj", "mlp.proj"):
            plan[f"{b}.{name}"] = RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel)
        if sequence_parallel:
            plan[f"{b}.ln1"] = SequenceParallel()
            plan[f"{b}.ln2"] = SequenceParallel()
    if sequence_parallel:
        plan["blocks.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),))
        plan[f"blocks.{n_layer - 1}"] = PrepareModuleOutput(output_layouts=(Shard(1),),
                                                            desired_output_layouts=(Replicate(),),
                                                            use_local_output=True)
    # ### END SOLUTION 5.9
    return plan


def build_mesh(world_size: int, tp_size: int, device_type: str = "cpu") -> DeviceMesh:
    """A dp x tp mesh of the world: ``tp_size`` neighbouring ranks per row, axes "dp" and "tp".

    ``device_type`` is where the ranks compute: "cpu", or "cuda" with one GPU per rank
    (a script passes ``env.device.type``); DTensor and FSDP2 put the shards there.

    Equivalent to: Phase 2's ``build_grid(tp_size)`` (rank = dp_rank * tp_size + tp_rank;
    ``mesh["tp"]`` is the row, ``mesh["dp"]`` the column).
    Collective: every rank must call it (it creates the groups of both axes).
    Cost: group creation only.
    """
    dp_size = check_divisible(world_size, tp_size, "world size", "--tp-size")
    # ### BEGIN SOLUTION 5.10a: the 2D device mesh [guidelines_mesh.md#the-2d-mesh]
    # Goal: the `device_type` mesh of shape (dp_size, tp_size) whose axes are named "dp" and "tp",
    # so that mesh["tp"] holds tp_size neighbouring ranks. Collective: every rank calls it.
    return init_device_mesh(device_type, (dp_size, tp_size), mesh_dim_names=("dp", "tp"))
    # ### END SOLUTION 5.10a


def parallelize_tinygpt(model: TinyGPT, mesh: DeviceMesh, sequence_parallel: bool = False) -> TinyGPT:
    """TinyGPT on a 2D mesh: the 5.9 plan on ``mesh["tp"]``, FSDP2 (ZeRO-3) on ``mesh["dp"]``.

    Every rank passes the same full model (same seed); it is sharded in place and returned.

    Equivalent to: single-process ``TinyGPT`` on the global batch, each dp rank taking its
    shard of it (the gradients are averaged over dp by FSDP2's reduce-scatter).
    Collective: construction, forward, backward and the optimizer step on every rank.
    Cost per step: the tensor-parallel activations in each row, plus per unit over the
    column two all-gathers and one reduce-scatter of its |params|/tp (Phase 3's 3 Psi).
    """
    if model.cfg.dropout:
        raise ValueError(f"dropout {model.cfg.dropout} needs a tensor-parallel RNG tracker; use dropout=0")
    # ### BEGIN SOLUTION 5.10b: tensor parallel, then FSDP2 over the data-parallel axis [guidelines_mesh.md#the-2d-mesh]
    # Goal: the rows split every block as the 5.9 plan says (on the tp axis only); then each
    # block, and last the root (it keeps the embeddings, ln_f and the tied head), becomes
    # one ZeRO-3 unit sharded over the dp axis. Collective: every rank, same order.
    parallelize_module(model, mesh["tp"], tinygpt_tp_plan(model.cfg.n_layer, sequence_parallel))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    # ### END SOLUTION 5.10b
    return model


class CommBytes(CommDebugMode):
    """``CommDebugMode`` that also adds up the payload bytes of DTensor's collectives, per op.

    DTensor communicates through functional collectives (``_c10d_functional``), which the
    ``distlab.comm.CommLedger`` cannot see; their first argument is this rank's input,
    the payload the ledger counts (the shard for an all-gather, the full buffer for a
    reduce-scatter or an all-reduce). FSDP2 calls ``dist.*`` functions: use the ledger.
    """

    def __init__(self) -> None:
        super().__init__()
        self.nbytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        functional = "functional" in getattr(func, "namespace", "")
        if sum(self.comm_counts.values()) > before and functional and torch.is_tensor(args[0]):
            self.nbytes[func._overloadpacket.__name__] += args[0].numel() * args[0].element_size()
        return out

    def calls(self) -> dict[str, int]:
        """DTensor's collectives so far by name (``all_reduce``, ``all_gather_into_tensor``, ...); the
        in-place ``dist.*`` ops (FSDP2's ``_allgather_base_``, ...) are left to the ledger."""
        return {packet.__name__: n for packet, n in self.comm_counts.items() if not packet.__name__.endswith("_")}
