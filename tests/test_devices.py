"""Every RUN_MODE puts its model, batches and communicated tensors on ``env.device``.

There is no GPU here, so the test makes one up: ``DeviceAudit`` plays a GPU job on a gloo
world while every mode's ``main`` runs. ``dist.get_backend()`` answers "cpu:gloo,cuda:nccl"
(as on a GPU node), so ``init_from_env`` reports ``env.device = cuda:<rank>``, and:

* a ``TorchFunctionMode`` runs a call naming that device (``.to(env.device)``,
  ``torch.zeros(..., device=env.device)``, ``.cuda()``, ``torch.load(map_location=...)``)
  on the CPU and marks what it makes as "on the device"; results of ops on marked tensors
  are marked too, and ``t.device`` answers ``cuda:<rank>`` to the course's code, so
  ``device=t.device`` works as on a GPU. Tensors made without a device (or by ``.cpu()``)
  are marked "cpu";
* what CUDA refuses raises ``DeviceAuditError``: an op mixing a device tensor with a CPU
  tensor that is not a 0-dim scalar, ``.numpy()`` of a device tensor, a CPU generator
  for a device tensor, another rank's GPU;
* so does what would run on the wrong device: a CPU tensor handed to a ``torch.distributed``
  call by the course's code (NCCL moves CUDA tensors only; on a gloo side group, made with
  ``new_group(backend="gloo")``, CPU control messages are fine), torch's DDP wrapping a
  model whose parameters are not on the device, a DeviceMesh of another device type, and
  ``fully_shard`` without such a mesh (its default follows ``torch.cuda.is_available()``).

Tensors made inside torch's C++ (autograd's gradients, DDP's buckets) carry no mark and
pass; a parameter's ``.grad`` takes its parameter's. ``test_device_audit_refuses_...`` checks
the audit itself on small cases. The modes run in one 2-rank world (the parameter server
in a 3-rank one) with the smallest arguments that run their code.
"""
from __future__ import annotations

import functools
import gc
import importlib
import inspect
import os
import re
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from distlab.comm import _LedgerP2POp
from distlab.spawn import run_distributed

REPO = Path(__file__).resolve().parents[1]

_TB = torch._C.TensorBase
# Calls that may take tensors of two devices on a GPU: copies between them, indexing with
# CPU indices, and what only looks at a tensor.
_NO_MIXING_CHECK = {"copy_", "to", "__getitem__", "__setitem__", "_has_compatible_shallow_copy_type", "set_",
                    "__get__", "__set__", "_parse_to", "untyped_storage"}


class DeviceAuditError(AssertionError):
    """A tensor that would be on the wrong device on a GPU."""


def _tensors(value, out: list) -> list:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensors(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors(v, out)
    return out


def _caller(depth: int = 2) -> str:
    """The module that called: past torch's dispatch glue (torch._ops, torch._tensor, ...)."""
    frame = sys._getframe(depth)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("torch._", "torch.overrides", "torch.utils._")):
            return name
        frame = frame.f_back
    return ""


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} tensor of shape {tuple(t.shape)}"


