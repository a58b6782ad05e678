"""DeepSpeed-style JSON configs for the course's ZeRO: one file names the stage, offload and batch.

    {"train_batch_size": 32, "gradient_accumulation_steps": 2,
     "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                           "reduce_bucket_size": 5e7, "overlap_comm": true},
     "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}}}

What each key becomes (``ZeroOptimizer`` in phase3_multi_node/zero.py for stages 1-2,
``FullyShardedDataParallel`` in fsdp.py for stage 3; stage 0 is plain data parallelism):

    key                                        here
    zero_optimization.stage                    0-3: ``stage`` (stage 0: DDP, stage 3: FSDP)
    zero_optimization.offload_optimizer.device "cpu" | "none": ``offload_device`` (stages 1-2 only)
    zero_optimization.reduce_bucket_size       bytes: ``bucket_size_mb`` = bytes / 2**20 (stages 1-2)
    zero_optimization.overlap_comm             true: ``max_in_flight=2``; false: 1 reduce-scatter at a time
    bf16.enabled / fp16.enabled                ``dtype`` "bfloat16" / "float16" (the demos map it)
    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size
    optimizer.type / optimizer.params          torch.optim.Adam, AdamW, SGD and their arguments;
                                               "Adam" is AdamW unless ``adam_w_mode`` is false, as
                                               in DeepSpeed (whose default is adam_w_mode=true)

Every other key is refused with the list of supported ones: a setting that would be
silently ignored (a DeepSpeed loss scaler, NVMe offload) is a different training run.
See phase3_multi_node/guidelines_ddp_zero.md#zero-offload-and-deepspeed-style-configs.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
TOP_KEYS = (*BATCH_KEYS, "zero_optimization", "bf16", "fp16", "optimizer")
ZERO_KEYS = ("stage", "offload_optimizer", "reduce_bucket_size", "overlap_comm")
OFFLOAD_KEYS = ("device", "pin_memory")


@dataclass(frozen=True)
class ZeroConfig:
    """A checked DeepSpeed-style config: the course's arguments, batch sizes consistent with W."""

    stage: int = 0
    offload_device: str | None = None          # "cpu" or None
    bucket_size_mb: float | None = None        # None: the caller's default
    overlap_comm: bool = True
    dtype: str = "float32"                     # "bfloat16" | "float16" | "float32"
    train_batch_size: int = 0                  # global, per optimizer step
    micro_batch_size: int = 0                  # per rank, per backward
    gradient_accumulation_steps: int = 1
    optimizer_class: type[torch.optim.Optimizer] | None = None  # None: the caller's default
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)

    def zero_kwargs(self) -> dict[str, Any]:
        """Arguments of ``ZeroOptimizer(params, optimizer_class, **zero_kwargs(), **optimizer_kwargs)``."""
        if self.stage not in (1, 2):
            raise ValueError(f"zero_optimization.stage {self.stage}: ZeroOptimizer is stages 1 and 2 "
                             f"(stage 0 is DDP, stage 3 FullyShardedDataParallel: fsdp_kwargs())")
        kw = {"stage": self.stage, "offload_device": self.offload_device,
              "max_in_flight": 2 if self.overlap_comm else 1}
        return kw if self.bucket_size_mb is None else {**kw, "bucket_size_mb": self.bucket_size_mb}

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Arguments of ``FullyShardedDataParallel(model, **fsdp_kwargs())`` (then the optimizer on its parameters)."""
        if self.stage != 3:
            raise ValueError(f"zero_optimization.stage {self.stage}: FullyShardedDataParallel is stage 3")
        return {"max_in_flight": 2 if self.overlap_comm else 1}


def _section(raw: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a JSON object, got {raw!r}")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ValueError(f"unsupported key(s) {', '.join(where + k for k in unknown)}; supported here: "
                         f"{', '.join(where + k for k in allowed)} (distlab/lessons/zero_config.py)")
    return raw


def _typed(value: Any, key: str, kind: type) -> Any:
    ok = isinstance(value, bool) if kind is bool else \
        isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    if not ok:  # "auto" is filled in by Hugging Face's Trainer, not by DeepSpeed itself
        wanted = "true or false" if kind is bool else f"a number ({kind.__name__})"
        raise ValueError(f"{key} must be {wanted}, got {value!r}")
    return kind(value)


def _batch(raw: dict[str, Any], world_size: int) -> tuple[int, int, int]:
    """DeepSpeed's rule: train_batch_size = micro x accumulation x W; two of them give the third."""
    tbs, micro, gas = (_typed(raw[k], k, int) if k in raw else None for k in BATCH_KEYS)
    for k, v in zip(BATCH_KEYS, (tbs, micro, gas)):
        if v is not None and v < 1:
            raise ValueError(f"{k} must be >= 1, got {v}")
    if tbs is None and micro is None:
        raise ValueError("set train_batch_size or train_micro_batch_size_per_gpu (with gradient_accumulation_steps "
                         "alone the batch is unknown)")
    if tbs is None:
        gas = gas or 1
        return micro * gas * world_size, micro, gas
    if micro is None or gas is None:
        known = micro if micro is not None else (gas or 1)
        if tbs % (known * world_size):
            name = "train_micro_batch_size_per_gpu" if micro is not None else "gradient_accumulation_steps"
            raise ValueError(f"train_batch_size {tbs} is not divisible by {name} {known} x world size {world_size}")
        other = tbs // (known * world_size)
        return (tbs, micro, other) if micro is not None else (tbs, other, gas or 1)
    if tbs != micro * gas * world_size:
        raise ValueError(f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x "
                         f"gradient_accumulation_steps {gas} x world size {world_size} = {micro * gas * world_size}")
    return tbs, micro, gas


