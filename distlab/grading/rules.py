"""Per exercise, torch's own implementation of what it teaches is refused: the rule table and its runtime half.

An exercise that teaches all-reduce scores nothing for calling torch's all-reduce, however it is spelled
(``dist.all_reduce``, ``dist.distributed_c10d.all_reduce``, ``group.allreduce``), and one that teaches a
sampler nothing for handing out torch's ``DistributedSampler``. :data:`RULES` says, per exercise, what is
refused and the one line that says why ("1.1-1.3 teaches all-reduce: write it with send/recv ...").

Two halves read it:

* the static one, before a line of the template runs: distlab/grading/isolation.py's lint refuses imports,
  attribute chains (through aliases) and ``getattr`` names that name a refused built-in (:func:`static_names`);
* the runtime one, here: :func:`install_builtin_rules` handles the ProcessGroup methods every collective ends
  in (C++ methods; through distlab.intercept, outermost: see its PG_ORDER) and wraps torch's ``DistributedSampler``.
  A call is refused with PermissionError when the first frame of the course's own code above it (torch,
  the standard library and the bench's interception wrappers are looked through) is the template of the
  exercise that teaches it. The bench's uses (p2p, a lesson's given building block) and the tests' baselines
  (``dist.all_reduce`` in a test) have their own frame there, so they pass. A torch helper that wraps the
  taught collective (the fp16 DDP hook, ``torch.distributed.nn.functional``) is refused by its file, seen
  between the call and that frame, or when the template's module hands the helper out as its own.

Functional collectives reach the process group from C++, past the ProcessGroup's Python methods: their
Python entry points (``torch.distributed._functional_collectives.all_reduce``, ...) are refused like the
method each stands for; ``torch.ops._c10d_functional`` called directly is not seen at run time (the static
rules refuse its names in every template, :data:`BACKDOORS`).
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from distlab import intercept

_ALL_REDUCE = frozenset({"all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced"})
_REDUCE_SCATTER = frozenset({"reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
                             "reduce_scatter_tensor_coalesced", "reduce_scatter_single",
                             "reduce_scatter_single_coalesced"})
_ALL_GATHER = frozenset({"all_gather", "all_gather_into_tensor", "_all_gather_base", "_allgather_base", "allgather",
                         "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
                         "all_gather_single_coalesced", "all_gather_coalesced", "all_gather_object"})
_FUNCOL = "distributed/_functional_collectives.py"  # torch's functional collectives: C++ ops past the ProcessGroup
# Their public functions, by the ProcessGroup method each stands for (a rule's ``methods`` refuse both).
_FUNCOL_METHODS = {"all_reduce": "allreduce", "all_reduce_coalesced": "allreduce", "all_reduce_inplace": "allreduce",
                   "all_gather_tensor": "allgather", "all_gather_tensor_autograd": "allgather",
                   "all_gather_inplace": "allgather", "all_gather_into_tensor_coalesced": "allgather",
                   "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_autograd": "reduce_scatter",
                   "reduce_scatter_tensor_coalesced": "reduce_scatter", "reduce_scatter_inplace": "reduce_scatter",
                   "all_to_all_single": "all_to_all_single", "all_to_all_single_autograd": "all_to_all_single",
                   "all_to_all_inplace": "all_to_all_single", "broadcast": "broadcast"}
# Named in no template, whatever its exercise: the layers under torch.distributed's functions
# (distributed_c10d, the ProcessGroup class in torch._C) and the functional collectives, which run from C++.
BACKDOORS = frozenset({"distributed_c10d", "_distributed_c10d", "c10d", "_functional_collectives",
                       "_c10d_functional", "_c10d_functional_autograd", "ProcessGroupGloo", "ProcessGroupNCCL"})


@dataclass(frozen=True)
class Rule:
    """What the exercise(s) of one template teach, and torch's built-ins for it that the template may not use.

    ``names``: refused wherever the template names them (an attribute, an import, a ``getattr`` string);
    ``paths``: dotted prefixes refused once aliases are resolved (``import torch.distributed as d; d.nn``);
    ``methods``: ProcessGroup methods refused at run time when the template calls them;
    ``files``: torch source files (under torch/) whose functions the template may not run.
    """

    exercise: str
    phase: str
    template: str
    teaches: str
    names: frozenset = frozenset()
    paths: tuple = ()
    methods: frozenset = frozenset()
    files: tuple = ()

    def line(self, what: str, where: str = "") -> str:
        at = f", called from {where}" if where else ""
        return f"{self.exercise} teaches {self.teaches} (refused: {what}{at}; the exercise scores 0 until it does)"


RULES: tuple[Rule, ...] = (
    Rule("1.1-1.3 all-reduce three ways", "phase1_data_parallel", "collectives",
         "all-reduce: write it with send/recv (1.1), all_gather + a local sum (1.2) and gather + scatter (1.3), "
         "not with torch's all_reduce, reduce or broadcast",
         names=_ALL_REDUCE, methods=_ALL_REDUCE | {"reduce", "broadcast"}),
    Rule("1.4-1.5 distributed sampler", "phase1_data_parallel", "data_loader",
         "the distributed sampler: compute each rank's indices yourself, not with torch's DistributedSampler",
         names=frozenset({"DistributedSampler"}), paths=("torch.utils.data.distributed",),
         files=("utils/data/distributed.py",)),
    Rule("3.1-3.4 ring reduce-scatter, all-gather and all-reduce", "phase3_multi_node", "ring_allreduce",
         "the ring: pass chunks to the right neighbour with send/recv (distlab.p2p), not with torch's collectives",
         names=_ALL_REDUCE | _REDUCE_SCATTER | _ALL_GATHER,
         methods=_ALL_REDUCE | _REDUCE_SCATTER | _ALL_GATHER | {"reduce", "broadcast", "alltoall", "alltoall_base",
                                                                "all_to_all_single", "gather", "scatter",
                                                                "gather_into_tensor", "gather_single"}),
    Rule("4.8-4.10 gradient compression", "phase4_production", "compression",
         "compression hooks: cast (4.8), pick the top k (4.9) and factorise (4.10) yourself around an all-reduce, "
         "not with torch's DDP communication hooks",
         names=frozenset({"ddp_comm_hooks", "default_hooks", "powerSGD_hook", "batched_powerSGD_hook",
                          "quantization_hooks", "DDPCommHookType", "_compress_hook", "fp16_compress_wrapper",
                          "bf16_compress_wrapper"}),
         paths=("torch.distributed.algorithms",),
         files=("distributed/algorithms/ddp_comm_hooks/",)),
    Rule("5.5 differentiable all-to-all", "phase5_large_models", "moe_primitives",
         "the differentiable all-to-all: write its autograd Function around dist.all_to_all_single, "
         "not with torch.distributed.nn's",
         names=frozenset({"_AlltoAllSingle", "_AlltoAll", "all_to_all_single_autograd", "all_to_all_autograd"}),
         paths=("torch.distributed.nn",), files=("distributed/nn/", _FUNCOL)),
)
BY_TEMPLATE = {(r.phase, r.template): r for r in RULES}


def static_names(phase: str, name: str) -> tuple[frozenset, tuple]:
    """(names, dotted prefixes) the template ``phase/template_<name>.py`` may not name; BACKDOORS in all."""
    rule = BY_TEMPLATE.get((phase, name))
    return (BACKDOORS | (rule.names if rule else frozenset())), (rule.paths if rule else ())


def rule_for(phase: str, name: str) -> Rule | None:
    return BY_TEMPLATE.get((phase, name))


# --------------------------------------------------------------------------- at run time
_TORCH = os.path.dirname(torch.__file__) + os.sep
_LIBRARIES = tuple({sysconfig.get_paths()[k] + os.sep for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_HERE = Path(__file__).resolve().parent
# The bench's interception wrappers (distlab.intercept and its observers: the ledger, the doctor, the trace)
# sit between a caller and torch: looked through like torch, so a template's collective is still the
# template's under a CommLedger. distlab.intercept says which files they are.
_WRAPPERS = intercept.wrapper_files() + (str(_HERE) + os.sep,)
_kinds: dict = {}  # code object -> (looked through?, template name or None, torch file or None)


def _kind(code) -> tuple[bool, str | None, str | None]:
    kind = _kinds.get(code)
    if kind is None:
        filename = code.co_filename
        base = os.path.basename(filename)
        template = base[len("template_"):-3] if base.startswith("template_") and base.endswith(".py") else None
        through = template is None and (filename.startswith("<") or filename.startswith(_LIBRARIES + _WRAPPERS)
                                        or filename.startswith(_TORCH))
        torch_file = filename[len(_TORCH):].replace(os.sep, "/") if filename.startswith(_TORCH) else None
        kind = _kinds[code] = (through, template, torch_file)
    return kind


_modules_cache: dict[str, tuple[int, list]] = {}


def _template_modules(template: str) -> list:
    """The loaded modules of ``template_<template>.py`` (its own and a student copy's), cached per sys.modules size."""
    size, found = _modules_cache.get(template, (-1, []))
    if size != len(sys.modules):
        found = [m for n, m in list(sys.modules.items()) if n.endswith(f"template_{template}")]
        _modules_cache[template] = (len(sys.modules), found)
    return found


def _torch_file_of(value) -> str | None:
    """The file under torch/ that defines ``value`` (a function, a partial of one, or a class), or None."""
    target = value.func if isinstance(value, functools.partial) else value
    code = getattr(target, "__code__", None)
    if code is not None:
        return _kind(code)[2]
    if isinstance(target, type):
        path = getattr(sys.modules.get(target.__module__), "__file__", "") or ""
        return path[len(_TORCH):].replace(os.sep, "/") if path.startswith(_TORCH) else None
    return None


def _exposes(rule: Rule, torch_files: set[str]) -> str | None:
    """Name of an object the rule's template module hands out that is torch's refused code itself (an alias:
    ``fp16_compress_hook = default_hooks.fp16_compress_hook``), or None."""
    for module in _template_modules(rule.template):
        for attr, value in list(vars(module).items()):
            if _torch_file_of(value) in torch_files:
                return attr
    return None


def check_call(what: str, method: str | None = None, into: str | None = None, instance=None) -> None:
    """Refuse ``what`` (a ProcessGroup method ``method``, or a method of a torch class defined in the file
    ``into`` under torch/) with its rule's line when the course code that called it is the template that
    teaches it, or when that template hands out torch's refused code (or subclasses it) as its own."""
    frame = sys._getframe(2)  # 0: here, 1: the guard (a handler or a guarded method), 2: its caller
    seen_files: list[str] = [into] if into else []
    while frame is not None:
        through, template, torch_file = _kind(frame.f_code)
        if not through:
            break
        if torch_file is not None:
            seen_files.append(torch_file)
        frame = frame.f_back
    caller = _kind(frame.f_code)[1] if frame is not None else None
    where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else ""
    for rule in RULES:
        taught_here = [f for f in seen_files if f.startswith(rule.files)] if rule.files else []
        by_name = method is not None and method in rule.methods
        if caller == rule.template and (by_name or taught_here):
            raise PermissionError(rule.line(what if by_name else f"torch's {taught_here[-1]}", where))
        if taught_here:
            if instance is not None and type(instance).__module__.endswith(f"template_{rule.template}"):
                raise PermissionError(rule.line(f"a subclass of torch's {type(instance).__qualname__}"
                                                f" ({type(instance).__module__})"))
            if (alias := _exposes(rule, set(taught_here))) is not None:
                raise PermissionError(rule.line(f"torch's {taught_here[-1]}, handed out as the template's "
                                                f"`{alias}`"))


_PG_METHODS = sorted(set().union(*(r.methods for r in RULES)))
_installed: list = []  # while installed: the ProcessGroup handlers' intercept.Handle


def _refuse(name: str):
    """The ProcessGroup handler of method ``name`` (distlab.intercept): check, then the next step inward."""
    def handler(proceed, self, *args, **kwargs):
        check_call(f"ProcessGroup.{name}", name, None, self)
        return proceed(self, *args, **kwargs)

    return handler


def _guard_method(cls: type, name: str, label: str) -> None:
    original = getattr(cls, name)
    into = _torch_file_of(cls)
    if getattr(original, "_refused_by_rules", False):
        return

    @functools.wraps(original)
    def guarded(self, *args, **kwargs):
        check_call(f"{label}.{name}", name, into, self)
        return original(self, *args, **kwargs)

    guarded._refused_by_rules = True
    guarded._raw = cls.__dict__.get(name)  # pybind's instancemethod (binds self), or None where inherited
    setattr(cls, name, guarded)


def _guard_function(module, name: str, method: str) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, "_refused_by_rules", False):
        return

    @functools.wraps(original)
    def guarded(*args, **kwargs):
        check_call(f"{module.__name__}.{name}", method, _FUNCOL)
        return original(*args, **kwargs)

    guarded._refused_by_rules = True
    guarded._raw = original
    setattr(module, name, guarded)


