"""Tensor parallelism (Megatron-LM): split every weight matrix of a layer across ranks.

A linear layer ``y = x A^T`` can be split two ways (Shoeybi et al. 2019, Fig. 3):

* column-parallel: rank r holds the rows r of ``A`` (a slice of the *output*
  features): its input must be the whole ``x``, its output is a slice of ``y``;
* row-parallel: rank r holds the columns r of ``A`` (a slice of the *input*
  features): its input is a slice of ``x``, its output a partial sum of ``y``.

A column layer followed by a row layer (the MLP, or q/k/v then the output
projection with the heads split) needs no communication in between; at the
boundaries stand two *conjugate* operators:

    f = copy_to_region      forward: identity       backward: all-reduce
    g = reduce_from_region  forward: all-reduce     backward: identity

and, to gather a split output or split a whole input, the pair
``gather_from_region`` (all-gather / keep own slice) and ``scatter_to_region``.
Getting a backward wrong (an all-reduce where the identity belongs) multiplies
gradients by the tensor-parallel size: the tests run at W = 2, 3 and 4.

Cost per transformer block, per rank (B*T*d activations of ``e`` bytes each):
forward 2 all-reduces (attention output, MLP output), backward 2 (the gradient
entering attention and MLP), each of B*T*d*e bytes. The vocab-parallel cross-entropy
adds three all-reduces of B*T values (max, sum of exps, target logit) instead of
gathering B*T*V logits.

See phase2_advanced/guidelines_model_parallel.md#tensor-parallelism.
Run: ``RUN_MODE=tensor_parallel ./entrypoint.sh`` (TinyGPT, tensor-parallel across all ranks).
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distlab.models import MLP, Block, CausalSelfAttention, GPTConfig, TinyGPT
from distlab.todo import todo


def divide(n: int, world_size: int, what: str) -> int:
    """``n // world_size``, or a ValueError that shows the arithmetic."""
    if n % world_size:
        raise ValueError(f"{what} {n} is not divisible by tensor-parallel size {world_size} "
                         f"({n} = {n // world_size} * {world_size} + {n % world_size})")
    return n // world_size


