"""Automatic recovery: a rank dies, torchrun restarts the job, training resumes bit-identically.

The pieces, each taught in its own module, wired into one training loop:

* ``checkpoint.py``: every ``ckpt_every`` steps each rank saves its state atomically
  (model, optimizer shard, scheduler, sampler position, step, RNG); on start the newest
  checkpoint that verifies *and* loads is taken, and a corrupted, refused or mismatched one
  is skipped with a warning; a checkpoint past ``--steps`` is an error, not a silent result;
* ``elastic.py``: the sampler's position is global, the optimizer state is resharded,
  so the restarted job may even have a different world size; a heartbeat before each
  save names a hung rank in seconds instead of waiting 30 minutes.

Under ``torchrun --max-restarts=N`` a failed worker makes the agent stop the others
and start a fresh set; ``distlab.launch.init_from_env`` prefixes the store with a
generation the new ranks agree on through it, so they never read the addresses the
previous attempt left in the reused store (without it, restarts on gloo hang or fail
most of the time). The restarted ranks find the last checkpoint and carry on.

This module is the harness, and the demo of RUN_MODE=fault_tolerance: it has no TODOs.
It loads ``checkpoint`` and ``elastic`` through ``distlab.loader.load``, so under
``IMPL=templates`` (and ``pytest --impl templates``, whose tests run it) it runs the
learner's code. See phase4_production/guidelines.md#automatic-recovery.

    RUN_MODE=fault_tolerance ./entrypoint.sh --fresh                  # no crash: train, checkpoint
    RUN_MODE=fault_tolerance MAX_RESTARTS=3 ./entrypoint.sh --crash-at-step 5 --fresh
    IMPL=templates RUN_MODE=fault_tolerance MAX_RESTARTS=3 ./entrypoint.sh --crash-at-step 5 --fresh

(with ``--crash-at-step 5`` rank 1 is SIGKILLed during step 5 on the first attempt; the
job restarts, resumes from the checkpoint of step 4 and finishes).
"""
from __future__ import annotations

import argparse
import io
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from demos.sizes import global_batch, positive
from distlab.data import synthetic_classification
from distlab.loader import load
from distlab.lessons.sync import allreduce_gradients
from distlab.todo import run_demo

PHASE = "phase4_production"
# The settings a checkpoint of this harness is written with: another model or optimizer cannot resume it.
CHECKPOINT_CONFIG = {"model": "mlp 16-32-4 float64", "optimizer": "FlatShardedAdam"}


@dataclass(frozen=True)
class RunConfig:
    """One fault-tolerant run.

    Attempt i (torchrun's restart count) SIGKILLs rank ``crash_ranks[i % len]`` during
    step ``crash_at_steps[i]``; attempts past the end of ``crash_at_steps`` run clean. With
    ``crash_kinds[i % len] == "save"`` the kill comes instead in the middle of writing that
    rank's file of the first checkpoint saved at or after that step (half of it on disk).
    """

    steps: int = 12
    global_batch: int = 12
    ckpt_dir: str = "runs/fault_tolerance/checkpoints"
    ckpt_every: int = 2
    keep: int = 3
    crash_at_steps: tuple[int, ...] = ()
    crash_ranks: tuple[int, ...] = (1,)
    crash_kinds: tuple[str, ...] = ("step",)  # "step": during the step; "save": in the middle of the next save
    crash_node: int = -1   # >= 0: instead of one rank, the node started with NODE_RANK=crash_node is lost
    dropout: float = 0.1   # draws from torch's RNG: a resume that forgets the RNG state diverges
    noise: float = 0.1     # input noise, also from torch's RNG
    lr: float = 0.02
    warmup_steps: int = 4  # an LR schedule whose state must be restored too
    samples: int = 60      # not a multiple of the global batch: epochs end with a dropped tail
    seed: int = 0
    heartbeat_timeout_s: float = 30.0
    out: str = ""          # rank 0 writes the final parameters here (torch.save) if set
    fresh: bool = False    # attempt 0 deletes the course's checkpoints in ckpt_dir first (never anything else)
    device: str = "cpu"    # model, batches and checkpoints loaded onto it (init_from_env's env.device)

    def __post_init__(self) -> None:
        if self.ckpt_every < 1:
            raise ValueError(f"ckpt_every must be >= 1, got {self.ckpt_every}")