def _optimizer(raw: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    raw = _section(raw, "optimizer.", ("type", "params", "adam_w_mode"))
    name = str(raw.get("type", "")).lower()
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.type {raw.get('type')!r}: supported Adam, AdamW, SGD")
    params = raw.get("params", {})
    params = dict(_section(params, "optimizer.params.", tuple(params) if isinstance(params, dict) else ()))
    cls = OPTIMIZERS[name]
    if name == "adam":  # DeepSpeed's Adam decouples weight decay (AdamW) unless adam_w_mode is false
        mode = params.pop("adam_w_mode", raw.get("adam_w_mode", True))
        cls = torch.optim.AdamW if _typed(mode, "optimizer.params.adam_w_mode", bool) else torch.optim.Adam
    elif "adam_w_mode" in raw:
        raise ValueError(f"optimizer.adam_w_mode is for type Adam, not {raw['type']}")
    accepted = tuple(k for k in inspect.signature(cls).parameters if k != "params")
    _section(params, "optimizer.params.", accepted)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return cls, params


def parse_zero_config(raw: dict[str, Any], world_size: int) -> ZeroConfig:
    """Check a config (already read from JSON) against ``world_size`` and map it to the course's arguments."""
    raw = _section(raw, "", TOP_KEYS)
    tbs, micro, gas = _batch(raw, world_size)
    zero = _section(raw.get("zero_optimization", {}), "zero_optimization.", ZERO_KEYS)
    stage = _typed(zero.get("stage", 0), "zero_optimization.stage", int)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    offload = _section(zero.get("offload_optimizer", {}), "zero_optimization.offload_optimizer.", OFFLOAD_KEYS)
    device = str(offload.get("device", "none")).lower()
    if device not in ("cpu", "none"):
        raise ValueError(f"zero_optimization.offload_optimizer.device {device!r}: supported \"cpu\" or \"none\"")
    if device == "cpu" and stage not in (1, 2):
        raise ValueError(f"zero_optimization.offload_optimizer.device \"cpu\" needs stage 1 or 2 (got {stage}): "
                         "the course's FSDP (stage 3) does not offload; torch's FSDP2 has CPUOffloadPolicy")
    if not _typed(offload.get("pin_memory", True), "zero_optimization.offload_optimizer.pin_memory", bool):
        raise ValueError("zero_optimization.offload_optimizer.pin_memory false: offload pins host memory "
                         "whenever the model is on CUDA; remove the key")
    bucket = zero.get("reduce_bucket_size")
    if bucket is not None and _typed(bucket, "zero_optimization.reduce_bucket_size", float) <= 0:
        raise ValueError(f"zero_optimization.reduce_bucket_size must be > 0 bytes, got {bucket}")
    precision = {}
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        section = _section(raw.get(key, {}), key + ".", ("enabled",))
        if _typed(section.get("enabled", False), key + ".enabled", bool):
            precision[key] = dtype
    if len(precision) > 1:
        raise ValueError("bf16.enabled and fp16.enabled are both true: choose one")
    cls, kwargs = _optimizer(raw["optimizer"]) if "optimizer" in raw else (None, {})
    return ZeroConfig(stage=stage, offload_device="cpu" if device == "cpu" else None,
                      bucket_size_mb=None if bucket is None else float(bucket) / 2**20,
                      overlap_comm=_typed(zero.get("overlap_comm", True), "zero_optimization.overlap_comm", bool),
                      dtype=next(iter(precision.values()), "float32"), train_batch_size=tbs, micro_batch_size=micro,
                      gradient_accumulation_steps=gas, optimizer_class=cls, optimizer_kwargs=kwargs)


def load_zero_config(path: str | Path, world_size: int) -> ZeroConfig:
    """Read a DeepSpeed-style JSON file; ``ValueError`` naming the file and the key on any problem."""
    try:
        return parse_zero_config(json.loads(Path(path).read_text()), world_size)
    except (ValueError, OSError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from exc
