"""The planner's per-rank memory and bytes (phase 5): the model, the plan, and the course's formulas.

``estimate(model, plan, train)``: per rank, the bytes of parameters, gradients, optimizer state and
activations, and the bytes each rank sends per step on each axis, by the formulas of
phase5_large_models/guidelines.md#planner (tests/test_plan.py holds them against the course's own
implementations). Used by the planner's ranking (distlab/plan.py) and its step-time model
(distlab/plan_time.py), which both import it: it imports neither.
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
PRESETS = {  # name -> Model fields (+ params: the published total)
    "gpt2-small": dict(layers=12, hidden=768, heads=12, vocab=50257, seq=1024),
    "gpt2-xl": dict(layers=48, hidden=1600, heads=25, vocab=50257, seq=1024),
    "llama-7b": dict(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, ffn=11008, tied=False, params=6.74e9),
    "llama-70b": dict(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, ffn=28672, tied=False, params=70e9),
    "mixtral-8x7b": dict(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, ffn=14336, tied=False,
                         experts=8, top_k=2, params=46.7e9),
}


@dataclass(frozen=True)
class Model:
    """A GPT: ``layers`` blocks of width ``hidden``, ``heads`` heads, ``ffn`` MLP width (0: 4 x hidden)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0
    experts: int = 1          # > 1: every MLP is a top-k mixture of this many experts
    top_k: int = 1
    tied: bool = True         # LM head tied to the token embedding
    params: float | None = None  # rescale the architecture's count to this total

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    def counts(self) -> dict[str, float]:
        """Parameters by part; "*_split" parts are divided by tensor parallelism, the rest replicated."""
        h, f, V, E = self.hidden, self.f, self.vocab, self.experts
        per_layer = {"attn_split": 4 * h * h + 3 * h, "attn_rep": h, "ln": 4 * h}
        if E > 1:  # the course's Experts: w1 [E, h, f], w2 [E, f, h]; router Linear(h, E, bias=False)
            per_layer.update(experts=2 * h * f * E, router=h * E)
        else:      # fc (weight, bias) column-parallel, proj row-parallel (its bias replicated)
            per_layer.update(mlp_split=2 * h * f + f, mlp_rep=h)
        c = {k: v * self.layers for k, v in per_layer.items()}
        c.update(embed_split=V * h, pos=self.seq * h, ln_f=2 * h, head_split=0 if self.tied else V * h)
        if self.params:
            scale = self.params / sum(c.values())
            c = {k: v * scale for k, v in c.items()}
        return c


@dataclass(frozen=True)
class Train:
    """One step: ``global_batch`` sequences in micro-batches of ``micro_batch`` per data-parallel rank."""

    micro_batch: int = 1
    global_batch: int = 512
    dtype_bytes: int = 2       # e: parameters, gradients and activations (2: bf16)
    optimizer_bytes: int = 12  # K per parameter: fp32 master + Adam's two moments (ZeRO paper); fp32 AdamW: 8


