# Generated from solutions/phase2_advanced/tensor_parallel.py by `python -m distlab.templates --write`.
# Write your code inside the '--- TODO' regions, in place of their `raise todo(...)`.
"""Tensor parallelism (Megatron-LM): split every weight matrix of a layer across ranks.

``y = x A^T`` splits two ways (Shoeybi et al. 2019, Fig. 3): column-parallel (rank r
holds rows r of ``A``: whole ``x`` in, a slice of ``y`` out) and row-parallel (columns
r: a slice of ``x`` in, a partial sum of ``y`` out). A column layer then a row layer
(the MLP; q/k/v then the output projection, heads split) needs no communication in
between; at the boundaries stand tp_primitives.py's f (``copy_to_region``) and g
(``reduce_from_region``). The template uses the bench's copy of those, ``distlab.lessons.tp``.

Cost per transformer block, per rank: forward 2 all-reduces (attention and MLP
outputs), backward 2, each of B*T*d elements. The vocab-parallel cross-entropy adds
three all-reduces of B*T values instead of gathering B*T*V logits.
See phase2_advanced/guidelines_model_parallel.md#tensor-parallelism.
Run: ``RUN_MODE=tensor_parallel ./entrypoint.sh`` (TinyGPT, tensor-parallel across all ranks).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F  # noqa: F401 (F: for TODO 2.17a, 2.17b, 2.18a, 2.18b, 2.19a, 2.20)

from distlab.models import MLP, Block, CausalSelfAttention, TinyGPT
from distlab.lessons.sync import check_divisible
from distlab.lessons.tp import load_shards, mark_sharded
from distlab.lessons.tp import copy_to_region, gather_from_region, reduce_from_region, scatter_to_region  # noqa: F401 (copy_to_region: for TODO 2.17a, 2.18a, 2.18b, 2.20; gather_from_region: for TODO 2.17a; reduce_from_region: for TODO 2.17b, 2.18a, 2.18b, 2.19a, 2.19b; scatter_to_region: for TODO 2.17b)
from distlab.todo import todo


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by rows: rank r computes output features slice r.

    Args: the *full* layer's sizes (out_features % W == 0); ``gather_output``: all-gather
    the output slices into the full ``(..., out_features)``.

    Equivalent to: ``nn.Linear(in_features, out_features)`` (slice r of its output).
    Collective: backward all-reduces dL/dx over ``group`` (and forward gathers if asked).
    Cost: backward one all-reduce of |x|; with gather_output, forward one all-gather of |y|/W.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        local_out = check_divisible(out_features, dist.get_world_size(group), "out_features", "tensor-parallel size")
        self.weight = mark_sharded(nn.Parameter(torch.randn(local_out, in_features, dtype=dtype) * 0.02), 0)
        self.bias = mark_sharded(nn.Parameter(torch.zeros(local_out, dtype=dtype)), 0) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False,
                    group: dist.ProcessGroup | None = None) -> "ColumnParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (same values, no communication)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                    linear.weight.dtype)
        return load_shards(layer, linear, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.17a: column-parallel forward ---
        # Goal: this rank's slice of y = x A^T + b (the whole y if self.gather_output). x is
        # replicated and every rank's slice used all of it: its gradient must come back whole.
        # Communicate only through the conjugate functions.
        raise todo("2.17a column-parallel forward", "guidelines_model_parallel.md#column-and-row-parallel-linear")
        # --- end TODO 2.17a ---


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by columns: rank r multiplies input slice r, then sum.

    Args: the *full* layer's sizes (in_features % W == 0); ``input_is_parallel``: the input
    is already split (a column layer's output); if False, the replicated input is split here.

    Equivalent to: ``nn.Linear(in_features, out_features)``; the output is replicated.
    Collective: forward all-reduces the partial products over ``group``.
    Cost: forward one all-reduce of |y|; backward none (an all-gather of |x|/W if not input_is_parallel).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        local_in = check_divisible(in_features, dist.get_world_size(group), "in_features", "tensor-parallel size")
        self.weight = mark_sharded(nn.Parameter(torch.randn(out_features, local_in, dtype=dtype) * 0.02), 1)
        # Replicated: added once, after the sum (adding it on every rank would count it W times).
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = True,
                    group: dist.ProcessGroup | None = None) -> "RowParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (same values, no communication)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                    linear.weight.dtype)
        return load_shards(layer, linear, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.17b: row-parallel forward ---
        # Goal: the whole, replicated y = x A^T + b. This rank's columns of A multiply only
        # its slice of x (split a replicated x first unless self.input_is_parallel): a
        # partial sum of y. The replicated bias must count once, not W times.
        raise todo("2.17b row-parallel forward", "guidelines_model_parallel.md#column-and-row-parallel-linear")
        # --- end TODO 2.17b ---


class ParallelMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with fc column-parallel and proj row-parallel: no communication between.

    Equivalent to: ``distlab.models.MLP`` (dropout 0).
    Collective: every rank of ``group`` runs forward and backward.
    Cost: forward one all-reduce of |x|; backward one all-reduce of |x|.
    """

    def __init__(self, n_embd: int, hidden: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        self.fc = ColumnParallelLinear(n_embd, hidden, bias, gather_output=False, group=group, dtype=dtype)
        self.proj = RowParallelLinear(hidden, n_embd, bias, input_is_parallel=True, group=group, dtype=dtype)

    @classmethod
    def from_mlp(cls, mlp: MLP, group: dist.ProcessGroup | None = None) -> "ParallelMLP":
        layer = cls(mlp.fc.in_features, mlp.fc.out_features, mlp.fc.bias is not None, group, mlp.fc.weight.dtype)
        return load_shards(layer, mlp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.18a: parallel MLP ---
        # Goal: MLP(x), replicated, from this rank's shards self.fc (rows) and self.proj (columns).
        # Enter the region once, leave it once: one all-reduce forward, one backward (the
        # test counts). Use the layers' weights directly; the proj bias counts once.
        raise todo("2.18a parallel MLP", "guidelines_model_parallel.md#parallel-mlp-and-attention")
        # --- end TODO 2.18a ---


class ParallelSelfAttention(nn.Module):
    """Causal self-attention, n_head/W heads per rank: q, k, v column-parallel (whole heads), proj row-parallel.

    Equivalent to: ``distlab.models.CausalSelfAttention`` (dropout 0).
    Collective: every rank of ``group`` runs forward and backward.
    Cost: forward one all-reduce of |x| (after proj); backward one (q, k, v share one f).
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        self.local_heads = check_divisible(n_head, dist.get_world_size(group), "n_head", "tensor-parallel size")
        self.head_dim = n_embd // n_head
        self.q, self.k, self.v = (ColumnParallelLinear(n_embd, n_embd, bias, group=group, dtype=dtype)
                                  for _ in range(3))
        self.proj = RowParallelLinear(n_embd, n_embd, bias, input_is_parallel=True, group=group, dtype=dtype)

    @classmethod
    def from_attention(cls, attn: CausalSelfAttention, group: dist.ProcessGroup | None = None
                       ) -> "ParallelSelfAttention":
        layer = cls(attn.q.in_features, attn.n_head, attn.q.bias is not None, group, attn.q.weight.dtype)
        return load_shards(layer, attn, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # --- TODO 2.18b: attention with local heads ---
        # Goal: CausalSelfAttention(x), replicated, from this rank's self.local_heads heads only
        # (attention is per head, so local). Enter the region once for all three projections
        # and leave it once after proj (bias once): one all-reduce forward, one backward.
        raise todo("2.18b attention with local heads", "guidelines_model_parallel.md#parallel-mlp-and-attention")
        # --- end TODO 2.18b ---


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split: rank r holds rows [r*V/W, (r+1)*V/W).

    Equivalent to: ``nn.Embedding(num_embeddings, embedding_dim)``.
    Collective: forward all-reduces over ``group``.
    Cost: forward one all-reduce of |output| (B*T*d); backward none.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        local = check_divisible(num_embeddings, dist.get_world_size(group), "vocab size", "tensor-parallel size")
        self.vocab_start = dist.get_rank(group) * local
        self.weight = mark_sharded(nn.Parameter(torch.randn(local, embedding_dim, dtype=dtype) * 0.02), 0)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: dist.ProcessGroup | None = None) -> "VocabParallelEmbedding":
        return load_shards(cls(emb.num_embeddings, emb.embedding_dim, group, emb.weight.dtype), emb, group)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.19a: vocab-parallel embedding ---
        # Goal: the (..., d) embeddings of idx, replicated. This rank owns rows
        # [self.vocab_start, self.vocab_start + local rows) only: it contributes those tokens'
        # rows and zeros elsewhere (never index out of range); the ranks' parts then add up.
        raise todo("2.19a vocab-parallel embedding", "guidelines_model_parallel.md#vocab-parallel-embedding-and-cross-entropy")
        # --- end TODO 2.19a ---


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross-entropy from vocab-split logits, without gathering them.

    Args:
        logits: (N, V/W), this rank's vocab slice [rank*V/W, (rank+1)*V/W).
        targets: (N,) token ids in [0, V), the same on every rank.

    Returns (N,) losses, the same on every rank. Equivalent to: ``F.cross_entropy(full_logits, targets, reduction="none")``.
    Collective: every rank of ``group`` must call it.
    Cost: three all-reduces of N values forward (max, sum of exps, target logit);
    none backward (instead of an all-gather of N*V logits).
    """
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab  # noqa: F841 (start: for TODO 2.19b)
    # --- TODO 2.19b: vocab-parallel cross-entropy ---
    # Goal: log(sum_v exp z_v) - z_target per token from this rank's slice, stable (shift by the
    # max over the WHOLE vocabulary); at most three reductions of N values, never the N*V logits.
    # Sum over ranks so that each rank's logits get softmax - one-hot, with no custom backward.
    raise todo("2.19b vocab-parallel cross-entropy", "guidelines_model_parallel.md#vocab-parallel-embedding-and-cross-entropy")
    # --- end TODO 2.19b ---


class ParallelBlock(nn.Module):
    """A transformer block with parallel attention and MLP; LayerNorms replicated."""

    def __init__(self, block: Block, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        # Replicated LayerNorms: same values on every rank; f's backward makes their gradients whole.
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        self.attn = ParallelSelfAttention.from_attention(block.attn, group)
        self.mlp = ParallelMLP.from_mlp(block.mlp, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelGPT(nn.Module):
    """``distlab.models.TinyGPT`` split across the ranks of ``group``, from a full model's weights.

    Parameter names match TinyGPT's; sharded ones carry ``partition_dim``. The LM head
    is tied to the vocab-parallel embedding, so it is column-parallel over the vocabulary
    and its logits stay split: the loss is ``vocab_parallel_cross_entropy``.

    Equivalent to: ``TinyGPT`` (its logits are ``gather_from_region(forward(idx))``).
    Collective: every rank of ``group`` runs forward and backward on the same tokens.
    Cost per step: 2 all-reduces of B*T*d per block forward and 2 backward, one for the
    embedding forward, one for the head backward, 3 of B*T for the loss.
    """

    def __init__(self, gpt: TinyGPT, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        if gpt.cfg.dropout:
            raise ValueError(f"dropout {gpt.cfg.dropout} needs a tensor-parallel RNG tracker; use dropout=0")
        self.cfg, self.group = gpt.cfg, group
        self.wte = VocabParallelEmbedding.from_embedding(gpt.wte, group)
        self.wpe = copy.deepcopy(gpt.wpe)  # replicated: tiny, and every rank needs every position
        self.blocks = nn.ModuleList(ParallelBlock(b, group) for b in gpt.blocks)
        self.ln_f = copy.deepcopy(gpt.ln_f)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx (B, T) -> this rank's logits (B, T, V/W); with targets also the mean loss (replicated)."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        # --- TODO 2.20: tied head and loss ---
        # Goal: this rank's (B, T, V/W) logits from the head tied to self.wte (a column-parallel
        # layer over the vocabulary, no bias) applied to ln_f(x); with targets, also the mean
        # loss over all tokens, replicated, computed from the split logits.
        raise todo("2.20 tied head and loss", "guidelines_model_parallel.md#tensor-parallel-tinygpt")
        # --- end TODO 2.20 ---
