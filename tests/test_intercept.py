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


# --------------------------------------------------------------------------- ProcessGroup methods
def _torchs_own(value) -> bool:
    """A ProcessGroup entry torch made: pybind's (no Python code) or code in torch's own files."""
    code = getattr(value, "__code__", None)
    return code is None or code.co_filename.startswith(_TORCH_DIR)


def _quiet_p2p_checks():
    """Strict mode and the size check (on in every test rank) step aside: nothing handles ProcessGroup."""
    from distlab import p2p_sizes, p2p_strict

    p2p_strict.disable_strict()
    p2p_sizes.disable_size_check()
    assert not any(intercept.pg_roles(name) for name in vars(intercept.PG)), "a handler is still in place"


def _worker_handlers_in_order(rank, world_size):
    _quiet_p2p_checks()
    before = dict(vars(intercept.PG))
    assert all(_torchs_own(v) for v in before.values()), "ProcessGroup is patched before anything handles it"
    seen, t = [], torch.ones(3)

    def recorder(role):
        def handler(proceed, pg, *args, **kwargs):
            seen.append((role, "before"))
            result = proceed(pg, *args, **kwargs)
            seen.append((role, "after"))
            return result
        return handler

    # Handed in inside out on purpose: PG_ORDER, not the order of arrival, decides.
    handles = [intercept.handle(role, {"allreduce": recorder(role)}) for role in reversed(intercept.PG_ORDER)]
    dist.all_reduce(t)  # dist's function -> torch's c10d -> group.allreduce: the class's method
    ordered, seen[:] = list(seen), []

    def refuse(proceed, pg, *args, **kwargs):
        raise PermissionError("refused")

    refusal = intercept.handle("rules", {"allreduce": refuse})
    with pytest.raises(PermissionError, match="refused"):
        dist.group.WORLD.allreduce([t])
    refused, roles = list(seen), intercept.pg_roles("allreduce")
    for h in [refusal, *handles]:
        h.cancel()
    changed = [name for name, value in vars(intercept.PG).items() if before.get(name) is not value]
    return ordered, refused, roles, t, changed


def test_process_group_handlers_run_in_the_declared_order_and_torchs_methods_come_back():
    for rank, (ordered, refused, roles, t, changed) in enumerate(run_distributed(_worker_handlers_in_order, 2)):
        roles_in = list(intercept.PG_ORDER)
        assert ordered == [(r, "before") for r in roles_in] + [(r, "after") for r in reversed(roles_in)], \
            f"rank {rank}: {ordered}"
        # the two refusing "rules" handles come first in PG_ORDER, so the recorders inward never ran
        assert refused == [("rules", "before")] and roles == ("rules", "rules", "p2p_strict", "p2p_sizes"), \
            f"rank {rank}: {refused}, {roles}"
        # one all-reduce of ones over 2 ranks (the refused one moved nothing): exact, no fractional sum
        assert torch.equal(t, torch.full((3,), 2.0)), f"rank {rank}: {t}"
        assert not changed, f"rank {rank}: not torch's own after the last handler left: {changed}"


_CHEAT = "import torch.distributed as dist\n\ndef via_process_group(t):\n    dist.group.WORLD.allreduce([t]).wait()\n"


def _worker_everything_handled(rank, world_size, template):
    import importlib.util

    from distlab import p2p_sizes, p2p_strict
    from distlab.grading.rules import install_builtin_rules, uninstall_builtin_rules

    _quiet_p2p_checks()
    before = dict(vars(intercept.PG))
    install_builtin_rules()
    p2p_sizes.enable_size_check()
    wrappers = {}
    for phase in ("sizes", "strict"):
        wrappers[phase] = {name: getattr(value, "__code__", None) and value.__code__.co_filename
                           for name, value in vars(intercept.PG).items() if value is not before.get(name)}
        p2p_strict.enable_strict()
    roles = intercept.pg_roles("send"), intercept.pg_roles("allreduce")
    # The grader's handler is outermost: a handler of a later role (its frame is this file's, which the
    # grader's walk does not look through) stands inward of it and cannot hide the template that called.
    spec = importlib.util.spec_from_file_location("_cheat.template_collectives", template)
    cheat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cheat)
    inward = intercept.handle("p2p_strict", {"allreduce": lambda proceed, pg, *a, **k: proceed(pg, *a, **k)})
    try:
        with pytest.raises(PermissionError, match="^1.1-1.3 all-reduce three ways teaches"):
            cheat.via_process_group(torch.ones(2))
    finally:
        inward.cancel()
    # any-source receive under the size check: the header says who sent; the payload comes from pg_below
    p2p_strict.disable_strict()
    got = torch.empty(4)
    src = dist.send(torch.arange(4.0), 1) if rank == 0 else dist.recv(got)
    uninstall_builtin_rules()
    p2p_sizes.disable_size_check()
    changed = [name for name, value in vars(intercept.PG).items() if before.get(name) is not value]
    return wrappers, roles, src, got, changed


