"""Assertions the tests share, with messages an instructor can act on.

"rank 1, step 3, parameter fc1.weight: max abs diff 2.0e-02 (tolerance: ...)" is
the kind of message every comparison here produces.
"""
from __future__ import annotations

import os
import re
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item() if a.numel() else 0.0


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _factor_hint(factor: float, tol: float) -> str:
    """What a constant factor between a result and its baseline usually means."""
    w = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    near = lambda x, y: abs(x - y) <= tol * max(abs(y), 1.0)  # noqa: E731
    if factor < 0:
        return "a sign flipped (subtracted where it should add?)"
    if w > 1 and (near(factor, w) or near(factor, 1 / w)):
        return ("summed where a mean was due (never divided by W?), or counted twice?" if factor > 1
                else "averaged twice, or divided by W where a sum was due?")
    log2 = torch.log2(torch.tensor(factor, dtype=torch.float64)).item()
    if abs(log2) >= 3 and near(log2, round(log2)):  # 8x or more, a power of two: a loss scale's signature
        return ("a power of two: the loss scale never divided out (unscale_ must multiply by 1/S)?" if factor > 1
                else "a power of two: divided by the loss scale twice?")
    return ("averaged twice, or divided by W where a sum was due?" if factor < 1
            else "summed where a mean was due (never divided by W?), or counted twice?")


def diagnose(actual: torch.Tensor, expected: torch.Tensor, subject: str = "it is", noise=None) -> str:
    """A recognisable cause of a mismatch, or "": a constant factor (a missing or doubled
    division by W, a loss scale never divided out), a sign flip, all zeros, a non-finite value.
    ``subject`` names what is compared ("the update ... is"); ``noise``: each element's rounding error, where it
    is larger than the values' own (an update read as a difference of two parameters)."""
    a, e = actual.detach().double().flatten(), expected.detach().double().flatten()
    if not torch.isfinite(a).all():
        return "; it holds inf/nan: an overflow (fp16 without scaling?) or a division by zero"
    # Constant up to both sides' rounding: 1e-3, or two ulps of the coarser dtype (each side rounded
    # once: a bf16 sum against a bf16 mean differs from W by up to 2 * 2^-8 relative).
    tol = max(1e-3, 2 * max(_eps(actual.dtype), _eps(expected.dtype)))
    significant = e.abs() > 1e-6 * max(e.abs().max().item(), 1e-30)
    if noise is not None:  # elements whose rounding could move the ratio by more than tol say nothing
        significant &= e.abs() * tol > noise.detach().double().flatten()
    if significant.sum() == 0:
        return ""
    if a.abs().max().item() == 0:
        return "; it is all zeros: the result was never written back (or gradients were zeroed after the reduce)"
    ratio = a[significant] / e[significant]
    factor = ratio.median().item()
    if abs(factor - 1) > tol and (ratio - factor).abs().max().item() < tol * max(abs(factor), 1.0):
        whole = [c for c in (round(factor), 1 / round(1 / factor) if round(1 / factor) else 0.0) if c]
        factor = next((c for c in whole if abs(factor - c) <= tol * abs(c)), factor)  # 3.01 in bf16 is 3
        return f"; {subject} {factor:.2f}x the expected value everywhere: {_factor_hint(factor, tol)}"
    return ""


# --------------------------------------------------------------------------- tagged ring inputs
# Chunk c of rank q tagged 8**(q*W + c): a ring's sum or copy reads back, octal digit by digit, as which
# rank's which chunk it holds (a chunk counted up to 7 times still reads back).
_TAG_BASE = 8


def ring_tagged(rank: int, numel: int, world_size: int) -> torch.Tensor:
    """A flat float64 input whose chunk c (``tensor_split``'s chunks) holds 8**(rank*W + c) everywhere.

    Exact in float64 for W <= 4 (8**16 = 2**48 < 2**53): sums of tags are integers, no rounding."""
    if world_size > 4:
        raise ValueError(f"ring tags need W <= 4 (8**(W*W) <= 2**53), got W={world_size}")
    out = torch.empty(numel, dtype=torch.float64)
    for c, part in enumerate(out.tensor_split(world_size)):
        part.fill_(float(_TAG_BASE ** (rank * world_size + c)))
    return out


def _read_tag(value: float, world_size: int) -> dict[tuple[int, int], int] | None:
    """{(rank, chunk): count} a tagged value is the sum of, or None when it is no sum of tags."""
    if not (0 <= value < _TAG_BASE ** (world_size * world_size) and value == int(value)):
        return None
    counts, v = {}, int(value)
    for k in range(world_size * world_size):
        if v % _TAG_BASE:
            counts[divmod(k, world_size)] = v % _TAG_BASE
        v //= _TAG_BASE
    return counts


