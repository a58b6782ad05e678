"""Capstone: large-scale image classification with everything the course built.

One script, from a laptop smoke run to a multi-node GPU job:

    RUN_MODE=imagenet ./entrypoint.sh                                  # digits on 2 CPU ranks
    RUN_MODE=imagenet ./entrypoint.sh --strategy zero --zero-stage 3
    IMPL=templates RUN_MODE=imagenet ./entrypoint.sh --strategy ours   # your phase 3 and 4 code
    torchrun --nnodes=2 --nproc_per_node=8 ... -m demos.imagenet \\
        --model resnet50 --dataset imagefolder --data-root /data/imagenet --amp bf16 --global-batch 2048

* models: torchvision's ResNet-18/50 (a 3x3 stem without max-pool for images of 64 px or
  less), ViT-B/16, and a small ViT for CPU runs;
* data: ImageFolder (ImageNet layout), CIFAR-10, or the offline digits default, read in
  global batches whose position survives a change of world size (Phase 4's sampler);
* strategies: ``ddp`` (torch's DDP), ``ours`` (Phase 3's bucketed, overlapped DDP),
  ``zero`` (Phase 3's ZeRO, ``--zero-stage`` 1-3), ``fsdp`` (torch's FSDP2);
* mixed precision (``--amp bf16|fp16``), gradient compression (``--compression``),
  SyncBatchNorm, linear warm-up then cosine decay, DataLoader workers;
* crash-safe checkpoints every ``--checkpoint-every`` steps and on exit, resumed
  automatically (at any world size that divides the global batch, with ddp/ours) from the
  newest one that loads: one that verifies but does not load (another model's, one that
  ``weights_only`` refuses) is skipped with a warning, and the one before it is taken; one run
  per directory (a second is refused, naming the first), and ``--keep`` counts and prunes this
  run's checkpoints only, never another experiment's;
* monitoring: per-step time split into data / compute / optimizer, throughput, and a
  summary table at the end.

Every lesson module it uses (Phase 3's ``ddp_bucketed``, ``zero``, ``fsdp``; Phase 4's
``compression``, ``checkpoint``, ``elastic``) comes through ``distlab.loader.load``, so
``IMPL=templates`` trains with the learner's code, and stops at its first unfinished TODO.
See phase4_production/guidelines.md#capstone and solutions/phase4_production/README.md.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from demos.sizes import global_batch, positive
from distlab.loader import load
from distlab.lessons.sync import broadcast_module
from distlab.todo import run_demo

STRATEGIES = ("ddp", "ours", "zero", "fsdp")
MODELS = ("resnet18", "resnet50", "vit_b_16", "vit_tiny")
_FSDP2_CHECKPOINTS = ("--checkpoint-dir with --strategy fsdp: torch's FSDP2 saves through "
                      "torch.distributed.checkpoint; use ddp, ours or zero for this script's checkpoints")


@dataclass
class Config:
    model: str = "resnet18"
    dataset: str = "digits"
    data_root: str = "data"
    download: bool = False
    image_size: int = 16
    strategy: str = "ddp"
    zero_stage: int = 1
    epochs: int = 3
    max_steps: int = 0
    global_batch: int | None = None  # None: 64, rounded up to a multiple of the world size (resolve_config)
    lr: float = 0.05
    weight_decay: float = 5e-4
    warmup_steps: int = 10
    amp: str = "none"
    compression: str = "none"
    bucket_mb: float = 25.0
    sync_bn: bool = False
    workers: int = 0
    checkpoint_dir: str = ""
    checkpoint_every: int = 100
    stop_at_step: int = 0  # leave after this step's checkpoint, as a preempted job would (0: never)
    fresh: bool = False  # start over: delete the course's checkpoints in checkpoint_dir (never anything else)
    keep: int = 3
    seed: int = 0
    log_every: int = 20
    offload_optimizer: str = "none"  # "cpu": ZeRO-Offload, --strategy zero --zero-stage 1 or 2
    deepspeed_config: str = ""  # a DeepSpeed-style JSON: see apply_deepspeed_config

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r}: choose one of {STRATEGIES}")
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r}: choose one of {MODELS}")
        if not 1 <= self.zero_stage <= 3:
            raise ValueError(f"--zero-stage must be 1, 2 or 3, got {self.zero_stage}")
        if self.amp == "fp16" and self.strategy not in ("ddp", "fsdp"):
            raise ValueError(f"--amp fp16 needs a loss scaler on torch's optimizer: use --strategy ddp or fsdp, "
                             f"or --amp bf16 with {self.strategy}")
        if self.offload_optimizer != "none" and (self.strategy != "zero" or self.zero_stage == 3):
            raise ValueError(f"--offload-optimizer {self.offload_optimizer}: ZeRO-Offload needs --strategy zero "
                             f"--zero-stage 1 or 2, not {self.strategy} stage {self.zero_stage}")
        if self.checkpoint_dir and self.strategy == "fsdp":  # said before training, not at the first save
            raise ValueError(_FSDP2_CHECKPOINTS)
        if self.fresh and not self.checkpoint_dir:
            raise ValueError("--fresh deletes the checkpoints of --checkpoint-dir: give --checkpoint-dir too")
        if self.compression != "none" and self.strategy != "ddp":
            raise ValueError(f"--compression {self.compression} is a DDP communication hook: "
                             f"use it with --strategy ddp, not {self.strategy}")


def apply_deepspeed_config(cfg: Config, world_size: int):
    """``--deepspeed-config``: the file's stage, offload, bucket size, precision and batch replace those flags.

    Stage 0 is ``--strategy ddp``, 1-3 ``--strategy zero``; its optimizer replaces SGD. The capstone
    steps once per global batch: ``gradient_accumulation_steps`` must be 1 (demos/zero.py accumulates).
    """
    from distlab.lessons.zero_config import load_zero_config

    ds = load_zero_config(cfg.deepspeed_config, world_size)
    if ds.gradient_accumulation_steps != 1:
        raise ValueError(f"{cfg.deepspeed_config}: gradient_accumulation_steps {ds.gradient_accumulation_steps}: the "
                         "capstone takes one step per global batch; set it to 1 (demos/zero.py accumulates)")
    changes = {"strategy": "zero" if ds.stage else "ddp", "zero_stage": ds.stage or cfg.zero_stage,
               "global_batch": ds.train_batch_size, "offload_optimizer": ds.offload_device or "none",
               "amp": {"bfloat16": "bf16", "float16": "fp16"}.get(ds.dtype, "none")}
    if ds.bucket_size_mb is not None:
        changes["bucket_mb"] = ds.bucket_size_mb
    return dataclasses.replace(cfg, **changes), ds


def checkpoint_config(cfg: Config, world_size: int, ds=None) -> dict:
    """What a checkpoint of this run must match to be resumed: the model and its input, the state's layout
    (ddp and ours both keep the whole model and torch's optimizer state), the optimizer, and for ZeRO,
    whose shards are per rank, the world size that wrote them. Kept in meta.pt; a resume that does not
    fit is refused, naming what differs (distlab/lessons/ckpt_entries.py)."""
    strategy = {"ddp": "ddp or ours", "ours": "ddp or ours", "zero": f"zero-{cfg.zero_stage}"}.get(cfg.strategy,
                                                                                                 cfg.strategy)
    config = {"model": cfg.model, "dataset": cfg.dataset, "image size": cfg.image_size, "strategy": strategy,
              "optimizer": ds.optimizer_class.__name__ if ds is not None and ds.optimizer_class else "SGD"}
    if cfg.strategy == "zero":
        config["world size"] = world_size
    return config


def build_model(name: str, num_classes: int, image_size: int) -> nn.Module:
    import torchvision.models as tvm

    if name.startswith("resnet"):
        model = getattr(tvm, name)(num_classes=num_classes)
        if image_size <= 64:  # ImageNet's 7x7/2 stem + max-pool would leave 1x1 maps of a 32 px image
            model.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            model.maxpool = nn.Identity()
        return model
    if name == "vit_b_16":
        return tvm.vit_b_16(image_size=image_size, num_classes=num_classes)
    patch = max(2, image_size // 8)
    return tvm.VisionTransformer(image_size=image_size, patch_size=patch, num_layers=4, num_heads=4,
                                 hidden_dim=128, mlp_dim=256, num_classes=num_classes)


class _RGB(Dataset):
    """Grey images as 3 identical channels (digits), so every torchvision model applies."""

    def __init__(self, base: Dataset) -> None:
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x.expand(3, *x.shape[1:]), y


def build_data(cfg: Config) -> tuple[Dataset, Dataset, int]:
    from distlab import data

    if cfg.dataset == "digits":
        return _RGB(data.digits("train", cfg.image_size)), _RGB(data.digits("test", cfg.image_size)), 10
    if cfg.dataset == "cifar10":
        return (data.cifar10(cfg.data_root, "train", cfg.download, augment=True),
                data.cifar10(cfg.data_root, "test", cfg.download), 10)
    if cfg.dataset == "imagefolder":
        train = data.imagefolder(cfg.data_root, "train", cfg.image_size, augment=True)
        return train, data.imagefolder(cfg.data_root, "val", cfg.image_size), len(train.classes)
    raise ValueError(f"--dataset {cfg.dataset!r}: choose digits, cifar10 or imagefolder")


class Engine:
    """One strategy behind one interface: forward, backward, step, state."""

    def __init__(self, cfg: Config, model: nn.Module, device: torch.device, ds=None) -> None:
        self.cfg, self.kind = cfg, cfg.strategy
        opt_class, opt_kwargs = torch.optim.SGD, dict(lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
        if ds is not None and ds.optimizer_class is not None:  # --deepspeed-config's optimizer
            opt_class, opt_kwargs = ds.optimizer_class, ds.optimizer_kwargs
        if cfg.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        model = model.to(device)
        if self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                 bucket_cap_mb=cfg.bucket_mb)
            if cfg.compression != "none":
                hook, state = load("phase4_production", "compression").make_hook(cfg.compression)
                self.model.register_comm_hook(state, hook)
            self.optimizer = opt_class(self.model.parameters(), **opt_kwargs)
        elif self.kind == "ours":
            DDPBucketed = load("phase3_multi_node", "ddp_bucketed").DDPBucketed
            self.model = DDPBucketed(model, bucket_size_mb=cfg.bucket_mb)
            self.optimizer = opt_class(self.model.parameters(), **opt_kwargs)
        elif self.kind == "zero" and cfg.zero_stage < 3:
            ZeroOptimizer = load("phase3_multi_node", "zero").ZeroOptimizer
            self.model = model
            broadcast_module(model)  # buffers too: ZeroOptimizer broadcasts only the parameters it owns
            zkw = {"stage": cfg.zero_stage, "bucket_size_mb": cfg.bucket_mb, **(ds.zero_kwargs() if ds else {}),
                   "offload_device": None if cfg.offload_optimizer == "none" else cfg.offload_optimizer}
            self.zero = ZeroOptimizer(model.parameters(), opt_class, **zkw, **opt_kwargs)
            self.optimizer = self.zero  # a torch Optimizer: the LR scheduler drives it directly
        elif self.kind == "zero":
            FullyShardedDataParallel = load("phase3_multi_node", "fsdp").FullyShardedDataParallel
            self.model = FullyShardedDataParallel(model, **(ds.fsdp_kwargs() if ds else {}))  # units: blocks
            self.optimizer = opt_class(self.model.parameters(), **opt_kwargs)  # torch's, on the flat shards
            self.fsdp_state = load("phase3_multi_node", "fsdp_state")
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))  # FSDP2 shards on its device
            # one FSDP unit per residual stage / encoder block; inner ones first (FSDP2 shards
            # a module after the modules nested in it)
            for m in reversed(list(model.modules())):
                if m is not model and type(m).__name__ in ("Sequential", "EncoderBlock") and \
                        any(p.requires_grad for p in m.parameters()):
                    fully_shard(m, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            self.optimizer = opt_class(self.model.parameters(), **opt_kwargs)

    def step(self) -> None:
        if self.kind == "ours":
            self.model.finish_gradient_synchronization()
        if self.kind == "zero" and self.cfg.zero_stage < 3:
            self.zero.step()
        else:
            self.optimizer.step()

    def zero_grad(self) -> None:
        target = self.zero if self.kind == "zero" and self.cfg.zero_stage < 3 else self.optimizer
        target.zero_grad()

    def state_dict(self) -> dict:
        if self.kind in ("ddp", "ours"):
            return {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.kind == "zero" and self.cfg.zero_stage < 3:
            return {"model": self.model.state_dict(), "zero": self.zero.sharded_state_dict()}
        if self.kind == "zero":
            return {"fsdp": self.fsdp_state.sharded_state_dict(self.model, self.optimizer)}
        raise ValueError(_FSDP2_CHECKPOINTS)

    def load_state_dict(self, state: dict) -> None:
        if self.kind in ("ddp", "ours"):
            self.model.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        elif self.kind == "zero" and self.cfg.zero_stage < 3:
            self.model.load_state_dict(state["model"])
            self.zero.load_sharded_state_dict(state["zero"])
        else:
            self.fsdp_state.load_sharded_state_dict(self.model, state["fsdp"], self.optimizer)


def _batches(dataset: Dataset, sampler, steps: int, workers: int, pin_memory: bool):
    """Yield (images, labels, sampler state after this step) for ``steps`` steps.

    Indices are drawn an epoch's worth at a time and handed to a DataLoader (so
    ``workers`` processes decode ahead); the sampler state travels with each batch,
    because the loader runs ahead of training and a checkpoint must record where
    *training* is, not where prefetching is.
    """
    while steps > 0:
        n = min(steps, sampler.steps_per_epoch())
        indices, states = zip(*[(sampler.next_indices(), sampler.state_dict()) for _ in range(n)])
        loader = DataLoader(dataset, batch_sampler=list(indices), num_workers=workers, pin_memory=pin_memory)
        for (x, y), state in zip(loader, states):
            yield x, y, state
        steps -= n


def lr_lambda(cfg: Config, total_steps: int):
    """Linear warm-up to the base rate, then cosine decay to zero."""
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset, device: torch.device, rank: int, world_size: int,
             batch_size: int = 256) -> float:
    """Top-1 accuracy over the whole set: each rank scores a strided shard, counts are summed.

    Collective: forward is one for ZeRO-3/FSDP (and buffer broadcasts), so every rank runs
    the same number of batches: a rank whose shard is shorter runs padding batches (repeats
    of its first sample, or of sample 0) that are not counted. Every sample is counted once.
    """
    model.eval()
    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))
    steps = math.ceil(math.ceil(len(dataset) / world_size) / batch_size)  # rank 0's shard is the longest
    counts = torch.zeros(2, device=device, dtype=torch.float64)  # exact counts up to 2**53 images
    batches = iter(DataLoader(shard, batch_size=batch_size))
    pad = dataset[rank if rank < len(dataset) else 0][0].unsqueeze(0)
    for _ in range(steps):
        x, y = next(batches, (pad, None))
        hits = model(x.to(device)).argmax(1)
        if y is not None:
            counts += torch.tensor([(hits == y.to(device)).sum().item(), len(y)], device=device)
    model.train()
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def resume(manager: Any, engine: Engine, scheduler: Any, sampler: Any, scaler: Any, env: Any,
           checkpoint: Any) -> Any:
    """Load the newest checkpoint of ``manager`` that loads into this run and return it; None: none does.

    A checkpoint that verifies can still fail to load: another model's shapes, a file that
    ``weights_only`` refuses, another world size that ``--strategy zero`` cannot reshard.
    ``manager.restore`` (distlab/lessons/resume.py) then warns, naming the directory and the reason, and
    tries the one before; every rank takes the same one. A checkpoint is loaded whole or not at
    all: each try starts from the state at step 0 (a snapshot taken before the first), because a
    failed one may stop part-way (``load_state_dict`` copies every tensor whose shape fits before
    it raises) or load on this rank and fail on another; a run that takes none is put back at step 0.
    What a checkpoint holds: the engine (model, optimizer or ZeRO/FSDP shards), the LR scheduler,
    the sampler's position, the fp16 loss scaler's scale and growth count (a run without fp16
    saves none, and then the scaler starts fresh) and, at the world size that wrote it, this
    rank's RNG streams.

    Collective: every rank calls it; one all-reduce per checkpoint tried.
    """
    fresh: dict = {}  # step 0: copies, since state_dict() shares the live tensors

    def reset() -> None:
        state = copy.deepcopy(fresh)  # load_state_dict may keep what it is given: never the snapshot itself
        engine.load_state_dict(state["engine"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        if state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        checkpoint.restore_rng_state(state["rng"])

    def apply(ckpt) -> None:
        same_world = ckpt.world_size == env.world_size
        if not same_world and engine.kind == "zero":
            raise ValueError(f"written by {ckpt.world_size} ranks; --strategy zero resumes at the same world "
                             f"size (this job has {env.world_size})")
        if fresh:
            reset()
        else:
            fresh.update(copy.deepcopy({"engine": engine.state_dict(), "scheduler": scheduler.state_dict(),
                                        "sampler": sampler.state_dict(), "scaler": scaler.state_dict()}),
                         rng=checkpoint.capture_rng_state())
        state = ckpt.load(env.rank if same_world else 0, map_location=env.device)  # ddp/ours: replicated
        engine.load_state_dict(state["engine"])
        scheduler.load_state_dict(state["scheduler"])
        sampler.load_state_dict(state["sampler"])
        if state.get("scaler"):  # empty from a run without fp16 (and absent from older checkpoints)
            scaler.load_state_dict(state["scaler"])
        if same_world:  # the streams are per rank: at another world size they start from the seed
            checkpoint.restore_rng_state(state["rng"])

    found = manager.restore(apply)
    if found is None and fresh:
        reset()
    return found


def train(cfg: Config) -> dict:
    from distlab.launch import init_from_env, shutdown
    from distlab.metrics import StepTimer, format_table, log0, progress, sync_device
    checkpoint, elastic = load("phase4_production", "checkpoint"), load("phase4_production", "elastic")
    CheckpointManager, GlobalBatchSampler = checkpoint.CheckpointManager, elastic.GlobalBatchSampler
    capture_rng_state = checkpoint.capture_rng_state

    env = init_from_env()
    manager = None
    try:
        ds = None
        if cfg.deepspeed_config:  # needs the world size: the batch arithmetic is checked against it
            cfg, ds = apply_deepspeed_config(cfg, env.world_size)
        cfg = resolve_config(cfg, env.world_size)
        torch.manual_seed(cfg.seed)
        train_set, val_set, num_classes = build_data(cfg)
        engine = Engine(cfg, build_model(cfg.model, num_classes, cfg.image_size), env.device, ds)
        sampler = GlobalBatchSampler(len(train_set), cfg.global_batch, env.rank, env.world_size, cfg.seed)
        total = cfg.max_steps or cfg.epochs * sampler.steps_per_epoch()
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lr_lambda(cfg, total))
        manager = (CheckpointManager(cfg.checkpoint_dir, cfg.keep, config=checkpoint_config(cfg, env.world_size, ds))
                   if cfg.checkpoint_dir else None)
        if manager and cfg.fresh:
            manager.start_over()  # the directory's lock first; then only its step_* entries go
        step = 0
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.amp)
        scaler = torch.amp.GradScaler(env.device.type, enabled=cfg.amp == "fp16")
        if manager:
            ckpt = resume(manager, engine, scheduler, sampler, scaler, env, checkpoint)
            if ckpt is None:
                log0(f"no checkpoint in {manager.directory}: starting from step 0")
            elif ckpt.step > total:  # an error, not a silent return of the later model
                given = f"--max-steps {cfg.max_steps}" if cfg.max_steps else f"--epochs {cfg.epochs}"
                raise ValueError(f"{ckpt.path} is at step {ckpt.step}, past the {total} steps of this run ({given}): "
                                 f"pass --max-steps {ckpt.step} or more to continue that run, or --fresh (or "
                                 "another --checkpoint-dir) to start over")
            else:
                step = ckpt.step
                log0(f"resumed from {ckpt.path} (step {step}, written by {ckpt.world_size} ranks)")
        timer = StepTimer(env.device)
        log0(f"{cfg.model} on {cfg.dataset} ({len(train_set)} images, {num_classes} classes), strategy "
             f"{cfg.strategy}{cfg.zero_stage if cfg.strategy == 'zero' else ''}, {env.world_size} ranks "
             f"({env.backend}), global batch {cfg.global_batch}, {total} steps")

        def save(sampler_state: dict) -> None:
            if manager:
                manager.save(step, {"engine": engine.state_dict(), "scheduler": scheduler.state_dict(),
                                    "sampler": sampler_state, "scaler": scaler.state_dict(),
                                    "rng": capture_rng_state(), "step": step})

        start, loss, sampler_state = time.perf_counter(), torch.zeros(()), sampler.state_dict()
        batches = _batches(train_set, sampler, total - step, cfg.workers, env.device.type == "cuda")
        for _ in (bar := progress(range(step, total), desc="train", total=total, initial=step)):
            with timer("data"):
                x, y, sampler_state = next(batches)
                x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            with timer("compute"):
                engine.zero_grad()
                with torch.autocast(env.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(engine.model(x), y)
                scaler.scale(loss).backward()
            with timer("optimizer"):
                if scaler.is_enabled():  # fp16 (ddp/fsdp only): unscale, skip the step on inf/nan
                    scaler.step(engine.optimizer)
                    scaler.update()
                else:
                    engine.step()
                scheduler.step()
            step += 1
            if hasattr(bar, "set_postfix") and step % cfg.log_every == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{scheduler.get_last_lr()[0]:.4f}")
            if step % cfg.checkpoint_every == 0 or step == cfg.stop_at_step:
                save(sampler_state)
            if step == cfg.stop_at_step:
                log0(f"stopping at step {step} (--stop-at-step); run again to resume")
                return {"stopped_at": step}
        sync_device(env.device)  # CUDA work is queued: time it when it is done
        elapsed = time.perf_counter() - start
        if step % cfg.checkpoint_every:
            save(sampler_state)
        accuracy = evaluate(engine.model, val_set, env.device, env.rank, env.world_size)
        times = timer.summary()
        done = max(1, len(timer.times.get("compute", [])))
        summary = {"model": cfg.model, "strategy": cfg.strategy, "ranks": env.world_size, "steps": total,
                   "final loss": f"{loss.item():.3f}", "val accuracy": f"{accuracy:.1%}",
                   "chance": f"{1 / num_classes:.1%}", "images/s": f"{done * cfg.global_batch / elapsed:.0f}",
                   "data/compute/opt s": "/".join(f"{times.get(k, 0):.1f}" for k in ("data", "compute", "optimizer"))}
        log0("\n" + format_table([summary]))
        return {"accuracy": accuracy, "loss": loss.item()}
    finally:
        if manager is not None:
            manager.close()  # the directory is free for the next run, in this process or another
        shutdown()


def resolve_config(cfg: Config, world_size: int) -> Config:
    """The global batch for ``world_size`` ranks: 64 rounded up to a multiple of it, or the one given if it divides.

    The default changes with the world size: an elastic job (NNODES=MIN:MAX) should give
    --global-batch, one that every world size of its range divides.
    """
    positive(cfg, "--epochs", "--image-size", "--checkpoint-every")
    return dataclasses.replace(cfg, global_batch=global_batch(cfg.global_batch, 64, world_size))


def resolve_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """``build_parser()``'s arguments as a run of ``world_size`` ranks trains with (``resolve_config``)."""
    return argparse.Namespace(**dataclasses.asdict(resolve_config(Config(**vars(args)), world_size)))


def build_parser() -> argparse.ArgumentParser:
    """One flag per Config field (``--global-batch`` for ``global_batch``)."""
    parser = argparse.ArgumentParser(description="Capstone: image classification with every strategy of the course.")
    for field, default in Config.__dataclass_fields__.items():
        flag = "--" + field.replace("_", "-")
        value = default.default
        if isinstance(value, bool):
            parser.add_argument(flag, action="store_true")
        else:
            choices = {"strategy": STRATEGIES, "model": MODELS, "amp": ("none", "bf16", "fp16"),
                       "offload_optimizer": ("none", "cpu"),
                       "dataset": ("digits", "cifar10", "imagefolder")}.get(field)
            parser.add_argument(flag, type=int if field == "global_batch" else type(value), default=value,
                                choices=choices)
    return parser


def main(argv: list[str] | None = None) -> dict:
    return train(Config(**vars(build_parser().parse_args(argv))))


if __name__ == "__main__":
    run_demo(main)