def test_the_checks_and_the_grader_patch_process_group_through_intercept_only(tmp_path):
    """With the grader's rules, the size check and strict mode on, every ProcessGroup entry that is not
    torch's is intercept's wrapper (a module that patched the class itself would show its own file)."""
    here = str(REPO / "distlab" / "intercept.py")
    template = tmp_path / "phase1_data_parallel" / "template_collectives.py"
    template.parent.mkdir()
    template.write_text(_CHEAT)
    runs = run_distributed(_worker_everything_handled, 2, str(template))
    for rank, (wrappers, roles, src, got, changed) in enumerate(runs):
        for phase, entries in wrappers.items():
            assert {"send", "recv", "allreduce"} <= entries.keys(), f"rank {rank}, {phase}: {sorted(entries)}"
            assert set(entries.values()) == {here}, f"rank {rank}, {phase}: {entries}"
        assert roles == (("p2p_strict",), ("rules",)), f"rank {rank}: {roles}"
        if rank == 1:  # torch's recv returns the sender; the values are what rank 0 sent (copies: exact)
            assert src == 0 and torch.equal(got, torch.arange(4.0)), f"rank {rank}: {src}, {got}"
        assert not changed, f"rank {rank}: not torch's own after uninstalling: {changed}"


# --------------------------------------------------------------------------- nobody else patches
_SCANNED = ("distlab", "solutions", "demos", "benchmarks")
# torchrun's agent (python -m distlab.launch) binds its rendezvous store to an address and watches the
# rendezvous: it replaces torch.distributed's TCPStore class and a rendezvous method in the agent process,
# where no communication op runs and nothing observes. Not an entry point of communication.
_ALLOWED = {("distlab/launch_agent.py", "torch.distributed.TCPStore"),
            ("distlab/launch_agent.py", "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend.TCPStore"),
            ("distlab/launch_agent.py",
             "torch.distributed.elastic.rendezvous.dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous"),
            # The grader refuses torch's functional collectives at their Python entry points: they reach the
            # process group from C++, past ProcessGroup's methods (intercept's second layer cannot see them),
            # and nothing else observes them.
            ("distlab/grading/rules.py", "torch.distributed._functional_collectives.? (through _guard_function)")}


