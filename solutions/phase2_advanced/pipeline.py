"""Pipeline parallelism: GPipe and 1F1B schedules, built from send and recv.

The model is cut into p consecutive stages, one per rank; the batch into m equal
micro-batches. A stage runs forward on micro-batch i as soon as the previous stage
sends its activation, and backward as soon as the next stage sends the gradient of
that activation. The schedule decides the order on each stage:

* GPipe (Huang et al. 2019): all m forwards, then all m backwards. Simple, but every
  stage holds the activations of all m micro-batches at the peak.
* 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs p-s-1 warm-up forwards,
  then alternates one forward, one backward, then drains the remaining backwards.
  Same bubble as GPipe, but at most p-s micro-batches are in flight on stage s.

Both leave every stage idle for (p-1) forward+backward slots per step, the bubble:
(p-1)/(m+p-1) of the step when forward and backward times are equal per stage.
The loss of each micro-batch is divided by m, so the gradients that accumulate are
those of the mean loss over the whole batch: the step equals single-process training.

Cost per step, per stage boundary: m activations sent forward and m activation
gradients sent backward (micro-batch size x hidden x bytes each).
See phase2_advanced/guidelines_model_parallel.md#pipeline-parallelism.

Run: ``RUN_MODE=pipeline_gpipe ./entrypoint.sh``, ``RUN_MODE=pipeline_1f1b ./entrypoint.sh`` or
``RUN_MODE=pipeline_interleaved ./entrypoint.sh`` (``IMPL=templates`` in front runs your template).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distlab.metrics import Timeline
from distlab.lessons.stage_links import StageLinks
from distlab.lessons.sync import check_divisible


def split_microbatches(batch: torch.Tensor, num_microbatches: int) -> list[torch.Tensor]:
    """``batch`` cut into ``num_microbatches`` equal micro-batches along dim 0."""
    check_divisible(batch.shape[0], num_microbatches, "batch", "the number of micro-batches")
    return list(batch.chunk(num_microbatches))


def theoretical_bubble(num_stages: int, num_microbatches: int, num_chunks: int = 1) -> float:
    """(p-1)/(v*m+p-1): the idle share of a step with equal forward and backward times per stage."""
    return (num_stages - 1) / (num_chunks * num_microbatches + num_stages - 1)


def measured_bubble(events: list[tuple], num_stages: int) -> float:
    """Idle share of one step from every stage's events: 1 - (F + B time) / (p x makespan)."""
    busy = sum(end - start for _, start, end, kind, _ in events if kind in ("F", "B"))
    span = max(e[2] for e in events) - min(e[1] for e in events)
    return 1.0 - busy / (num_stages * span)