def _tags_text(counts: dict[tuple[int, int], int] | None) -> str:
    if not counts:
        return "no sum of the ranks' chunks (garbage: never written?)" if counts is None else "zeros (nothing arrived?)"
    return " + ".join(f"{'' if n == 1 else f'{n} x '}rank {q}'s chunk {c}" for (q, c), n in sorted(counts.items()))


def explain_tags(world_size: int, chunks: list[tuple[int, int]]):
    """The diagnosis for a ring's result on :func:`ring_tagged` inputs: ``chunks`` lays the result out as
    (chunk index, size) pieces; the first wrong piece says what it holds and what was due, and why.
    Pass the result to ``assert_tensors_close(..., explain=...)``."""
    def explain(actual: torch.Tensor, expected: torch.Tensor) -> str:
        sizes = [n for _, n in chunks]
        if actual.numel() != sum(sizes):
            return ""
        for (chunk, _), a, e in zip(chunks, actual.reshape(-1).split(sizes), expected.reshape(-1).split(sizes)):
            if not len(bad := (a.double() != e.double()).nonzero()):
                continue
            got, due = _read_tag(a[bad[0]].item(), world_size), _read_tag(e[bad[0]].item(), world_size) or {}
            if not got:
                hint = "a chunk never received or written into place, or sent before it arrived (off-by-one chunk index?)"
            elif {c for _, c in got} != {c for _, c in due}:
                hint = ("the wrong chunk: is the chunk index off by one, or are the ring's neighbours swapped "
                        "(send to rank+1, receive from rank-1)?")
            elif missing := sorted({q for q, _ in due} - {q for q, _ in got}):
                hint = f"rank(s) {missing}'s part is missing: a step too few, or added into another chunk (off-by-one index?)"
            else:
                hint = "a part counted more than once: a received chunk added twice, or a ring step too many?"
            return f"; chunk {chunk} holds {_tags_text(got)}; expected {_tags_text(due)}: {hint}"
        return ""
    return explain


_GLOO_SIZE = re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)")


def explain_sum(inputs: list[torch.Tensor], weight: float = 1.0):
    """The diagnosis for a reduction of ``inputs`` (rank order; ``weight``: 1/W for a mean) that went wrong:
    which ranks' inputs the result holds, read back by least squares ("rank 0's input alone")."""
    def explain(actual: torch.Tensor, expected: torch.Tensor) -> str:
        x = torch.stack([t.detach().double().reshape(-1) for t in inputs], 1) * weight
        a = actual.detach().double().reshape(-1, 1)
        if x.shape[0] <= x.shape[1] or not torch.isfinite(a).all():
            return ""  # fewer elements than ranks: no unique reading
        c = torch.linalg.lstsq(x, a).solution.flatten()
        whole = c.round()  # whole inputs up to the dtype's rounding; every rank alike is diagnose()'s factor
        if (c - whole).abs().max() > 1e-3 or (x @ whole - a.flatten()).abs().max() > 1e-3 * a.abs().max() \
                or len(set(whole.tolist())) == 1 and whole[0] != 0:
            return ""
        n = whole.tolist()
        held = " + ".join(f"{'' if k == 1 else f'{k:g} x '}rank {r}'s input" for r, k in enumerate(n) if k)
        hint = ("one input, not the total, reached this rank (sent out an input where the reduced total was due?)"
                if n.count(0) == len(n) - 1 and max(n) == 1 else "an input counted more than once, or negated?"
                if max(n) > 1 or min(n) < 0 else f"rank(s) {[r for r, k in enumerate(n) if not k]}'s input is missing")
        return f"; it holds {held or 'none of the inputs'}: {hint}"
    return explain


def translate_size_mismatch(text: str, rank: int | None = None, step: int | str | None = None) -> str | None:
    """gloo's size-mismatch abort in one actionable line, or None when ``text`` holds none.

    gloo aborts the receiving rank with "op.preamble.length <= op.nbytes. 16 vs 12": 16 bytes
    arrived for a 12-byte receive buffer. In a ring that means the two neighbours picked
    different chunks (an off-by-one chunk index) or one of them ignored the uneven last chunk.
    """
    m = _GLOO_SIZE.search(text)
    if not m:
        return None
    sent, room = int(m[1]), int(m[2])
    who = f"rank {rank}" if rank is not None else "a rank"
    at = f" at step {step}" if step is not None else " at that step"
    return (f"{who} received {sent} bytes, expected {room}: sender and receiver disagree on the message size; "
            f"check the chunk index{at} (off by one?) and the uneven last chunk")


# --------------------------------------------------------------------------- checks as records
# In an instructor's grading run (distlab/grading/verdict.py) the comparisons below are also recorded: the
# rank (or the test's own process) sends its records back with its result, and the verdict is the
# pytest process's, which never ran learner code: it compares each recorded actual value with the
# expected value of the same check in a run of the same test on the reference.
RECORD_ENV = "DISTLAB_RECORD_CHECKS"
_records: list[dict] | None = None


