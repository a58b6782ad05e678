"""distlab/intercept.py: the one interception point the ledger, the doctor, the trace and the p2p checks observe.

Checked against torch itself: the functions it puts back are torch's own objects (compared with what
torch held before, and with torch's source files), the collectives' results are torch's arithmetic, and
the order observers see is the one ORDER declares, not the one they subscribed in.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab import intercept
from distlab.comm import CommLedger
from distlab.spawn import run_distributed

REPO = Path(__file__).resolve().parent.parent
c10d = dist.distributed_c10d
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _entry_points() -> dict:
    """What torch.distributed and distributed_c10d hold now for each intercepted name (and dist.P2POp)."""
    held = {(m.__name__, op): getattr(m, op) for m in (dist, c10d) for op in intercept.OPS if hasattr(m, op)}
    held[("torch.distributed", "P2POp")] = dist.P2POp
    return held


@pytest.fixture
def nothing_observes():
    """This process with no observer: the strict checker and the size check (on in pytest's process when
    distlab.p2p was imported) step aside for the test and come back after it."""
    from distlab import p2p_sizes, p2p_strict

    strict, sized = p2p_strict.strict_enabled(), p2p_sizes.size_check_enabled()
    p2p_strict.disable_strict()
    p2p_sizes.disable_size_check()
    assert not intercept.installed(), "an observer outside the p2p checks is still subscribed in this process"
    yield
    if sized:
        p2p_sizes.enable_size_check()
    if strict:
        p2p_strict.enable_strict()


def test_install_and_uninstall_put_torchs_own_functions_back(nothing_observes):
    torchs = _entry_points()
    for (module, op), fn in torchs.items():  # the baseline is torch's: its own files, not a wrapper
        assert getattr(fn, "__code__", None) is None or fn.__code__.co_filename.startswith(_TORCH_DIR), (module, op)
    intercept.install()
    intercept.install()  # nested: counted, not refused
    try:
        for op in intercept.OPS:
            if hasattr(dist, op):
                assert getattr(dist, op) is getattr(c10d, op), f"dist.{op} and distributed_c10d.{op} differ"
                assert getattr(dist, op) is not torchs[("torch.distributed", op)], f"dist.{op} is not intercepted"
        intercept.uninstall()
        assert dist.all_reduce is not torchs[("torch.distributed", "all_reduce")], "one of two installs undid both"
    finally:
        intercept.uninstall()
    after = _entry_points()
    changed = [key for key, fn in torchs.items() if after[key] is not fn]
    assert not changed, f"not torch's own objects after uninstall: {changed}"
    with pytest.raises(RuntimeError, match="without an install"):
        intercept.uninstall()


def test_a_role_outside_the_declared_order_is_refused(nothing_observes):
    with pytest.raises(ValueError, match="not one of"):
        intercept.subscribe("profiler", lambda call: None)
    assert not intercept.installed()


def _recorder(name: str, seen: list):
    def observe(call):
        seen.append((name, "before", call.op))
        yield
        seen.append((name, "after", call.op))
    return observe


def _worker_observers_in_order(rank, world_size):
    seen, waits = [], []
    t = torch.ones(3)
    ledger = CommLedger()
    # Subscribed inside out on purpose: ORDER, not the order of subscription, decides.
    with intercept.observing("doctor", _recorder("doctor", seen)), \
            intercept.observing("ledger", _recorder("ledger", seen)), ledger:
        dist.all_reduce(t)
        c10d.all_reduce(t)  # the layer under dist: the same wrapper
        if rank == 0:
            dist.send(torch.ones(2), 1)  # torch's send calls its isend: one call seen, not two
        else:
            dist.recv(torch.empty(2), 0)
        with intercept.observing("ledger", lambda call: call.on_wait(lambda i, s, e: waits.append((call.op, i)))):
            dist.all_reduce(t, async_op=True).wait()
    return seen, waits, t, ledger.calls("all_reduce"), ledger.calls()


def test_observers_see_each_call_once_in_the_declared_order():
    p2p = ["send", "recv"]
    for rank, (seen, waits, t, all_reduces, calls) in enumerate(run_distributed(_worker_observers_in_order, 2)):
        ops = ["all_reduce", "all_reduce", p2p[rank], "all_reduce"]
        outer, inner = sorted(("doctor", "ledger"), key=intercept.ORDER.index)
        expected = [entry for op in ops for entry in
                    ((outer, "before", op), (inner, "before", op), (inner, "after", op), (outer, "after", op))]
        assert seen == expected, f"rank {rank}: {seen}"
        assert waits == [("all_reduce", 0)], f"rank {rank}: {waits}"
        # three all-reduces of ones over 2 ranks: 2 ** 3, exact in float (no reordered sum of non-integers)
        assert torch.equal(t, torch.full((3,), 8.0)), f"rank {rank}: {t}"
        assert (all_reduces, calls) == (3, 4), \
            f"rank {rank}: the ledger counted {all_reduces} all-reduces, {calls} calls"


def _worker_observer_calls_a_collective(rank, world_size):
    seen = []

    def observe(call):
        seen.append(call.op)
        if call.op == "all_reduce":
            other = torch.ones(1)
            dist.all_reduce(other)  # the observer's own collective runs, and is not observed again
            seen.append(("inner result", other.item()))

    t = torch.ones(2)
    with intercept.observing("ledger", observe):
        dist.all_reduce(t)
    return seen, t


def test_a_call_from_inside_an_observer_does_not_recurse():
    for rank, (seen, t) in enumerate(run_distributed(_worker_observer_calls_a_collective, 2)):
        assert seen == ["all_reduce", ("inner result", 2.0)], f"rank {rank}: {seen}"
        assert torch.equal(t, torch.full((2,), 2.0)), f"rank {rank}: {t}"


# --------------------------------------------------------------------------- nobody else patches
_SCANNED = ("distlab", "solutions", "demos", "benchmarks")
# torchrun's agent (python -m distlab.launch) binds its rendezvous store to an address and watches the
# rendezvous: it replaces torch.distributed's TCPStore class and a rendezvous method in the agent process,
# where no communication op runs and nothing observes. Not an entry point of communication.
_ALLOWED = {("distlab/launch_agent.py", "torch.distributed.TCPStore"),
            ("distlab/launch_agent.py", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend.TCPStore"),
            ("distlab/launch_agent.py",
             "torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous")}


def _dotted(node, aliases: dict) -> str | None:
    """``a.b.c`` with its first name resolved through the file's imports, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def torch_distributed_assignments(source: str) -> list[tuple[int, str]]:
    """Where ``source`` assigns to an attribute of torch.distributed or anything under it
    (``dist.x = ...``, ``setattr(c10d, "x", ...)``, through import aliases and ``c10d = dist.distributed_c10d``)."""
    nodes = list(ast.walk(ast.parse(source)))  # walked once: the scan reads ~100 files
    aliases: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in nodes:  # aliases of a torch.distributed object: c10d = dist.distributed_c10d
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _dotted(node.value, aliases)
            if value and value.startswith("torch.distributed"):
                aliases[node.targets[0].id] = value
    found = []
    for node in nodes:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            name = _dotted(target, aliases) if isinstance(target, ast.Attribute) else None
            if name and name.startswith("torch.distributed."):
                found.append((node.lineno, name))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            owner = _dotted(node.args[0], aliases)
            if owner and owner.startswith("torch.distributed"):
                what = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
                found.append((node.lineno, f"{owner}.{what}"))
    return found


def test_the_scan_sees_assignments_to_torch_distributed():
    """The scanner's own baseline: each spelling of a patch is found, a local attribute is not."""
    source = ("import torch.distributed as dist\nimport torch\nfrom torch.distributed import distributed_c10d as c\n"
              "c10d = dist.distributed_c10d\nclass A: pass\na = A()\n"
              "dist.all_reduce = None\nc.send = None\nc10d.recv = None\ntorch.distributed.barrier = None\n"
              "setattr(dist, 'isend', None)\nsetattr(c10d, 'irecv', None)\na.all_reduce = None\n")
    assert [line for line, _ in torch_distributed_assignments(source)] == [7, 8, 9, 10, 11, 12]


def test_no_module_but_intercept_assigns_to_torch_distributed():
    found = []
    for folder in _SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel == "distlab/intercept.py":
                continue
            source = path.read_text()
            if "distributed" not in source:  # names nothing under torch.distributed (most files: saves parsing)
                continue
            found += [f"{rel}:{line}: {name}" for line, name in torch_distributed_assignments(source)
                      if (rel, name) not in _ALLOWED]
    assert not found, ("these patch torch.distributed themselves; observe it through distlab.intercept "
                       "(intercept.subscribe) instead:\n" + "\n".join(found))