def _dotted(node, aliases: dict) -> str | None:
    """``a.b.c`` with its first name resolved through the file's imports, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


# What only intercept.py may assign to: torch.distributed and the C++ module its ProcessGroup class lives in.
_GUARDED = ("torch.distributed", "torch._C._distributed_c10d")


def _guarded(name: str | None) -> bool:
    return bool(name) and any(name == g or name.startswith(g + ".") for g in _GUARDED)


def _aliases(nodes: list, known: dict | None = None) -> dict[str, str]:
    """A file's names for guarded objects: its imports, and ``c10d = dist.distributed_c10d`` or
    ``_PG = torch._C._distributed_c10d.ProcessGroup``; ``known``: other modules' such names
    (``{"distlab.p2p_sizes._PG": "torch._C._distributed_c10d.ProcessGroup"}``)."""
    aliases: dict[str, str] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                aliases[a.asname or a.name] = (known or {}).get(full, full)
    for node in nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _dotted(node.value, aliases)
            if _guarded(value):
                aliases[node.targets[0].id] = value
    return aliases


def torch_distributed_assignments(source: str, known: dict | None = None, tree=None) -> list[tuple[int, str]]:
    """Where ``source`` assigns to an attribute of torch.distributed or anything under it, ProcessGroup
    included (``dist.x = ...``, ``setattr(c10d, "x", ...)``, ``setattr(ProcessGroup, "send", ...)``, through
    import aliases, ``c10d = dist.distributed_c10d`` and a helper whose parameter it setattr's on).
    ``tree``: ``source`` parsed already."""
    nodes = list(ast.walk(tree or ast.parse(source)))  # walked once: the scan reads ~100 files
    aliases = _aliases(nodes, known)
    helpers: dict[str, set[int]] = {}  # def patch(cls, ...): setattr(cls, ...): function -> such parameters
    for node in nodes if "setattr" in source else ():  # (most files have none: their functions not walked)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [a.arg for a in node.args.posonlyargs + node.args.args]
            for sub in ast.walk(node):
                if _is_setattr(sub) and isinstance(sub.args[0], ast.Name) and sub.args[0].id in params:
                    helpers.setdefault(node.name, set()).add(params.index(sub.args[0].id))
    found = []
    for node in nodes:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            name = _dotted(target, aliases) if isinstance(target, ast.Attribute) else None
            if _guarded(name) and name not in _GUARDED:
                found.append((node.lineno, name))
        if _is_setattr(node):
            owner = _dotted(node.args[0], aliases)
            if _guarded(owner):
                what = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else "?"
                found.append((node.lineno, f"{owner}.{what}"))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
            for i in helpers[node.func.id]:
                owner = _dotted(node.args[i], aliases) if i < len(node.args) else None
                if _guarded(owner):
                    found.append((node.lineno, f"{owner}.? (through {node.func.id})"))
    return found


def _is_setattr(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args


def test_the_scan_sees_assignments_to_torch_distributed():
    """The scanner's own baseline: each spelling of a patch is found, a local attribute is not."""
    source = ("import torch.distributed as dist\nimport torch\nfrom torch.distributed import distributed_c10d as c\n"
              "c10d = dist.distributed_c10d\nclass A: pass\na = A()\n"
              "dist.all_reduce = None\nc.send = None\nc10d.recv = None\ntorch.distributed.barrier = None\n"
              "setattr(dist, 'isend', None)\nsetattr(c10d, 'irecv', None)\na.all_reduce = None\n")
    assert [line for line, _ in torch_distributed_assignments(source)] == [7, 8, 9, 10, 11, 12]


def test_the_scan_sees_assignments_to_process_group_methods():
    """Each way the p2p checks and the grader patched ProcessGroup before intercept's second layer is found
    (an alias, a class imported in a function, a helper's parameter, an alias imported from another module);
    a method of another class, and a helper given another class, are not."""
    source = ("import torch\nimport torch.distributed as dist\nfrom distlab.p2p_sizes import _PG as theirs\n"
              "_PG = torch._C._distributed_c10d.ProcessGroup\nclass A: pass\n"
              "def guard(cls, name):\n    setattr(cls, name, None)\n"
              "def install():\n    from torch._C._distributed_c10d import ProcessGroup\n"
              "    guard(ProcessGroup, 'allreduce')\n    guard(A, 'x')\n"
              "setattr(_PG, 'send', None)\ndist.ProcessGroup.recv = None\nsetattr(theirs, 'recv', None)\n"
              "A.send = None\ntorch._C._distributed_c10d.ProcessGroup.barrier = None\n")
    known = {"distlab.p2p_sizes._PG": "torch._C._distributed_c10d.ProcessGroup"}
    assert sorted(line for line, _ in torch_distributed_assignments(source, known)) == [10, 12, 13, 14, 16]


def test_no_module_but_intercept_assigns_to_torch_distributed():
    """Nor to ProcessGroup's methods: the p2p checks and the grader hand intercept.handle their handlers."""
    sources = {}
    for folder in _SCANNED:
        for path in sorted((REPO / folder).rglob("*.py")):
            source = path.read_text()
            if "distributed" in source or "ProcessGroup" in source:  # the others name nothing guarded: not parsed
                sources[path.relative_to(REPO).as_posix()] = source, ast.parse(source)
    known = {}  # module-level names for guarded objects, as another module imports them
    for rel, (_, tree) in sources.items():
        module = rel[:-3].replace("/", ".").removesuffix(".__init__")
        known.update({f"{module}.{name}": value for name, value in _aliases(tree.body).items() if _guarded(value)})
    found = []
    for rel, (source, tree) in sources.items():
        if rel != "distlab/intercept.py":
            found += [f"{rel}:{line}: {name}" for line, name in torch_distributed_assignments(source, known, tree)
                      if (rel, name) not in _ALLOWED]
    assert not found, ("these patch torch.distributed themselves; observe it through distlab.intercept "
                       "(intercept.subscribe; ProcessGroup methods: intercept.handle) instead:\n" + "\n".join(found))