def _where() -> str:
    """The innermost frame of the course's code (not torch, not this file): where to look."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("torch", __name__, "test_devices", "distlab.comm", "distlab.doctor")):
            return f"{frame.f_code.co_filename.replace(str(REPO) + os.sep, '')}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


class DeviceAudit(TorchFunctionMode):
    """Simulate ``device`` (a CUDA device) on the CPU and refuse what CUDA would (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        # id(tensor) -> (weak reference, "dev" or "cpu"); a tensor not in it is unknown (made in C++).
        # Not in the tensor's __dict__: a mark must not travel with it into torch.save's pickles.
        self._marks: dict[int, tuple[weakref.ref, str]] = {}
        self.meshes: set[int] = set()  # ids of the DeviceMeshes made for self.device (really on the CPU)
        self.cpu_groups: set = set()  # groups made with backend="gloo"
        self._saved: list[tuple[object, str, object]] = []

    # --- marks ---------------------------------------------------------------------------
    def mark(self, t: torch.Tensor) -> str | None:
        entry = self._marks.get(id(t))
        if entry is not None and entry[0]() is t:
            return entry[1]
        if isinstance(t, DTensor):  # where its mesh is
            return "dev" if id(t.device_mesh._get_root_mesh()) in self.meshes else "cpu"
        return None

    def set_mark(self, t: torch.Tensor, mark: str | None) -> None:
        key, marks = id(t), self._marks
        if mark is None:
            marks.pop(key, None)
            return

        def forget(ref: weakref.ref) -> None:
            if marks.get(key, (None,))[0] is ref:
                del marks[key]
        marks[key] = (weakref.ref(t, forget), mark)

    def is_ours(self, device) -> bool | None:
        """True for this rank's (fake) device, False for the CPU, None when ``device`` names neither."""
        if device is None or isinstance(device, int) and not isinstance(device, bool):
            return None if device is None else self._check_index(device)
        if not isinstance(device, (str, torch.device)):
            return None
        try:
            device = torch.device(device)
        except (RuntimeError, ValueError):
            return None
        if device.type == "cpu":
            return False
        if device.type == "meta":  # shapes without storage (reading a pickle's metadata): the same on a GPU job
            return None
        if device.type != self.device.type:
            raise DeviceAuditError(f"{device} named at {_where()}, but env.device is {self.device}")
        return True if device.index is None else self._check_index(device.index)

    def _check_index(self, index: int) -> bool:
        if index != self.device.index:
            raise DeviceAuditError(f"rank {self.device.index} used cuda:{index} at {_where()}: "
                                   f"env.device is {self.device} (one GPU per rank)")
        return True

    # --- the mode ------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name == "__get__" and owner is _TB.device:  # torch's own code sees the real (CPU) device
            ours = self.mark(args[0]) == "dev" and not _caller().startswith("torch")
            return self.device if ours else func(*args, **kwargs)
        if name == "__get__" and owner is _TB.is_cuda:
            return self.mark(args[0]) == "dev"
        if name == "__get__" and owner is _TB.grad:
            grad = func(*args, **kwargs)
            if grad is not None and self.mark(grad) is None:
                self.set_mark(grad, "dev" if self.mark(args[0]) == "dev" else "cpu")
            return grad
        if name == "__set__" and owner is _TB.data:
            func(*args, **kwargs)
            self.set_mark(args[0], self.mark(args[1]))
            return None
        inputs = []
        for a in args:
            if isinstance(a, torch.Tensor):
                inputs.append(a)
            elif isinstance(a, (list, tuple)):
                _tensors(a, inputs)
        if kwargs:
            _tensors(kwargs, inputs)
        marks = [self.mark(t) for t in inputs]
        if name in ("numpy", "__array__") and "dev" in marks and not _caller().startswith("torch"):
            raise DeviceAuditError(f"{name}() of a {_describe(inputs[0])} on {self.device} at {_where()}: "
                                   "CUDA tensors need .cpu() first")

        # Where the result goes: this device (True), the CPU (False), or where the inputs are (None).
        target = self.is_ours(kwargs.get("device"))
        if name in ("to", "cuda") and func in (torch.Tensor.to, torch.Tensor.cuda):
            if name == "cuda":
                target = self.is_ours(args[1] if len(args) > 1 else kwargs.get("device", self.device))
                args, kwargs = (args[0], "cpu"), {k: v for k, v in kwargs.items() if k == "non_blocking"}
                func = torch.Tensor.to
            else:
                for i, a in enumerate(args[1:], 1):
                    if isinstance(a, torch.Tensor):  # .to(other): other's device and dtype
                        target = {"dev": True, "cpu": False}.get(self.mark(a))
                        args = args[:i] + (a.dtype,) + args[i + 1:]
                    elif self.is_ours(a) is not None:
                        target = self.is_ours(a)
                        args = args[:i] + ("cpu",) + args[i + 1:]
            if target is not None and marks[0] != ("dev" if target else "cpu"):
                kwargs["copy"] = True  # a move between devices makes a new tensor, never the same one
        elif name == "cpu" and func is torch.Tensor.cpu:
            target = False
            if marks[0] != "cpu":
                func, args = torch.Tensor.to, (args[0], "cpu")
                kwargs["copy"] = True
        if target is False and _caller().startswith("torch.distributed"):
            # torch's moves to a mesh's device: the real mesh is on the CPU, the one asked for is ours
            target = True if self.meshes else None
        if "device" in kwargs and target:
            kwargs["device"] = "cpu"
        if target and isinstance(kwargs.get("generator"), torch.Generator) and \
                kwargs["generator"].device.type != self.device.type:
            raise DeviceAuditError(f"{name} on {self.device} with a {kwargs['generator'].device} generator at "
                                   f"{_where()}: CUDA needs a generator of the tensor's device")
        if target is None and name not in _NO_MIXING_CHECK and "dev" in marks and "cpu" in marks and \
                not _caller().startswith("torch.distributed"):  # FSDP2/DTensor place by the (CPU) mesh
            # CUDA takes 0-dim CPU tensors as scalars, nothing else.
            cpu = next((t for t, m in zip(inputs, marks) if m == "cpu" and t.dim() > 0), None)
            if cpu is not None:
                raise DeviceAuditError(f"{name} mixes tensors on {self.device} with a CPU {_describe(cpu)} at "
                                       f"{_where()}: on a GPU this raises 'Expected all tensors to be on the "
                                       "same device'")
        out = func(*args, **kwargs)

        if target is None:
            if "dev" in marks:
                mark = "dev"
            elif "cpu" in marks or (not inputs and not _caller().startswith("torch.distributed")):
                mark = "cpu"  # made on the CPU by the course's code (or torch.nn's constructors)
            else:
                return out
        else:
            mark = "dev" if target else "cpu"
        for t in _tensors(out, []):
            if not any(t is i for i in inputs) or self.mark(t) is None:  # x.add_(y) stays where x is
                self.set_mark(t, mark)
        return out

    # --- what is not a torch function ----------------------------------------------------
    def check_communicated(self, op: str, tensors: list[torch.Tensor], group) -> None:
        if group in self.cpu_groups:  # a gloo side group: CPU control messages belong there
            return
        for t in tensors:
            if self.mark(t) == "cpu":
                raise DeviceAuditError(f"dist.{op} got a CPU {_describe(t)} at {_where()}, but env.device is "
                                       f"{self.device}: NCCL moves CUDA tensors only")

    def patch(self, owner, name: str, make) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, original))
        setattr(owner, name, make(original))

    def __enter__(self):
        audit = self

        def dist_op(op, original):
            signature = inspect.signature(original)

            @functools.wraps(original)  # CommLedger reads the signature for the payload argument
            def wrapper(*args, **kwargs):
                if not _caller().startswith("torch"):  # torch's own calls use the mesh's device
                    if op == "batch_isend_irecv":
                        for p in args[0] if args else kwargs["p2p_op_list"]:
                            audit.check_communicated(op, [p.tensor], p.group)
                    else:
                        group = signature.bind(*args, **kwargs).arguments.get("group")
                        audit.check_communicated(op, _tensors((args, kwargs), []), group)
                return original(*args, **kwargs)
            wrapper.__wrapped_by_ledger__ = original  # P2POp(dist.isend, ...) still finds torch's isend
            return wrapper

        for op in ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
                   "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv",
                   "isend", "irecv", "batch_isend_irecv", "all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, op):
                self.patch(dist, op, lambda original, op=op: dist_op(op, original))

        self.patch(dist, "P2POp", lambda original: _LedgerP2POp)

        # The world is gloo; the course's code sees the backend string of a GPU job, and may
        # make gloo side groups for CPU control messages, as on a GPU.
        def new_group(original):
            signature = inspect.signature(original)

            def make(*args, **kwargs):
                group = original(*args, **kwargs)
                if str(signature.bind(*args, **kwargs).arguments.get("backend")).lower() == "gloo":
                    audit.cpu_groups.add(group)
                return group
            return make
        self.patch(dist, "new_group", new_group)

        def get_backend(original):
            def backend(group=None):
                real = original(group)
                if _caller().startswith("torch") or group in audit.cpu_groups or real != "gloo":
                    return real
                return f"cpu:gloo,{audit.device.type}:nccl"
            return backend
        self.patch(dist, "get_backend", get_backend)

        def parameter_new(original):
            def new(cls, data=None, requires_grad=True):
                p = original(cls, data, requires_grad)
                if data is not None:
                    audit.set_mark(p, audit.mark(data))
                return p
            return new
        self.patch(torch.nn.Parameter, "__new__", parameter_new)

        def ddp_init(original):
            def init(ddp, module, *args, **kwargs):
                for n, p in module.named_parameters():
                    if audit.mark(p) != "dev":
                        raise DeviceAuditError(f"DistributedDataParallel over a model whose {n} is not on "
                                               f"{audit.device} at {_where()}: move the model first")
                bound = inspect.signature(original).bind(ddp, module, *args, **kwargs).arguments
                for i in bound.pop("device_ids", None) or []:  # the real module is on the CPU: no device_ids
                    audit.is_ours(i)
                bound.pop("self", None)
                return original(ddp, **bound)
            return init
        self.patch(torch.nn.parallel.DistributedDataParallel, "__init__", ddp_init)

        import torch.distributed.device_mesh as device_mesh
        import torch.distributed.fsdp as fsdp

        def init_mesh(original):
            def init(device_type, *args, **kwargs):
                if device_type != audit.device.type:
                    raise DeviceAuditError(f"a {device_type!r} DeviceMesh at {_where()}, but env.device is "
                                           f"{audit.device}: build it with env.device.type")
                mesh = original("cpu", *args, **kwargs)
                audit.meshes.add(id(mesh))
                return mesh
            return init
        self.patch(device_mesh, "init_device_mesh", init_mesh)

        def shard(original):
            def fully_shard(module, *args, mesh=None, **kwargs):
                if mesh is None or id(mesh._get_root_mesh()) not in audit.meshes:
                    raise DeviceAuditError(f"fully_shard at {_where()} without a mesh of env.device's type "
                                           f"({audit.device.type}): its default follows torch.cuda.is_available()")
                return original(module, *args, mesh=mesh, **kwargs)
            return fully_shard
        self.patch(fsdp, "fully_shard", shard)

        def swap(original):
            def swap_tensors(t1, t2):  # Module.to's other way: the Python objects trade contents
                m1, m2 = audit.mark(t1), audit.mark(t2)
                original(t1, t2)
                audit.set_mark(t1, m2)
                audit.set_mark(t2, m1)
            return swap_tensors
        self.patch(torch.utils, "swap_tensors", swap)

        def load(original):
            def wrapper(*args, map_location=None, **kwargs):
                target = audit.is_ours(map_location)
                out = original(*args, map_location="cpu" if target else map_location, **kwargs)
                for t in _tensors(out, []) if target is not None else ():
                    audit.set_mark(t, "dev" if target else "cpu")
                return out
            return wrapper
        self.patch(torch, "load", load)

        # What the modes ask of CUDA, answered for the fake device (naming another GPU raises).
        for name, fake in (("synchronize", lambda device=None: audit.is_ours(device)),
                           ("set_device", lambda d: audit.is_ours(d)),
                           ("current_device", lambda: audit.device.index),
                           ("max_memory_allocated", lambda device=None: 0),
                           ("reset_peak_memory_stats", lambda device=None: None),
                           ("get_rng_state", lambda device="cuda": torch.get_rng_state()),
                           ("set_rng_state", lambda state, device="cuda": None)):
            self.patch(torch.cuda, name, lambda original, fake=fake: fake)
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()
        return super().__exit__(*exc)