def _shard(t: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """This rank's contiguous slice of ``t`` along ``dim`` (a copy)."""
    world_size = dist.get_world_size(group)
    divide(t.shape[dim], world_size, f"dimension {dim} of size")
    return t.detach().chunk(world_size, dim)[dist.get_rank(group)].clone()


# --------------------------------------------------------------------------- primitives
class _CopyToRegion(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # --- TODO 2.15: copy_to_region forward ---
        # Identity. Return a new view of x (x.view_as(x)), not x itself, so autograd
        # records this Function.
        raise todo("2.15 copy_to_region forward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.15 ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.15: copy_to_region backward ---
        # Each rank holds a partial dL/dx (its slice of the next layer used all of x).
        # Sum them: all-reduce a contiguous clone of grad over ctx.group (never modify
        # grad in place). Return (gradient for x, None for group).
        raise todo("2.15 copy_to_region backward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.15 ---


class _ReduceFromRegion(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        # --- TODO 2.15: reduce_from_region forward ---
        # Sum the partial results: all-reduce a contiguous clone of x over group.
        raise todo("2.15 reduce_from_region forward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.15 ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.15: reduce_from_region backward ---
        # The output is replicated: every rank already holds the whole dL/dout.
        # What must the gradient of x be? (Think before you all-reduce: the tests run at W=2,3,4.)
        raise todo("2.15 reduce_from_region backward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.15 ---


class _GatherFromRegion(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # --- TODO 2.16: gather_from_region forward ---
        # dist.all_gather into W empty_like buffers (x made contiguous), then
        # torch.cat along the last dim, in group-rank order.
        raise todo("2.16 gather_from_region forward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.16 ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.16: gather_from_region backward ---
        # Keep this rank's slice of the last dim: grad.chunk(W, -1)[rank] (contiguous).
        # Use dist.get_world_size(ctx.group) / dist.get_rank(ctx.group).
        raise todo("2.16 gather_from_region backward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.16 ---


class _ScatterToRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        # --- TODO 2.16: scatter_to_region forward ---
        # This rank's slice of the last dim, made contiguous (no communication).
        raise todo("2.16 scatter_to_region forward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.16 ---

    @staticmethod
    def backward(ctx, grad):
        # --- TODO 2.16: scatter_to_region backward ---
        # Every rank's slice gradient, concatenated: the conjugate of the forward.
        raise todo("2.16 scatter_to_region backward", "phase2_advanced/guidelines_model_parallel.md#the-conjugate-functions")
        # --- end TODO 2.16 ---


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Enter a tensor-parallel region with a replicated input ("f" in Megatron).

    Equivalent to: ``x`` (forward); the gradient is the sum of every rank's gradient.
    Collective: in backward, every rank of ``group`` all-reduces (so all must run backward).
    Cost: none forward; one all-reduce of |x| bytes backward (none when W == 1).
    """
    return x if dist.get_world_size(group) == 1 else _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Leave a tensor-parallel region by summing partial results ("g" in Megatron).

    Equivalent to: ``sum(x_r for r in ranks)`` (forward); the gradient passes through unchanged.
    Collective: every rank of ``group`` must call it in forward.
    Cost: one all-reduce of |x| bytes forward; none backward (none at all when W == 1).
    """
    return x if dist.get_world_size(group) == 1 else _ReduceFromRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's slice along the last dim (a column layer's full output).

    Equivalent to: ``torch.cat([x_0, ..., x_{W-1}], dim=-1)``; backward keeps this rank's slice.
    Collective: every rank of ``group`` must call it in forward, with equal shapes.
    Cost: one all-gather of |x| bytes per rank forward (receives (W-1)|x|); none backward.
    """
    return x if dist.get_world_size(group) == 1 else _GatherFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Keep this rank's slice of the last dim of a replicated ``x`` (a row layer's input).

    Equivalent to: ``x.chunk(W, -1)[rank]``; backward all-gathers the slices' gradients.
    Collective: in backward, every rank of ``group`` all-gathers.
    Cost: none forward; one all-gather of |x|/W bytes per rank backward.
    """
    world_size = dist.get_world_size(group)
    divide(x.shape[-1], world_size, "last dimension")
    return x if world_size == 1 else _ScatterToRegion.apply(x, group)


# --------------------------------------------------------------------------- layers
def _mark(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag a sharded parameter with the dim it is split along (tests map it to the full one)."""
    param.partition_dim = dim
    return param


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by rows: rank r computes output features slice r.

    Args:
        in_features, out_features: the *full* layer's sizes; out_features % W == 0.
        gather_output: all-gather the output slices into the full ``(..., out_features)``.

    Equivalent to: ``nn.Linear(in_features, out_features)`` (slice r of its output).
    Collective: backward all-reduces dL/dx over ``group`` (and forward gathers if asked).
    Cost: backward one all-reduce of |x|; with gather_output, forward one all-gather of |y|/W.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.gather_output = group, gather_output
        local_out = divide(out_features, dist.get_world_size(group), "out_features")
        self.weight = _mark(nn.Parameter(torch.randn(local_out, in_features, dtype=dtype) * 0.02), 0)
        self.bias = _mark(nn.Parameter(torch.zeros(local_out, dtype=dtype)), 0) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, gather_output: bool = False,
                    group: dist.ProcessGroup | None = None) -> "ColumnParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (same values, no communication)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                    linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(_shard(linear.weight, 0, group))
            if linear.bias is not None:
                layer.bias.copy_(_shard(linear.bias, 0, group))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.17: column-parallel forward ---
        # 1. x enters the parallel region (its gradient must be summed over ranks);
        # 2. the local matmul with this rank's rows of A (and bias slice);
        # 3. gather the output slices if self.gather_output.
        raise todo("2.17 column-parallel forward", "phase2_advanced/guidelines_model_parallel.md#column-and-row-parallel-linear")
        # --- end TODO 2.17 ---


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A`` split by columns: rank r multiplies input slice r, then sum.

    Args:
        in_features, out_features: the *full* layer's sizes; in_features % W == 0.
        input_is_parallel: the input is already split (a column layer's output); if
            False, the replicated input is split here.

    Equivalent to: ``nn.Linear(in_features, out_features)``; the output is replicated.
    Collective: forward all-reduces the partial products over ``group``.
    Cost: forward one all-reduce of |y|; backward none (an all-gather of |x|/W if not input_is_parallel).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group, self.input_is_parallel = group, input_is_parallel
        local_in = divide(in_features, dist.get_world_size(group), "in_features")
        self.weight = _mark(nn.Parameter(torch.randn(out_features, local_in, dtype=dtype) * 0.02), 1)
        # Replicated: added once, after the sum (adding it on every rank would count it W times).
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_is_parallel: bool = True,
                    group: dist.ProcessGroup | None = None) -> "RowParallelLinear":
        """This rank's shard of a full ``nn.Linear`` (same values, no communication)."""
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                    linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(_shard(linear.weight, 1, group))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.17: row-parallel forward ---
        # 1. split a replicated input if not self.input_is_parallel;
        # 2. the local matmul gives a partial sum of y: sum it over the ranks;
        # 3. add the (replicated) bias once, after the sum.
        raise todo("2.17 row-parallel forward", "phase2_advanced/guidelines_model_parallel.md#column-and-row-parallel-linear")
        # --- end TODO 2.17 ---


class ParallelMLP(nn.Module):
    """``proj(gelu(fc(x)))`` with fc column-parallel and proj row-parallel: no communication between.

    Equivalent to: ``distlab.models.MLP`` (dropout 0).
    Collective: every rank of ``group`` runs forward and backward.
    Cost: forward one all-reduce of |x|; backward one all-reduce of |x|.
    """

    def __init__(self, n_embd: int, hidden: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(n_embd, hidden, bias, gather_output=False, group=group, dtype=dtype)
        self.proj = RowParallelLinear(hidden, n_embd, bias, input_is_parallel=True, group=group, dtype=dtype)

    @classmethod
    def from_mlp(cls, mlp: MLP, group: dist.ProcessGroup | None = None) -> "ParallelMLP":
        layer = cls(mlp.fc.in_features, mlp.fc.out_features, mlp.fc.bias is not None, group, mlp.fc.weight.dtype)
        layer.fc = ColumnParallelLinear.from_linear(mlp.fc, gather_output=False, group=group)
        layer.proj = RowParallelLinear.from_linear(mlp.proj, input_is_parallel=True, group=group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # gelu is elementwise: it runs on the slice as is


class ParallelSelfAttention(nn.Module):
    """Causal self-attention with the heads split across ranks: n_head/W heads per rank.

    q, k and v are column-parallel (their output features are whole heads), the
    output projection row-parallel; attention itself is per head, so local.

    Equivalent to: ``distlab.models.CausalSelfAttention`` (dropout 0).
    Collective: every rank of ``group`` runs forward and backward.
    Cost: forward one all-reduce of |x| (after proj); backward one all-reduce of |x|
    (the three column layers share one copy_to_region).
    """

    def __init__(self, n_embd: int, n_head: int, bias: bool = True, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.group = group
        self.local_heads = divide(n_head, dist.get_world_size(group), "n_head")
        self.head_dim = n_embd // n_head
        self.q, self.k, self.v = (ColumnParallelLinear(n_embd, n_embd, bias, group=group, dtype=dtype)
                                  for _ in range(3))
        self.proj = RowParallelLinear(n_embd, n_embd, bias, input_is_parallel=True, group=group, dtype=dtype)

    @classmethod
    def from_attention(cls, attn: CausalSelfAttention, group: dist.ProcessGroup | None = None
                       ) -> "ParallelSelfAttention":
        n_embd = attn.q.in_features
        layer = cls(n_embd, attn.n_head, attn.q.bias is not None, group, attn.q.weight.dtype)
        for name in ("q", "k", "v"):
            setattr(layer, name, ColumnParallelLinear.from_linear(getattr(attn, name), group=group))
        layer.proj = RowParallelLinear.from_linear(attn.proj, input_is_parallel=True, group=group)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # --- TODO 2.18: attention with local heads ---
        # 1. copy_to_region(x) ONCE, then F.linear(x, m.weight, m.bias) for m in q, k, v
        #    (calling self.q(x) would copy three times: three all-reduces backward);
        # 2. view each as (B, T, self.local_heads, self.head_dim), transpose(1, 2);
        # 3. F.scaled_dot_product_attention(q, k, v, is_causal=True);
        # 4. back to (B, T, local_heads * head_dim) and through the row-parallel self.proj.
        raise todo("2.18 attention with local heads", "phase2_advanced/guidelines_model_parallel.md#parallel-mlp-and-attention")
        # --- end TODO 2.18 ---


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
        local = divide(num_embeddings, dist.get_world_size(group), "vocab size")
        self.vocab_start = dist.get_rank(group) * local
        self.weight = _mark(nn.Parameter(torch.randn(local, embedding_dim, dtype=dtype) * 0.02), 0)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group: dist.ProcessGroup | None = None) -> "VocabParallelEmbedding":
        layer = cls(emb.num_embeddings, emb.embedding_dim, group, emb.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(_shard(emb.weight, 0, group))
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # --- TODO 2.19: vocab-parallel embedding ---
        # Shift ids by self.vocab_start; ids outside [0, local rows) belong to another
        # rank: look up row 0 for them, then zero those outputs; sum over ranks.
        raise todo("2.19 vocab-parallel embedding", "phase2_advanced/guidelines_model_parallel.md#vocab-parallel-embedding-and-cross-entropy")
        # --- end TODO 2.19 ---


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross-entropy from vocab-split logits, without gathering them.

    Args:
        logits: (N, V/W), this rank's vocab slice [rank*V/W, (rank+1)*V/W).
        targets: (N,) token ids in [0, V), the same on every rank.

    Returns: (N,) losses, the same on every rank.
    Equivalent to: ``F.cross_entropy(full_logits, targets, reduction="none")``.
    Collective: every rank of ``group`` must call it.
    Cost: three all-reduces of N values forward (max, sum of exps, target logit);
    none backward (instead of an all-gather of N*V logits).
    """
    local_vocab = logits.shape[-1]
    start = dist.get_rank(group) * local_vocab
    # --- TODO 2.19: vocab-parallel cross-entropy ---
    # loss = log(sum_v exp(z_v - m)) - (z_target - m), m the global max (detached;
    # all-reduce with op=dist.ReduceOp.MAX when W > 1). The sum of exps and the
    # target logit (zero on ranks that do not own the target) are sums over ranks:
    # reduce_from_region makes them whole AND gives the right gradient.
    raise todo("2.19 vocab-parallel cross-entropy", "phase2_advanced/guidelines_model_parallel.md#vocab-parallel-embedding-and-cross-entropy")
    # --- end TODO 2.19 ---


# --------------------------------------------------------------------------- TinyGPT
class ParallelBlock(nn.Module):
    """A transformer block with parallel attention and MLP; LayerNorms replicated."""

    def __init__(self, block: Block, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        # LayerNorm inputs and outputs are replicated: every rank computes the same
        # values, and copy_to_region's backward makes their gradients whole.
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
    Cost per step: 2 all-reduces of B*T*d per block forward and 2 backward, one more
    for the embedding forward and one for the head backward, 3 of B*T for the loss.
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
        # --- TODO 2.20: tied vocab-parallel head and loss ---
        # The head reuses self.wte.weight (V/W rows): a column-parallel linear without
        # bias on ln_f(x). Return the logits slice if targets is None; otherwise also
        # the mean of vocab_parallel_cross_entropy over the flattened tokens.
        raise todo("2.20 tied head and loss", "phase2_advanced/guidelines_model_parallel.md#tensor-parallel-tinygpt")
        # --- end TODO 2.20 ---


# --------------------------------------------------------------------------- demo
def main(argv: list[str] | None = None) -> None:
    from distlab.comm import CommLedger
    from distlab.data import synthetic_tokens
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_bytes, format_table, log0, progress

    parser = argparse.ArgumentParser(description="Tensor-parallel TinyGPT vs the same model on one process.")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    env = init_from_env()
    try:
        cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=args.n_head, n_embd=args.n_embd)
        torch.manual_seed(0)  # every rank builds the same full model, then keeps its shard
        reference = TinyGPT(cfg)
        model = ParallelGPT(reference, group=None).to(env.device)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.0)
        tokens, targets = synthetic_tokens(n_seq=args.batch * args.steps, seq_len=16, vocab_size=64).tensors
        n_full = sum(p.numel() for p in reference.parameters())
        n_local = sum(p.numel() for p in model.parameters())
        log0(f"tensor parallel: TinyGPT over {env.world_size} ranks ({env.backend}); {n_full} parameters, "
             f"{n_local} on each rank")
        ledger, elapsed = CommLedger(), 0.0
        for step in progress(range(args.steps), desc="tensor parallel"):
            x = tokens[step * args.batch:(step + 1) * args.batch].to(env.device)
            y = targets[step * args.batch:(step + 1) * args.batch].to(env.device)
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if step == args.steps - 1:
                with ledger:
                    loss = model(x, y)[1]
                    loss.backward()
            else:
                loss = model(x, y)[1]
                loss.backward()
            opt.step()
            elapsed += time.perf_counter() - start
            ref_opt.zero_grad(set_to_none=True)  # the single-process twin, for the summary
            ref_loss = reference(x.cpu(), y.cpu())[1]
            ref_loss.backward()
            ref_opt.step()
        log0("\n" + format_table([{
            "ranks": env.world_size, "steps": args.steps, "loss (tensor parallel)": f"{loss.item():.4f}",
            "loss (one process)": f"{ref_loss.item():.4f}", "params/rank": n_local,
            "all-reduces/step": ledger.calls("all_reduce"),
            "all-reduced/step": format_bytes(ledger.bytes("all_reduce")),
            "steps/s": f"{args.steps / elapsed:.1f}"}]))
    finally:
        shutdown()


if __name__ == "__main__":
    main()