# --------------------------------------------------------------------------- the stage
class PipelineStage:
    """One rank's layers, its links to the neighbouring stages, and its timeline.

    Args:
        module: this stage's layers; or, for interleaved schedules, a list of v chunks:
            chunk c is virtual stage c*p + rank of a model cut into p*v pieces.
        recv_shape: shape of the micro-batch activation a stage receives (unused on stage 0).
        group: the pipeline's ranks, in stage order (stage = group rank).
        timeline: record ``events`` (compute and waits per micro-batch); no host sync either way.
    """

    def __init__(self, module: nn.Module | list[nn.Module], recv_shape: tuple[int, ...],
                 dtype: torch.dtype = torch.float32, group: dist.ProcessGroup | None = None,
                 device: torch.device | None = None, timeline: bool = True) -> None:
        self.chunks = list(module) if isinstance(module, (list, tuple)) else [module]
        self.module, self.recv_shape, self.dtype, self.group = module, tuple(recv_shape), dtype, group
        self.device = device or torch.device("cpu")
        self.stage_id, self.num_stages = dist.get_rank(group), dist.get_world_size(group)
        self.num_chunks = len(self.chunks)
        self.in_flight: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> (input, output or loss)
        self.peak_in_flight = 0
        self.losses: list[torch.Tensor] = []  # last stage: each micro-batch's loss / m
        self.timeline = Timeline(self.device, timeline)
        # Given: untagged messages, each send leaving with the next receive (distlab/lessons/stage_links.py).
        self.links = StageLinks(self.stage_id, group, dtype, self.device, self.timeline)

    @property
    def events(self) -> list[tuple]:  # (stage, start_s, end_s, kind, label) of the last step, for plot_timeline
        return self.timeline.spans

    @property
    def is_first(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last(self) -> bool:
        return self.stage_id == self.num_stages - 1

    # (stage, key, shape) of a message: ``key`` (virtual stage, direction) only names the queue
    # of messages a stage sends itself; between two stages messages match in the order sent.
    def _input_of(self, chunk: int) -> tuple | None:
        """(stage, key, shape) of the forward input ``chunk`` receives; None on virtual stage 0."""
        vs = chunk * self.num_stages + self.stage_id
        return None if vs == 0 else ((self.stage_id - 1) % self.num_stages, (vs, "F"), self.recv_shape)

    def _grad_of(self, mb: int, chunk: int) -> tuple | None:
        """(stage, key, shape) of the output gradient ``chunk`` receives for ``mb``; None on the last virtual stage."""
        vs = chunk * self.num_stages + self.stage_id
        if vs == self.num_stages * self.num_chunks - 1:
            return None
        return (self.stage_id + 1) % self.num_stages, (vs, "B"), self.in_flight[chunk, mb][1].shape

    def forward_step(self, mb: int, x: torch.Tensor | None, target: torch.Tensor | None,
                     loss_fn: Callable, num_microbatches: int, chunk: int = 0) -> None:
        """Forward of micro-batch ``mb`` through ``chunk``: receive (or take ``x``), compute, send (or loss / m)."""
        inp, = self.links.receive([self._input_of(chunk)])
        self._forward(mb, x if inp is None else inp.requires_grad_(), target, loss_fn, num_microbatches, chunk)

    def backward_step(self, mb: int, chunk: int = 0) -> None:
        """Backward of micro-batch ``mb`` through ``chunk``: receive dL/d(output), backward, send dL/d(input)."""
        grad, = self.links.receive([self._grad_of(mb, chunk)])
        self._backward(mb, chunk, grad)

    def forward_backward_step(self, mb: int, chunk: int, x: torch.Tensor | None, target: torch.Tensor | None,
                              loss_fn: Callable, num_microbatches: int, back_mb: int, back_chunk: int) -> None:
        """A steady-state slot: forward of (``mb``, ``chunk``), then backward of (``back_mb``, ``back_chunk``).

        Both messages are received in one launch (Megatron-LM's send_forward_backward_recv_forward_backward):
        interleaved, a rank's two neighbours (one rank at p = 2) exchange in both directions, and two
        launches make a cycle of sends each waiting for a receive queued behind another send (NCCL
        hangs, gloo buffers). The backward's forward must have run already.
        """
        inp, grad = self.links.receive([self._input_of(chunk), self._grad_of(back_mb, back_chunk)])
        self._forward(mb, x if inp is None else inp.requires_grad_(), target, loss_fn, num_microbatches, chunk)
        self._backward(back_mb, back_chunk, grad)

    def _forward(self, mb: int, inp: torch.Tensor, target: torch.Tensor | None, loss_fn: Callable,
                 num_microbatches: int, chunk: int) -> None:
        p, vs = self.num_stages, chunk * self.num_stages + self.stage_id
        last = vs == p * self.num_chunks - 1
        start = self.timeline.mark()
        out = self.chunks[chunk](inp)
        if last:
            out = loss_fn(out, target) / num_microbatches  # the mean over micro-batches
            self.losses.append(out.detach())
        self.timeline.span(start, self.stage_id, "F", mb if self.num_chunks == 1 else f"{mb}.{chunk}")
        if not last:
            self.links.send(out.detach(), (self.stage_id + 1) % p, (vs + 1, "F"))
        self.in_flight[chunk, mb] = (inp, out)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))

    def _backward(self, mb: int, chunk: int, grad: torch.Tensor | None) -> None:
        p, vs = self.num_stages, chunk * self.num_stages + self.stage_id
        inp, out = self.in_flight.pop((chunk, mb))  # frees this micro-batch's activations afterwards
        start = self.timeline.mark()
        torch.autograd.backward(out, grad)
        self.timeline.span(start, self.stage_id, "B", mb if self.num_chunks == 1 else f"{mb}.{chunk}")
        if vs > 0:
            self.links.send(inp.grad, (self.stage_id - 1) % p, (vs - 1, "B"))

    def finish(self) -> None:
        """Post the queued sends and wait for every send (their buffers must live until then)."""
        self.links.finish()