def make_model(cfg: RunConfig) -> nn.Module:
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank and every attempt
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(cfg.dropout), nn.Linear(32, 4))
    return model.double().to(cfg.device)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: RunConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup_steps))


def _die_while_saving(ckpt, attempt: int, rank: int) -> None:
    """Make this rank's next checkpoint file write stop halfway, then SIGKILL the rank (fault injection)."""
    def save_file(obj, path) -> None:
        path = Path(path)
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
        print(f"[attempt {attempt}] rank {rank}: injected crash (SIGKILL) while writing {path.name}", flush=True)
        with open(path.with_name(f".{path.name}.tmp{os.getpid()}"), "wb") as f:  # where a write in progress is
            f.write(data[:len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    ckpt.save_file = save_file  # CheckpointManager.save writes each rank's file through it


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _fresh(rank: int, world_size: int, cfg: RunConfig, elastic) -> tuple:
    """Model, optimizer, scheduler and sampler as at step 0, and the per-rank random streams."""
    model = make_model(cfg)
    optimizer = elastic.FlatShardedAdam(model.parameters(), lr=cfg.lr)
    scheduler = make_scheduler(optimizer, cfg)
    sampler = elastic.GlobalBatchSampler(cfg.samples, cfg.global_batch, rank, world_size, seed=cfg.seed)
    torch.manual_seed(cfg.seed + 1000 + rank)  # per-rank streams for dropout and noise
    return model, optimizer, scheduler, sampler


def _resumed(found, rank: int, world_size: int, cfg: RunConfig, ckpt, elastic) -> tuple:
    """Fresh state with checkpoint ``found`` loaded into it; raises (and leaves nothing half-loaded
    behind: it builds its own objects) if the checkpoint does not fit."""
    model, optimizer, scheduler, sampler = _fresh(rank, world_size, cfg, elastic)
    common = found.load(0, map_location=cfg.device)  # replicated state: rank 0's copy
    model.load_state_dict(common["model"])  # another model's checkpoint: RuntimeError (size mismatch)
    scheduler.load_state_dict(common["scheduler"])
    sampler.load_state_dict(common["sampler"])
    optimizer.load_shards([found.load(r, map_location=cfg.device)["optimizer"] for r in range(found.world_size)])
    # The RNG streams are per rank; at a new world size rank r continues saved rank r mod W_old's.
    # Last: nothing after it can fail, so a rejected checkpoint never leaves its RNG state behind.
    ckpt.restore_rng_state(found.load(rank % found.world_size, map_location="cpu")["rng"])  # RNG states: CPU tensors
    return model, optimizer, scheduler, sampler


def train(rank: int, world_size: int, cfg: RunConfig) -> dict[str, torch.Tensor]:
    """Train ``cfg.steps`` steps, resuming from the newest checkpoint in ``cfg.ckpt_dir`` that loads.

    Returns the final parameters (every rank holds the same). A launch-agnostic
    worker: run it under torchrun (``main``) or ``run_distributed``.

    Raises:
        ValueError: the checkpoint it would resume from is past ``cfg.steps`` (a stale resume);
            ``ResumeRefused`` (a ValueError): the directory's checkpoints do not fit this run (nothing
            is touched); ``ForeignEntriesError`` (a ValueError): ``cfg.fresh`` in a directory that
            holds anything but the course's checkpoints (nothing is deleted).
    Collective: every rank must call it.
    """
    ckpt, elastic = load(PHASE, "checkpoint"), load(PHASE, "elastic")
    data = synthetic_classification(n=cfg.samples, in_features=16, num_classes=4, seed=cfg.seed)
    inputs, labels = data.tensors[0].double().to(cfg.device), data.tensors[1].to(cfg.device)
    # Heartbeats need gloo (monitored_barrier); an NCCL job gets a gloo side group for them.
    hb_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    # What a resume must match (world sizes may differ: the optimizer state is resharded).
    manager = ckpt.CheckpointManager(cfg.ckpt_dir, keep=cfg.keep, config=CHECKPOINT_CONFIG)
    if cfg.fresh and _attempt() == 0:  # a restarted attempt resumes what attempt 0 saved
        manager.start_over()  # the directory's lock first; then only step_* entries go (ckpt_entries.py)

    # A checkpoint that does not load (refused content, another model's shapes, ...) is skipped
    # with a warning, and the next older one is tried: every rank agrees on the one taken.
    resumed = []
    found = manager.restore(lambda c: resumed.append(_resumed(c, rank, world_size, cfg, ckpt, elastic)),
                            group=hb_group)
    model, optimizer, scheduler, sampler = resumed[-1] if found is not None else _fresh(rank, world_size, cfg,
                                                                                        elastic)
    start = found.step if found is not None else 0
    if start > cfg.steps:
        raise ValueError(f"{found.path} is at step {start}, past --steps {cfg.steps}: pass --steps {start} or "
                         f"more to continue that run, or --fresh (or another --ckpt-dir) to start over")
    if rank == 0:
        print(f"[attempt {_attempt()}] resumed from {found.path} (step {start}, saved by {found.world_size} "
              f"ranks, now {world_size})" if found is not None else
              f"[attempt {_attempt()}] no checkpoint in {cfg.ckpt_dir}: starting from step 0", flush=True)

    attempt = _attempt()
    crash_step = cfg.crash_at_steps[attempt] if attempt < len(cfg.crash_at_steps) else -1
    crash_rank = cfg.crash_ranks[attempt % len(cfg.crash_ranks)]
    crash_kind = cfg.crash_kinds[attempt % len(cfg.crash_kinds)] if crash_step >= 0 else "step"
    if crash_kind == "save" and rank == crash_rank and cfg.crash_node < 0:
        crash_step = -1  # not during the step: during the first save at or after it (below)
        save_crash_step = cfg.crash_at_steps[attempt]
    else:
        save_crash_step = -1
    for step in range(start, cfg.steps):
        idx = sampler.next_indices()
        x, y = inputs[idx], labels[idx]
        x = x + cfg.noise * torch.randn_like(x)
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        if step == crash_step and cfg.crash_node >= 0 and os.environ.get("NODE_RANK") == str(cfg.crash_node):
            # A lost machine: its torchrun agent and every rank on it vanish at once. (Fault
            # injection is the one place this worker reads the environment: which node am I.)
            print(f"[attempt {_attempt()}] rank {rank}: node {cfg.crash_node} lost at step {step}", flush=True)
            try:  # the agent (our parent) first, so nothing is left to restart this node's ranks
                os.kill(os.getppid(), signal.SIGKILL)
            except ProcessLookupError:  # another rank of this node got there first
                pass
            os.kill(os.getpid(), signal.SIGKILL)
        if step == crash_step and cfg.crash_node < 0 and rank == crash_rank:
            print(f"[attempt {_attempt()}] rank {rank}: injected crash (SIGKILL) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no exception: like a lost node
        allreduce_gradients(model.parameters())  # data parallel: mean gradient over the global batch
        optimizer.step()
        scheduler.step()
        if (step + 1) % cfg.ckpt_every == 0 or step + 1 == cfg.steps:
            elastic.heartbeat(cfg.heartbeat_timeout_s, group=hb_group)
            state = {"optimizer": optimizer.shard_state_dict(), "rng": ckpt.capture_rng_state()}
            if rank == 0:  # replicated state is written once
                state.update(model=model.state_dict(), scheduler=scheduler.state_dict(),
                             sampler=sampler.state_dict(), step=step + 1)
            if 0 <= save_crash_step <= step:
                _die_while_saving(ckpt, attempt, rank)
            manager.save(step + 1, state)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0 and cfg.out:
        torch.save(final, cfg.out)
    return final


# --------------------------------------------------------------------------- demo
def build_parser() -> argparse.ArgumentParser:
    defaults = RunConfig()
    parser = argparse.ArgumentParser(description="Fault-tolerant training: checkpoints, crash, restart, resume.")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--global-batch", type=int, default=None,
                        help=f"default: {defaults.global_batch}, rounded up to a multiple of the world size "
                             "(an elastic job should give one that every world size of its range divides)")
    parser.add_argument("--ckpt-dir", default=defaults.ckpt_dir)
    parser.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every)
    parser.add_argument("--keep", type=int, default=defaults.keep)
    parser.add_argument("--crash-at-step", type=int, nargs="*", default=[],
                        help="attempt i SIGKILLs --crash-rank during the i-th step given (needs MAX_RESTARTS)")
    parser.add_argument("--crash-rank", type=int, nargs="+", default=list(defaults.crash_ranks),
                        help="the rank killed by attempt i is the i-th of these (cycled)")
    parser.add_argument("--crash-kind", choices=("step", "save"), nargs="+", default=list(defaults.crash_kinds),
                        help="how attempt i's kill comes (cycled): during the step, or in the middle of writing "
                             "the first checkpoint at or after it")
    parser.add_argument("--crash-node", type=int, default=-1, metavar="NODE_RANK",
                        help="at the crash step, the node started with this NODE_RANK is lost (its agent and "
                             "ranks are SIGKILLed); with NNODES=MIN:MAX the others go on without it")
    parser.add_argument("--heartbeat-timeout", type=float, default=defaults.heartbeat_timeout_s)
    parser.add_argument("--out", default="", help="write the final parameters here (rank 0)")
    parser.add_argument("--fresh", action="store_true",
                        help="start over: delete the checkpoints this course wrote in --ckpt-dir (attempt 0 only, "
                             "after taking its lock); a directory that holds anything else is refused")
    return parser


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """A global batch the ranks share equally (see demos/sizes.py)."""
    positive(args, "--steps")
    args.global_batch = global_batch(args.global_batch, RunConfig.global_batch, world_size)
    return args


def main(argv: list[str] | None = None) -> None:
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import format_table, log0

    args = build_parser().parse_args(argv)
    env = init_from_env()
    try:
        args = resolve_args(args, env.world_size)
        cfg = RunConfig(steps=args.steps, global_batch=args.global_batch, ckpt_dir=args.ckpt_dir,
                        ckpt_every=args.ckpt_every, keep=args.keep, crash_at_steps=tuple(args.crash_at_step),
                        crash_ranks=tuple(args.crash_rank), crash_kinds=tuple(args.crash_kind),
                        crash_node=args.crash_node,
                        heartbeat_timeout_s=args.heartbeat_timeout, out=args.out, device=str(env.device),
                        fresh=args.fresh)
        log0(f"[attempt {_attempt()}] {env.world_size} ranks, {cfg.steps} steps, checkpoint every "
             f"{cfg.ckpt_every} to {cfg.ckpt_dir}, crashes planned: {list(cfg.crash_at_steps) or 'none'}")
        final = train(env.rank, env.world_size, cfg)
        norm = torch.sqrt(sum((v.double() ** 2).sum() for v in final.values())).item()
        model = make_model(cfg)
        model.load_state_dict(final)
        model.eval()
        data = synthetic_classification(n=cfg.samples, in_features=16, num_classes=4, seed=cfg.seed)
        with torch.no_grad():
            x, y = data.tensors[0].double().to(env.device), data.tensors[1].to(env.device)
            loss = F.cross_entropy(model(x), y).item()
        ckpts = sorted(p.name for p in Path(cfg.ckpt_dir).glob("step_*"))
        log0("\n" + format_table([{"attempt": _attempt(), "ranks": env.world_size, "steps": cfg.steps,
                                   "final |params|": f"{norm:.6f}", "train loss": f"{loss:.4f}", "checkpoints kept": " ".join(ckpts)}]))
        log0(f"config: {asdict(cfg)}")
    finally:
        shutdown()


if __name__ == "__main__":
    run_demo(main)
