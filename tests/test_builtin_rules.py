"""Per exercise, torch's own implementation of what it teaches is refused (distlab/grading/rules.py).

The static half (isolation.lint) refuses the names through imports and aliases; the runtime half refuses
the calls where the built-in runs (ProcessGroup methods, torch's DistributedSampler) when the template of
the exercise that teaches it made them, and lets the tests' baselines and the bench's own uses through.
Each case here scored full before (issue 31).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distlab.spawn import run_distributed

CHEATS = {
    ("phase1_data_parallel", "collectives"): '''
import torch.distributed as dist

def via_c10d(t):
    dist.distributed_c10d.all_reduce(t)  # the ledger wraps dist.<op> only

def via_process_group(t):
    dist.group.WORLD.allreduce([t]).wait()

def honest_all_gather(t):
    out = [t.clone() for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return sum(out)
''',
    ("phase3_multi_node", "ring_allreduce"): '''
import torch.distributed as dist

def via_process_group(t):
    dist.group.WORLD.allreduce([t]).wait()

def via_functional_collectives(t):
    import torch.distributed._functional_collectives as fc
    return fc.all_reduce(t, "sum", dist.group.WORLD).wait()
''',
    ("phase4_production", "compression"): '''
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

def calls_torchs_hook(group, bucket):
    return default_hooks.fp16_compress_hook(group, bucket)

fp16_compress_hook = default_hooks.fp16_compress_hook  # handed out as its own
''',
    ("phase5_large_models", "moe_primitives"): '''
import torch.distributed as dist
import torch.distributed.nn.functional as F

def via_torchs_autograd(output, input):
    return F.all_to_all_single(output, input)

def honest(output, input):
    dist.all_to_all_single(output, input)
    return output
''',
    ("phase1_data_parallel", "data_loader"): '''
import torch.utils.data as data

class DistributedSampler(data.DistributedSampler):  # torch's, under the exercise's name
    pass

def wraps(dataset, **kw):
    return list(data.DistributedSampler(dataset, **kw))
''',
}


def _load(root: str, phase: str, name: str):
    key = f"_student.{phase}.template_{name}"
    spec = importlib.util.spec_from_file_location(key, Path(root) / phase / f"template_{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)  # not through load(): the static rules would refuse them first
    return module


class _Bucket:  # what the fp16 hook reads of a GradBucket
    def __init__(self, t):
        self.t = t

    def buffer(self):
        return self.t


def _refused(fn, *args, **kwargs) -> str:
    with pytest.raises(PermissionError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def _worker_rules(rank, world_size, root):
    from distlab.comm import CommLedger
    from distlab.grading.rules import install_builtin_rules

    install_builtin_rules()
    t = torch.ones(4)
    collectives = _load(root, "phase1_data_parallel", "collectives")
    line = _refused(collectives.via_c10d, t)
    assert line.startswith("1.1-1.3 all-reduce three ways teaches all-reduce") and "\n" not in line, line
    assert "ProcessGroup.allreduce, called from template_collectives.py:" in line, line
    with CommLedger():  # the bench's interception between the template and torch is looked through
        assert "ProcessGroup.allreduce" in _refused(collectives.via_process_group, t)
    dist.all_reduce(t)  # the test's own baseline
    assert torch.equal(collectives.honest_all_gather(torch.ones(2)), torch.full((2,), 2.0))  # taught: allowed
    ring = _load(root, "phase3_multi_node", "ring_allreduce")
    assert _refused(ring.via_process_group, t).startswith("3.1-3.4 ring")
    assert "_functional_collectives.all_reduce, called from" in _refused(ring.via_functional_collectives, t)
    import torch.distributed._functional_collectives as fc
    assert torch.equal(fc.all_reduce(torch.ones(2), "sum", dist.group.WORLD).wait(), torch.full((2,), 2.0))  # the test's
    comp = _load(root, "phase4_production", "compression")
    assert "torch's distributed/algorithms/ddp_comm_hooks/default_hooks.py" in \
        _refused(comp.calls_torchs_hook, None, _Bucket(torch.ones(3)))
    assert "handed out as the template's `fp16_compress_hook`" in \
        _refused(comp.fp16_compress_hook, None, _Bucket(torch.ones(3)))  # called from the test
    moe = _load(root, "phase5_large_models", "moe_primitives")
    assert _refused(moe.via_torchs_autograd, torch.empty(2), torch.ones(2)).startswith("5.5 differentiable")
    assert torch.equal(moe.honest(torch.empty(2), torch.ones(2)), torch.ones(2))
    loader = _load(root, "phase1_data_parallel", "data_loader")
    assert "a subclass of torch's DistributedSampler" in _refused(loader.DistributedSampler, list(range(4)), 2, 0)
    assert "called from template_data_loader.py" in _refused(loader.wraps, list(range(4)), num_replicas=2, rank=0)
    from torch.utils.data import DistributedSampler
    assert list(DistributedSampler(list(range(4)), num_replicas=2, rank=rank, shuffle=False)) == [rank, rank + 2]


def test_torchs_own_implementation_is_refused_to_the_exercise_that_teaches_it(tmp_path):
    for (phase, name), source in CHEATS.items():
        (tmp_path / phase).mkdir(exist_ok=True)
        (tmp_path / phase / f"template_{name}.py").write_text(source)
    run_distributed(_worker_rules, 2, str(tmp_path))


@pytest.mark.parametrize("phase,name", sorted(CHEATS))
def test_the_static_rules_name_the_exercise(tmp_path, phase, name):
    from distlab.grading import isolation, rules

    (tmp_path / f"template_{name}.py").write_text(CHEATS[(phase, name)])
    problems = isolation.lint(tmp_path / f"template_{name}.py", phase, name)
    exercise = rules.rule_for(phase, name).exercise
    assert any(f"{exercise} teaches" in p for p in problems), problems


@pytest.mark.parametrize("source,why", [
    ("from torch.serialization import os\n", "`from torch.serialization import os`"),
    ("from typing import sys\n", "`from typing import sys`"),
    ("g = getattr\n", "`getattr` other than called with a constant name"),
    ("import functools\nf = functools.reduce(getattr, ['a'], object)\n", "`getattr` other than called"),
    ("import operator\nf = operator.attrgetter('a')\n", "`.attrgetter`"),
    ("import torch\nf = torch.ops.c10d.allreduce_\n", "(refused: `c10d`"),
])
def test_the_static_rules_see_through_aliases(tmp_path, source, why):
    from distlab.grading import isolation

    (tmp_path / "t.py").write_text(source)
    problems = isolation.lint(tmp_path / "t.py", "phase1_data_parallel", "collectives")
    assert any(why in p for p in problems), problems


def test_a_c10d_layer_is_refused_to_every_template():
    from distlab.grading import isolation

    problems = isolation.lint(Path(__file__).parent / "cheats" / "torch_c10d_all_reduce" / "template_collectives.py",
                              "phase1_data_parallel", "trainer")  # no rule of its own: the generic line
    assert any("the layer under torch.distributed's functions is not for templates (refused: `distributed_c10d`)" in p
               for p in problems), problems