# --------------------------------------------------------------------------- schedules
def gpipe(stage: PipelineStage, inputs: list, targets: list, loss_fn: Callable) -> None:
    """All forwards, then all backwards (GPipe). Peak: all m micro-batches in flight.

    Args:
        inputs: the m micro-batches (read on stage 0 only, None elsewhere);
        targets: their targets (read on the last stage only, None elsewhere).
    Equivalent to: forward and backward of the whole batch with the mean loss.
    Collective: every stage of ``stage.group`` must run the same schedule with the same m.
    Cost: per stage boundary, m activations forward and m gradients backward.
    """
    m = len(inputs)
    # ### BEGIN SOLUTION 2.12: GPipe schedule [guidelines_model_parallel.md#gpipe]
    # Goal: every one of the m micro-batches forward through this stage, and only then every
    # backward, each in micro-batch order (the neighbours' messages arrive in that order).
    # Contract: every stage runs this same sequence; the step ends once this stage's
    # asynchronous sends are done (their buffers must live until then).
    for i in range(m):
        stage.forward_step(i, inputs[i], targets[i], loss_fn, m)
    for i in range(m):
        stage.backward_step(i)
    stage.finish()
    # ### END SOLUTION 2.12


def one_f_one_b(stage: PipelineStage, inputs: list, targets: list, loss_fn: Callable) -> None:
    """1F1B: p-s-1 warm-up forwards, then one forward / one backward, then the remaining backwards.

    Peak: min(p - s, m) micro-batches in flight on stage s (at most p).
    Equivalent to / Collective / Cost: as ``gpipe``.
    """
    m, p, s = len(inputs), stage.num_stages, stage.stage_id
    # ### BEGIN SOLUTION 2.13: 1F1B schedule [guidelines_model_parallel.md#1f1b]
    # Goal: the same m forwards and m backwards as GPipe, reordered so that stage s never
    # holds more than min(p - s, m) micro-batches in flight: fill the pipeline just enough,
    # then alternate forward and backward, then drain. Backwards stay in micro-batch order
    # on every stage; the step ends once this stage's sends are done.
    warmup = min(p - s - 1, m)
    for i in range(warmup):
        stage.forward_step(i, inputs[i], targets[i], loss_fn, m)
    for i in range(m - warmup):  # steady state: the oldest backward right after each forward
        stage.forward_step(warmup + i, inputs[warmup + i], targets[warmup + i], loss_fn, m)
        stage.backward_step(i)
    for i in range(m - warmup, m):  # cool-down
        stage.backward_step(i)
    stage.finish()
    # ### END SOLUTION 2.13