def start_recording() -> None:
    """Record every check made from now on in this process (a graded test's child, or its ranks)."""
    global _records
    _records = []
    os.environ[RECORD_ENV] = "1"  # ranks started from here record theirs too (distlab/spawn.py)


def recording() -> bool:
    return _records is not None


def take_records() -> list[dict]:
    """The checks recorded so far, in order, and a fresh list for the next ones."""
    global _records
    out, _records = (_records or []), ([] if _records is not None else None)
    return out


def add_records(records: list[dict], rank: int) -> None:
    """A rank's records (run_distributed), after this process's own, tagged with the rank."""
    if _records is not None:
        _records.extend({**r, "rank": rank if r["rank"] is None else r["rank"]} for r in records)


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}" if frame is not None else "?"


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _record(what: str, actual: torch.Tensor, expected: torch.Tensor, rtol, atol, baseline: bool) -> None:
    if _records is not None:
        _records.append({"site": _site(), "what": what, "rank": None, "actual": _kept(actual),
                         "expected": _kept(expected), "rtol": rtol, "atol": atol, "baseline": baseline})


def _plain(value):
    """``value`` as data the grader's process reads back (torch.load(weights_only=True)): numbers, strings,
    None, tensors, and tuples, lists, dicts and sets of them. A numpy or 0-d value becomes its Python number
    (a learner's sampler may yield numpy ints: they equal the ints torch's gives), a dtype stays, a device or
    a class becomes its name, anything else its repr."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, torch.Tensor):
        return _kept(value)
    if isinstance(value, tuple):  # a named tuple equals the plain one
        return tuple(_plain(v) for v in value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return {_plain(v) for v in value}
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "ndim", None) == 0:
        return value.item()  # numpy scalars
    if isinstance(value, torch.device):
        return f"device {value}"
    if isinstance(value, type):
        return f"class {value.__module__}.{value.__qualname__}"
    return repr(value)


def _record_value(kind: str, what: str, actual, expected, baseline: bool) -> None:
    if _records is not None:
        _records.append({"site": _site(), "what": what, "rank": None, "kind": kind, "actual": _plain(actual),
                         "expected": _plain(expected), "baseline": baseline})


def assert_equal(actual, expected, what: str, *, baseline: bool = True) -> None:
    """``actual == expected`` for counts, byte totals, shapes and other plain values (ints, floats, bools,
    strings, tuples and lists of them), with ``what`` as the message; recorded like the tensor checks, so
    a grading run compares the count in pytest's process (distlab/grading/verdict.py)."""
    _record_value("equal", what, actual, expected, baseline)
    if actual != expected:
        raise AssertionError(what)


def assert_at_most(actual, bound, what: str, *, baseline: bool = True) -> None:
    """``actual <= bound`` (a budget: bytes, ops, host syncs), recorded like :func:`assert_equal`."""
    _record_value("at_most", what, actual, bound, baseline)
    if not actual <= bound:
        raise AssertionError(what)


def assert_tensors_close(actual: torch.Tensor, expected: torch.Tensor, what: str,
                         rtol: float | None = None, atol: float | None = None, *, baseline: bool = True,
                         explain=None) -> None:
    """``torch.testing.assert_close`` with ``what`` (rank, step, name) leading the message.

    rtol=atol=0 demands bitwise equality (use where no sum is reordered). ``baseline=False`` where
    ``expected`` is the learner's own result too (a resumed model against the one it was saved from):
    a grading run then checks the pair as it was recorded instead of against the reference's baseline.
    ``explain(actual, expected) -> str``: the test's own diagnosis (:func:`explain_tags`), tried before
    the ratio's (:func:`diagnose`).
    """
    _record(what, actual, expected, rtol, atol, baseline)
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}")
    try:
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)
    except AssertionError:
        why = (explain(actual, expected) if explain else "") or diagnose(actual, expected)
        raise AssertionError(f"{what}: max abs diff {max_abs_diff(actual, expected):.3e} "
                             f"(rtol={rtol}, atol={atol}){why}") from None