# --------------------------------------------------------------------------- every mode
def entrypoint_modes() -> dict[str, str]:
    text = (REPO / "entrypoint.sh").read_text()
    return dict(re.findall(r"^\s*\[(\w+)\]=([\w.]+)\s*$", text, flags=re.M))


def tiny_runs(out: str, world_size: int) -> list[tuple[str, list[str]]]:
    """(mode, argv): each mode with the smallest arguments that still run its code paths."""
    w = str(world_size)
    one_step = ["--epochs", "1", "--global-batch", str(1437 // world_size * world_size)]  # digits' 1437 images
    runs = [
        ("comm", ["--numel", "7", "--repeats", "1"]),
        ("train", ["--size", "5", "--epochs", "1"]),
        ("data_parallel_naive", [*one_step, "--image-size", "8"]),
        ("data_parallel_naive_grad_accumulation", [*one_step, "--micro-batch", "400", "--image-size", "8"]),
        ("mixed_precision", ["--steps", "1", "--global-batch", w, "--dtypes", "float32,float16"]),
        ("activation_checkpointing", ["--steps", "1", "--warmup", "0", "--global-batch", w, "--n-layer", "2"]),
        ("model_split", ["--epochs", "1", "--batch", "1000", "--hidden", "8"]),
        *[(f"pipeline_{s}", ["--schedule", s, "--microbatches", w, "--batch", "1200", "--hidden", "8",
                             "--layers-per-stage", "2", "--epochs", "1", "--out-dir", f"{out}/pipeline"])
          for s in ("gpipe", "1f1b", "interleaved")],
        ("tensor_parallel", ["--steps", "1", "--batch", "2", "--n-head", w, "--n-embd", str(8 * world_size)]),
        ("tp_dp_2d", ["--steps", "1", "--global-batch", w, "--tp-size", "1"]),
        ("sequence_parallel", ["--seq-len", str(2 * world_size), "--batch", "1", "--n-embd", str(4 * world_size),
                               "--n-head", w]),
        ("ring_allreduce", ["--sizes-mb", "0.0001", "--repeats", "1"]),
        ("parameter_server", ["--steps", "2", "--per-worker-batch", "4"]),
        ("data_parallel_overlap", one_step),
        ("data_parallel_bucket_overlap", one_step),
        ("zero", ["--stage", "2", "--steps", "1", "--batch", "1"]),
        ("zero", ["--stage", "3", "--steps", "1", "--batch", "1"]),
        ("fault_tolerance", ["--steps", "2", "--global-batch", w, "--ckpt-every", "1", "--fresh",
                             "--ckpt-dir", f"{out}/ft"]),
        ("fault_tolerance", ["--steps", "3", "--global-batch", w, "--ckpt-dir", f"{out}/ft"]),  # resumes
        ("compression", ["--methods", "fp16", "topk", "powersgd", "--epochs", "1"]),  # "none" sends DDP's bucket
        ("monitoring", ["--steps", "2", "--interval", "1", "--global-batch", str(2 * world_size),
                        "--out-dir", f"{out}/monitoring"]),
        ("imagenet", ["--model", "vit_tiny", "--image-size", "8", "--max-steps", "1", "--global-batch", w,
                      "--warmup-steps", "1"]),
        ("context_parallel", ["--seq-len", str(2 * world_size), "--heads", w, "--head-dim", "2", "--repeats", "1"]),
        ("expert_parallel", ["--steps", "1", "--batch", str(2 * world_size), "--experts", str(max(2, world_size)),
                             "--out-dir", f"{out}/experts"]),
        ("device_mesh", ["--steps", "1", "--global-batch", w, "--tp-size", w]),
        ("sharded_checkpoint", ["--dir", f"{out}/sharded", "--steps", "3"]),  # saves
        ("sharded_checkpoint", ["--dir", f"{out}/sharded", "--steps", "3"]),  # loads what it saved
        ("tour", ["--quick", "--steps", "1", "--hidden", str(2 * world_size), "--out", f"{out}/tour", "--only",
                  *_one_strategy_per_family()]),
    ]
    return runs


def _one_strategy_per_family() -> list[str]:
    """The tour's strategies, one of each family (data, tensor, pipeline parallel, ...): its own lines
    run for each family, the rest is the lessons' code that the other modes run."""
    from demos.tour import STRATEGIES

    first = {}
    for name, (family, _) in STRATEGIES.items():
        if name != "single process":  # the baseline: the tour always runs it
            first.setdefault(family, name)
    return list(first.values())


def _fake_plots_and_digits() -> None:
    """Stand-ins for what costs seconds per rank and touches no device: matplotlib (the plots take
    lists of floats) and scikit-learn (digits' pixel values; ``distlab.data.digits`` still makes the
    tensors, same shapes, here)."""
    plots = types.ModuleType("distlab.plots")
    for name in ("plot_loss_curves", "plot_timeline", "plot_bandwidth", "plot_bars", "plot_panels"):
        setattr(plots, name, lambda *args, **kwargs: Path(str(args[1] if len(args) > 1 else kwargs.get("path"))))
    for name in ("loss_panels", "bar_panels"):  # what a figure lays out: no panels, nothing drawn
        setattr(plots, name, lambda *args, **kwargs: [])
    sys.modules["distlab.plots"] = plots
    datasets = types.ModuleType("sklearn.datasets")
    g = torch.Generator().manual_seed(0)
    raw = types.SimpleNamespace(images=torch.randint(17, (1797, 8, 8), generator=g).numpy(),
                                target=torch.randint(10, (1797,), generator=g).numpy())
    datasets.load_digits = lambda: raw
    sys.modules["sklearn.datasets"] = datasets
    sys.modules["torch.utils.tensorboard"] = None  # monitoring's optional writer: ImportError, skipped


def _worker_modes(rank, world_size, runs):
    """Each (mode, module, argv) in turn under the audit; returns {mode: seconds}."""
    import time

    _fake_plots_and_digits()
    seconds = {}
    with DeviceAudit(torch.device("cuda", rank)):
        for mode, module, argv in runs:
            start = time.perf_counter()
            try:
                importlib.import_module(module).main(argv)
            except DeviceAuditError as exc:
                raise DeviceAuditError(f"RUN_MODE={mode}: {exc}") from None
            gc.freeze()  # each mode's shutdown() collects garbage: only the next mode's, not all so far
            seconds[mode] = seconds.get(mode, 0.0) + time.perf_counter() - start
    return seconds


# --------------------------------------------------------------------------- the tests
def _worker_audit_cases(rank, world_size):
    """Each case: (what, the code, whether CUDA would refuse it); returns the cases the audit got wrong."""
    import torch.nn as nn

    dev = torch.device("cuda", rank)
    cases = {
        "a CPU tensor all-reduced": (lambda: dist.all_reduce(torch.ones(3)), True),
        "a tensor made on the device all-reduced": (lambda: dist.all_reduce(torch.ones(3, device=dev)), False),
        "a model left on the CPU fed a batch on the device":
            (lambda: nn.Linear(3, 2)(torch.ones(4, 3).to(dev)), True),
        "a moved model fed a batch left on the CPU": (lambda: nn.Linear(3, 2).to(dev)(torch.ones(4, 3)), True),
        "a moved model fed a moved batch": (lambda: nn.Linear(3, 2).to(dev)(torch.ones(4, 3).to(dev)), False),
        "the gradients of a model left on the CPU all-reduced":
            (lambda: [dist.all_reduce(p.grad) for p in _backward(nn.Linear(3, 2), torch.ones(4, 3))], True),
        "the gradients of a moved model all-reduced":
            (lambda: [dist.all_reduce(p.grad) for p in _backward(nn.Linear(3, 2).to(dev), torch.ones(4, 3).to(dev))],
             False),
        "zeros(device=t.device) beside a device tensor":
            (lambda: (lambda t: t + torch.zeros(2, device=t.device))(torch.ones(2).to(dev)), False),
        "a CPU accumulator for device tensors": (lambda: torch.zeros(2).add_(torch.ones(2).to(dev)), True),
        "a 0-dim CPU scalar with a device tensor": (lambda: torch.ones(2).to(dev) * torch.tensor(2.0), False),
        ".numpy() of a device tensor": (lambda: torch.ones(2).to(dev).numpy(), True),
        "a device tensor brought back with .cpu().numpy()": (lambda: torch.ones(2).to(dev).cpu().numpy(), False),
        "torch's DDP over a CPU model": (lambda: nn.parallel.DistributedDataParallel(nn.Linear(3, 2)), True),
        "another rank's GPU": (lambda: torch.ones(2).to(f"cuda:{rank + 1}"), True),
        "a 'cpu' DeviceMesh": (lambda: __import__("torch.distributed.device_mesh").distributed.device_mesh
                               .init_device_mesh("cpu", (world_size,)), True),
    }
    wrong = []
    with DeviceAudit(dev):
        for what, (code, refused) in cases.items():
            try:
                code()
                raised = False
            except DeviceAuditError:
                raised = True
            if raised != refused:
                wrong.append(f"{what}: {'refused' if raised else 'let through'}")
    return wrong


def _backward(model, x):
    model(x).sum().backward()
    return list(model.parameters())


def test_device_audit_refuses_what_cuda_refuses_and_nothing_else():
    assert run_distributed(_worker_audit_cases, 1, timeout_s=60) == [[]]


def test_resolve_device_and_backend(monkeypatch):
    from distlab.devices import DEVICE_ENV, resolve_backend, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    assert resolve_device(1, 2) == torch.device("cuda", 1)  # one GPU per local rank
    assert resolve_device(1, 4) == torch.device("cpu")  # fewer GPUs than local ranks
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device(1, 2) == torch.device("cpu")
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    assert resolve_device(3, 4) == torch.device("cuda", 3)
    monkeypatch.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(ValueError, match="DISTLAB_DEVICE='tpu'"):
        resolve_device(0, 1)
    # "auto" gives NCCL only for CUDA tensors, and gloo beside it for the CPU ones.
    assert resolve_backend("auto", 1, torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert resolve_backend("auto", 1, torch.device("cpu")) == "gloo"
    assert resolve_backend("auto", 1) == "gloo"  # run_distributed's workers: CPU tensors, even with a GPU here
    assert resolve_backend("nccl", 4, torch.device("cpu")) == "nccl"  # asked for: given


def _worker_env_device(rank, world_size):
    from distlab.launch import init_from_env

    torch.cuda.set_device = lambda device: None  # no GPU here: only the choice is checked
    return init_from_env().device


def test_init_from_env_in_a_gloo_world_follows_distlab_device(monkeypatch):
    monkeypatch.setenv("DISTLAB_DEVICE", "cpu")
    assert run_distributed(_worker_env_device, 2, timeout_s=60) == [torch.device("cpu")] * 2
    monkeypatch.setenv("DISTLAB_DEVICE", "cuda")  # CUDA tensors on gloo: cuda:rank, sharing the GPUs there are
    gpus = torch.cuda.device_count()
    assert run_distributed(_worker_env_device, 2, timeout_s=60) == [torch.device("cuda", r % gpus if gpus else r)
                                                                    for r in range(2)]


def _worker_ledger_sync(rank, world_size, calls):
    import distlab.comm

    distlab.comm.sync_device = lambda device: calls.append(str(device))
    ledger = distlab.comm.CommLedger()
    with ledger:
        dist.all_reduce(torch.ones(2))
        dist.all_reduce(torch.ones(2), async_op=True).wait()
    return calls


def test_timers_synchronise_the_device_before_reading_the_clock(monkeypatch):
    from distlab.metrics import StepTimer, sync_device

    synced = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(str(device)))
    sync_device(torch.device("cpu"))
    sync_device(None)
    assert synced == []  # CPU ops have finished when they return
    sync_device("cuda:1")
    timer = StepTimer(torch.device("cuda", 0))
    with timer("step"):
        pass
    assert synced == ["cuda:1", "cuda:0", "cuda:0"]  # before and after the section
    # CommLedger syncs the payload's device around each synchronous call it times; async ones wait elsewhere.
    assert run_distributed(_worker_ledger_sync, 1, [], timeout_s=60) == [["cpu", "cpu"]]


def test_every_mode_keeps_model_batches_and_communication_on_env_device(tmp_path):
    modes = entrypoint_modes()
    runs = [(mode, modes[mode], argv) for mode, argv in tiny_runs(str(tmp_path), 2)]
    assert {mode for mode, _, _ in runs} == set(modes), "every RUN_MODE of entrypoint.sh needs a run here"
    ran = run_distributed(_worker_modes, 2, [r for r in runs if r[0] != "parameter_server"], timeout_s=240)[0]
    # The parameter server needs two workers besides its server (with one it starts a CPU world of its own).
    ran.update(run_distributed(_worker_modes, 3, [r for r in runs if r[0] == "parameter_server"], timeout_s=120)[0])
    assert set(ran) == set(modes)