@dataclass(frozen=True)
class Plan:
    """dp x tp x pp x cp ranks; ep divides dp; zero: 0 = DDP, 1-3 = ZeRO stage."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    recompute: bool = False

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        """ "ZeRO-1 DP8 x TP4 x PP2 + recompute": the data-parallel flavour first, then the other axes."""
        dp = ("DDP" if self.zero == 0 else f"ZeRO-{self.zero}") + (f" DP{self.dp}" if self.dp > 1 else "")
        parts = [] if self.dp == 1 and self.zero == 0 else [dp]
        parts += [f"{k}{v}" for k, v in (("TP", self.tp), ("PP", self.pp), ("CP", self.cp), ("EP", self.ep)) if v > 1]
        return " x ".join(parts or ["one GPU"]) + (" + recompute" if self.recompute else "")


@dataclass
class Estimate:
    """Per rank (one pipeline stage): bytes held and bytes sent per step, by axis."""

    params: float
    grads: float
    optimizer: float
    activations: float            # no recomputation: every layer's saved tensors
    activations_recompute: float  # each layer keeps its input; one layer's insides during its backward
    layer_activations: float      # one layer's saved tensors, one micro-batch
    comm: dict[str, float]        # axis -> bytes this rank sends per step (ring estimate, as CommLedger.wire_bytes)
    bubble: float
    microbatches: int
    recompute: bool = False

    @property
    def total(self) -> float:
        act = self.activations_recompute if self.recompute else self.activations
        return self.params + self.grads + self.optimizer + act


def _ring(w: int) -> float:
    return (w - 1) / w


def estimate(model: Model, plan: Plan, train: Train, stage: int = 0) -> Estimate:
    """Memory and communication of pipeline stage ``stage`` (any rank of it) under ``plan``."""
    L, h, a, V, s = model.layers, model.hidden, model.heads, model.vocab, model.seq
    f, E, k = model.f, model.experts, model.top_k
    t, p, c, ep, dp = plan.tp, plan.pp, plan.cp, plan.ep, plan.dp
    e, b = train.dtype_bytes, train.micro_batch
    m = train.global_batch // (b * dp)
    first, last, layers = stage == 0, stage == p - 1, L // p
    cnt = model.counts()
    # --- parameters this rank holds (elements): tensor-, pipeline- and expert-parallel splits
    per_layer = {key: v / L for key, v in cnt.items() if key in ("attn_split", "attn_rep", "ln", "mlp_split",
                                                                 "mlp_rep", "router", "experts")}
    dense = layers * sum(v / t if key.endswith("_split") else v for key, v in per_layer.items() if key != "experts")
    expert = layers * per_layer.get("experts", 0) / ep
    if first:
        dense += cnt["embed_split"] / t + cnt["pos"]
    if last:  # a tied head on another stage than the embedding is a copy (Megatron's)
        dense += cnt["ln_f"] + (cnt["head_split"] or (cnt["embed_split"] if p > 1 else 0)) / t
    D, De = dp * c, dp * c // ep   # ranks holding the same dense / expert parameters
    shard = {0: (1, 1, 1), 1: (1, 1, D), 2: (1, D, D), 3: (D, D, D)}[plan.zero]
    shard_e = {0: (1, 1, 1), 1: (1, 1, De), 2: (1, De, De), 3: (De, De, De)}[plan.zero]
    params, grads, opt = (dense / x + expert / y for x, y in zip(shard, shard_e))
    # --- activations of one micro-batch (bytes): n tokens on this rank (phase 2's per-block count)
    n = b * s / c
    # dense MLP: fc and GELU outputs; MoE: router probabilities, gates, and per slot the dispatched,
    # returned and weighted rows and the expert's ReLU output (+ 32k bytes of int64 indices)
    mlp = 2 * f / t if E == 1 else E + k + k * (3 * h + f)
    # LayerNorms' inputs and outputs, q, k, v, attention output; LN mean/rstd (fp32), log-sum-exp per head
    layer = n * (e * (4 * h + 4 * h / t + mlp) + 16 + 4 * a / t + (32 * k if E > 1 else 0))
    ends = 0.0
    if first:  # token ids (8 bytes; + a 1-byte mask for the vocab-parallel lookup) and positions
        ends += n * (8 + (t > 1)) + 8 * s / c
    if last:   # ln_f and head inputs, log-softmax (vocab-parallel: exp and shifted logits), targets
        ends += n * (2 * e * h + 8 + (e * V / t + 8 if t == 1 else 2 * e * V / t + e + 9))
    in_flight = min(p - stage, m)  # 1F1B: stage s holds min(p - s, m) micro-batches
    activations = in_flight * (layers * layer + ends)
    activations_recompute = in_flight * (layers * n * e * h + ends) + layer
    # --- bytes sent per step, each axis (ring estimate: all-reduce 2(W-1)/W, gather/scatter (W-1)/W)
    factor = {0: 2, 1: 3, 2: m + 1, 3: 3 * m}[plan.zero]  # per step: DDP; ZeRO-1 all-reduce + all-gather; ...
    comm = {"dp": factor * e * (_ring(D) * dense + _ring(De) * expert)}
    tp_calls = layers * 4 + first + last  # 2 all-reduces per block each way; embedding fwd; head bwd
    comm["tp"] = m * _ring(t) * 2 * e * (tp_calls * n * h + (3 * n if last else 0))
    comm["pp"] = m * n * h * e * ((not first) + (not last)) if p > 1 else 0.0
    kv = 2 * b * (h / t) * s  # K and V of the whole sequence, elements
    comm["cp"] = m * layers * (2 * kv * _ring(c) * e + kv * max(e, 4)) if c > 1 else 0.0
    comm["ep"] = (m * layers * (4 * k * n * h * e * _ring(ep) + (ep - 1) * k * E * 8 + _ring(ep) * E * 8)
                  if ep > 1 else 0.0)
    bubble = (p - 1) / (m + p - 1)
    return Estimate(e * params, e * grads, train.optimizer_bytes * opt, activations, activations_recompute,
                    layer, comm, bubble, m, plan.recompute)