def interleaved_1f1b(stage: PipelineStage, inputs: list, targets: list, loss_fn: Callable) -> None:
    """Interleaved 1F1B over v chunks per rank (virtual stages): bubble (p-1)/(v*m + p-1).

    Operations run in groups of p micro-batches per chunk: the k-th forward on a rank
    is chunk (k // p) % v of micro-batch (k // (p*v)) * p + k % p; backwards walk the
    chunks in reverse. Warm-up: 2(p-s-1) + (v-1)p forwards (Narayanan et al. 2021).

    Equivalent to / Collective: as ``gpipe``; m must be a multiple of p.
    Cost: per rank, v times the point-to-point messages of 1F1B (each v times smaller work).
    """
    p, v, s, m = stage.num_stages, stage.num_chunks, stage.stage_id, len(inputs)
    check_divisible(m, p, "interleaved 1F1B: the number of micro-batches", "the number of stages")
    total = m * v  # (chunk, micro-batch) forwards on this rank, and as many backwards
    # ### BEGIN SOLUTION 2.14: interleaved 1F1B schedule [guidelines_model_parallel.md#interleaved-1f1b]
    # Goal: 1F1B over this rank's `total` (chunk, micro-batch) pairs. Forwards take p
    # micro-batches through chunk 0, the same p through chunk 1, ..., then the next p; the
    # k-th backward is the k-th forward's micro-batch with the chunks walked in reverse.
    # As in 1F1B: warm-up forwards (as many as the docstring says), then one forward and
    # one backward at a time (one `stage.forward_backward_step`: both messages received in
    # one launch), then the remaining backwards; wait for the sends at the end.
    def op(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    def fwd(k: int) -> None:
        chunk, mb = op(k, True)
        stage.forward_step(mb, inputs[mb], targets[mb], loss_fn, m, chunk)

    def bwd(k: int) -> None:
        chunk, mb = op(k, False)
        stage.backward_step(mb, chunk)

    warmup = min(2 * (p - s - 1) + (v - 1) * p, total)
    for k in range(warmup):
        fwd(k)
    for k in range(total - warmup):  # one launch receives both: see PipelineStage.forward_backward_step
        chunk, mb = op(warmup + k, True)
        back_chunk, back_mb = op(k, False)
        stage.forward_backward_step(mb, chunk, inputs[mb], targets[mb], loss_fn, m, back_mb, back_chunk)
    for k in range(total - warmup, total):
        bwd(k)
    stage.finish()
    # ### END SOLUTION 2.14


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def train_step(stage: PipelineStage, optimizer: torch.optim.Optimizer, schedule: str,
               x: torch.Tensor | None, y: torch.Tensor | None, loss_fn: Callable,
               num_microbatches: int) -> float | None:
    """One optimizer step of the pipeline; returns the batch's mean loss on the last stage, else None.

    Args:
        x, y: the whole batch's inputs (read on stage 0) and targets (read on the last stage).
        num_microbatches: m; the batch must divide into m equal micro-batches.
    Equivalent to: one step of single-process training on the whole batch (mean loss).
    Collective: every stage of ``stage.group`` calls it with the same schedule and m.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    none = [None] * num_microbatches
    inputs = split_microbatches(x, num_microbatches) if stage.is_first else none
    targets = split_microbatches(y, num_microbatches) if stage.is_last else none
    optimizer.zero_grad(set_to_none=True)
    stage.losses.clear()
    stage.timeline.clear()  # the timeline of this step only
    SCHEDULES[schedule](stage, inputs, targets, loss_fn)
    optimizer.step()
    return sum(stage.losses).item() if stage.is_last else None


# --------------------------------------------------------------------------- cutting a model
def build_stage_module(stage_id: int, num_stages: int, in_features: int, hidden: int, num_classes: int,
                       layers_per_stage: int, seed: int = 0) -> nn.Sequential:
    """Stage ``stage_id``'s slice of one seeded MLP of ``num_stages * layers_per_stage`` blocks."""
    torch.manual_seed(seed)  # every rank builds the whole model, so the stages fit together
    layers: list[nn.Module] = [nn.Linear(in_features, hidden)]
    for _ in range(num_stages * layers_per_stage):
        layers += [nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())]
    layers.append(nn.Linear(hidden, num_classes))
    body = layers[1:-1]
    mine = body[stage_id * layers_per_stage:(stage_id + 1) * layers_per_stage]
    if stage_id == 0:
        mine = [layers[0], *mine]
    if stage_id == num_stages - 1:
        mine = [*mine, layers[-1]]
    return nn.Sequential(*mine)
