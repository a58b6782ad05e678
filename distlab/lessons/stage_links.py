"""Pre-written message plumbing of a pipeline stage (phase2_advanced/pipeline.py).

Messages have no tags (NCCL has none): between two stages they match in the order they
are sent, and every schedule receives them in the order its neighbour sends them. A
stage's sends leave with its next receive, as one launch (``p2p.Outbox``): in 1F1B's
steady state two neighbours send to each other at once, which NCCL cannot buffer.
A stage that is its own neighbour (p = 1 with several chunks) queues messages to itself,
by ``key`` (virtual stage, direction). Waits for receives go into the stage's timeline
(``distlab.metrics.Timeline``: CUDA events on a GPU, read after the step; no host sync here).
Guide: phase2_advanced/guidelines_model_parallel.md#pipeline-parallelism.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from distlab.metrics import Timeline
from distlab.p2p import Outbox


class StageLinks:
    """One stage's links to its neighbours (and itself); waits for receives go into ``timeline``."""

    def __init__(self, stage_id: int, group: dist.ProcessGroup | None, dtype: torch.dtype,
                 device: torch.device, timeline: Timeline) -> None:
        self.stage_id, self.dtype, self.device, self.timeline = stage_id, dtype, device, timeline
        self.outbox = Outbox(group)
        self._local: dict[tuple, list[torch.Tensor]] = {}  # messages to itself

    def receive(self, wants: list[tuple | None]) -> list[torch.Tensor | None]:
        """One message per ``(stage, key, shape)`` (None: nothing), every remote one in a single
        launch that also posts the queued sends; with nothing remote, the queued sends go alone,
        now, not after the compute that follows."""
        got: list[torch.Tensor | None] = []
        remote: list[tuple[torch.Tensor, int]] = []
        for want in wants:
            if want is None:
                got.append(None)
            elif want[0] == self.stage_id:
                got.append(self._local[want[1]].pop(0))
            else:
                got.append(torch.empty(want[2], dtype=self.dtype, device=self.device))
                remote.append((got[-1], want[0]))
        start = self.timeline.mark()
        self.outbox.recv_all(remote)
        if remote:
            self.timeline.span(start, self.stage_id, "wait")
        return got

    def send(self, t: torch.Tensor, stage: int, key: tuple) -> None:
        """Queue ``t`` for ``stage`` (it leaves with the next receive, or ``finish``)."""
        if stage == self.stage_id:
            self._local.setdefault(key, []).append(t.detach().clone())
        else:
            self.outbox.put(t.detach(), stage)

    def finish(self) -> None:
        """Post the queued sends and wait for every send (their buffers must live until then)."""
        self.outbox.finish()