def assert_models_close(actual: nn.Module, expected: nn.Module, *, rank: int, step: int | str,
                        rtol: float | None = None, atol: float | None = None,
                        buffers: bool = True, baseline: bool = True, start=None) -> None:
    """Every parameter (and floating buffer) of ``actual`` is close to ``expected``'s, by name.

    ``start``: the parameters before this step (a list in ``parameters()`` order, or name -> tensor), where
    both models started equal: a mismatch is then diagnosed on the update (a loss scale never divided out
    makes the update S times too large, not the parameter)."""
    exp_params = dict(expected.named_parameters())
    if start is not None and not isinstance(start, dict):
        start = {name: s for (name, _), s in zip(actual.named_parameters(), start)}
    for name, p in actual.named_parameters():
        s0 = None if start is None else start.get(name)
        explain = None if s0 is None else (lambda a, e, s0=s0: diagnose(  # noise: the parameters' rounding
            a - s0, e - s0, "the update (the parameter minus its value before the step) is",
            noise=2 * _eps(e.dtype) * (s0.abs() + a.abs() + e.abs())))
        assert_tensors_close(p, exp_params[name], f"rank {rank}, step {step}, parameter {name}", rtol, atol,
                             baseline=baseline, explain=explain)
    if buffers:
        exp_buffers = dict(expected.named_buffers())
        for name, b in actual.named_buffers():
            assert_tensors_close(b.to(exp_buffers[name].dtype), exp_buffers[name],
                                 f"rank {rank}, step {step}, buffer {name}", rtol, atol, baseline=baseline)


def assert_grads_close(actual: nn.Module, expected: nn.Module, *, rank: int, step: int | str,
                       rtol: float | None = None, atol: float | None = None) -> None:
    """Gradients by parameter name; a missing gradient must be missing on both sides."""
    exp_params = dict(expected.named_parameters())
    for name, p in actual.named_parameters():
        e = exp_params[name]
        if (p.grad is None) != (e.grad is None):
            raise AssertionError(f"rank {rank}, step {step}, parameter {name}: gradient is "
                                 f"{'None' if p.grad is None else 'set'} but expected "
                                 f"{'None' if e.grad is None else 'set'}")
        if p.grad is not None:
            assert_tensors_close(p.grad, e.grad, f"rank {rank}, step {step}, gradient of {name}", rtol, atol)


def assert_ranks_identical(model: nn.Module, *, step: int | str = "end", group=None) -> None:
    """Every rank holds bitwise the same parameters and buffers as rank 0 of ``group``.

    Collective: all ranks of ``group`` must call it.
    """
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for name, t in named:
            ref = t.detach().clone()
            dist.broadcast(ref, src=src, group=group)
            _record(f"step {step}: rank {rank} {kind} {name} vs rank 0's", t, ref, 0, 0, baseline=False)
            if not torch.equal(t.detach(), ref):
                raise AssertionError(f"ranks diverged at step {step}: rank {rank} {kind} {name} "
                                     f"differs from rank 0 by {max_abs_diff(t, ref):.3e}")


def shard(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous slice of a global batch whose size divides by ``world_size``."""
    if batch.shape[0] % world_size:
        raise ValueError(f"global batch {batch.shape[0]} is not divisible by world size {world_size}")
    per = batch.shape[0] // world_size
    return batch[rank * per:(rank + 1) * per]


def given_prerequisites(module, given: dict):
    """Give ``module`` (the graded one, loaded in this rank's own process) the bench's copies of the
    building blocks ``given`` names (name -> function): an exercise is graded with the other TODOs of its
    lesson taken from the bench, so a learner who finished only it scores its points. Not from the
    reference: in a grading run the reference is out of the learner's processes' reach
    (distlab/grading/jail.py). Call it inside a rank, never in the pytest parent (the patch lasts as long
    as the process)."""
    for name, fn in given.items():
        setattr(module, name, fn)
    return module


class explain_group_errors:
    """Context manager: the code under test, called with a process ``group``, fails in one line that names
    a global rank used as a group rank (or the reverse), instead of a bare ``IndexError``.

    ``x.chunk(dist.get_world_size(group))[dist.get_rank()]`` fails only where the global rank is past the
    group's size, as "tuple index out of range"; torch's ``src``/``dst`` inside a group are global ranks,
    and a group rank there fails as "Global rank 1 is not part of group". Both are re-raised as an
    AssertionError with the hint (the original chained); other errors pass unchanged. The message is the
    bench's, not the learner's: wrap only calls whose ``group`` is a subgroup.
    """

    def __init__(self, group: dist.ProcessGroup | None, what: str) -> None:
        self.group, self.what = group, what

    def __enter__(self) -> "explain_group_errors":
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or self.group is None or not isinstance(exc, (IndexError, ValueError)):
            return False
        rank, size = dist.get_rank(), dist.get_world_size(self.group)
        members = dist.get_process_group_ranks(self.group)
        if isinstance(exc, IndexError) and rank >= size:
            hint = (f"used the global rank {rank} on a group of size {size} (global ranks {members}, this rank is "
                    f"its rank {members.index(rank)}): use dist.get_rank(group)")
        elif isinstance(exc, ValueError) and "is not part of group" in str(exc):
            hint = (f"a group rank passed where torch wants a global rank (src/dst inside a group of global ranks "
                    f"{members}): use dist.get_global_rank(group, group_rank)")
        else:
            return False
        raise AssertionError(f"{self.what}: {type(exc).__name__}: {exc}: {hint}") from exc