def install_builtin_rules() -> None:
    """In this process (a graded rank, or the process that runs a graded single-process test): every
    ProcessGroup method a rule names, and torch's DistributedSampler, refuse the templates that teach them."""
    if _installed:
        return
    from torch.utils.data.distributed import DistributedSampler

    _installed.append(intercept.handle("rules", {name: _refuse(name) for name in _PG_METHODS}))
    for name in ("__init__", "__iter__", "__len__", "set_epoch"):
        _guard_method(DistributedSampler, name, "DistributedSampler")
    # Functional collectives reach the process group from C++: refused at their Python entry points (a call
    # through torch.ops._c10d_functional directly is not seen here; the static rules refuse its names).
    import torch.distributed._functional_collectives as funcol

    for name, method in _FUNCOL_METHODS.items():
        _guard_function(funcol, name, method)


def uninstall_builtin_rules() -> None:
    """Put torch's own methods back (tests of this module)."""
    from torch.utils.data.distributed import DistributedSampler

    import torch.distributed._functional_collectives as funcol

    while _installed:
        _installed.pop().cancel()
    for cls in (DistributedSampler, funcol):
        for name, value in list(vars(cls).items()):
            if getattr(value, "_refused_by_rules", False):
                if value._raw is None:
                    delattr(cls, name)
                else:
                    setattr(cls, name, value._raw)
