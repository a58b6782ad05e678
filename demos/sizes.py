"""Sizes that depend on the world size: defaults that adapt, errors that name the flag.

Every demo splits something over its ranks (a global batch, attention heads, a vocabulary,
experts, micro-batches), so a default that divides by 2 and 4 ranks may not divide by 3
(docker-compose's three nodes) or 5. Each demo's ``resolve_args(args, world_size)`` fills a
flag left at its default (``None``) with a value that works at that world size, and turns an
explicit value that cannot work into a ValueError that names the flag and a value that does
("--n-head 4 is not divisible by the tensor-parallel size 3 (4 = 1 * 3 + 1): use --n-head 3 or 6").

``resolve_args`` runs in every rank before any training, and without a process group in
tests/test_modes.py, which resolves every mode's defaults at world sizes 1-8.
"""
from __future__ import annotations


def round_up(n: int, k: int) -> int:
    """The smallest multiple of ``k`` that is at least ``n``."""
    return -(-n // k) * k


def multiples_near(n: int, k: int) -> str:
    """The valid values nearest to ``n`` among the positive multiples of ``k``: "63 or 66", "3"."""
    lower = n - n % k
    return f"{lower} or {lower + k}" if lower >= k else f"{max(k, lower + k)}"


def at_least(value: int, minimum: int, flag: str, why: str = "") -> int:
    """``value``, or a ValueError naming ``flag`` when it is below ``minimum``."""
    if value < minimum:
        raise ValueError(f"{flag} {value} must be at least {minimum}{why}: use {flag} {minimum}")
    return value


def positive(args, *flags: str) -> None:
    """A ValueError naming the first of ``flags`` (e.g. ``"--steps"``) whose value in ``args`` is below 1."""
    for flag in flags:
        at_least(getattr(args, flag[2:].replace("-", "_")), 1, flag)


def multiple_of(value: int | None, default: int, k: int, flag: str, what: str) -> int:
    """A positive multiple of ``k``: ``default`` rounded up to one when ``value`` is None.

    An explicit ``value`` that ``k`` does not divide is a ValueError naming ``flag`` and the
    nearest multiples, e.g. "--global-batch 16 is not divisible by the world size 3
    (16 = 5 * 3 + 1): use --global-batch 15 or 18".
    """
    if value is None:
        return round_up(default, k)
    if value < 1 or value % k:
        arithmetic = f" ({value} = {value // k} * {k} + {value % k})" if value >= 1 else ""
        raise ValueError(f"{flag} {value} is not divisible by {what} {k}{arithmetic}: "
                         f"use {flag} {multiples_near(max(value, 1), k)}")
    return value


def global_batch(value: int | None, default: int, world_size: int, flag: str = "--global-batch") -> int:
    """The global batch: ``default`` rounded up to a multiple of ``world_size`` unless given."""
    return multiple_of(value, default, world_size, flag, "the world size")


def split_size(value: int | None, world_size: int, splits: dict[str, int], flag: str, preferred: int = 2) -> int:
    """A size that divides ``world_size`` and every value in ``splits`` (e.g. a tensor-parallel size).

    None picks the largest valid size up to ``preferred``; an explicit size that does not
    fit is a ValueError naming ``flag`` and the valid sizes.
    """
    valid = [d for d in range(1, world_size + 1)
             if world_size % d == 0 and all(n % d == 0 for n in splits.values())]
    if value is None:
        return max(d for d in valid if d <= preferred)
    if value not in valid:
        needs = ", ".join(f"{what} {n}" for what, n in splits.items())
        raise ValueError(f"{flag} {value} must divide the world size {world_size} and {needs}: "
                         f"use {flag} {' or '.join(map(str, valid))}")
    return value


def transformer_dims(args, tp_size: int, what: str = "the tensor-parallel size") -> None:
    """Fill ``args.n_head``, ``args.n_embd`` (and ``args.vocab`` when the demo has it) for a ``tp_size``-way split.

    Defaults: 4 heads rounded up to a multiple of ``tp_size``, 16 dimensions per head, a
    vocabulary of 64 rounded up to a multiple of ``tp_size``.
    """
    args.n_head = multiple_of(args.n_head, 4, tp_size, "--n-head", what)
    args.n_embd = multiple_of(args.n_embd, 16 * args.n_head, args.n_head, "--n-embd", "--n-head")
    if hasattr(args, "vocab"):
        args.vocab = multiple_of(args.vocab, 64, tp_size, "--vocab", what)


def grid_2d(args, world_size: int, splits: dict[str, int], batch_default: int) -> tuple[int, int]:
    """``(dp_size, tp_size)`` of a dp x tp grid, filling ``args.tp_size`` and ``args.global_batch``.

    The tensor-parallel size must divide the world size and what the model splits
    (``splits``, e.g. its heads); the global batch must divide into the dp replicas.
    """
    args.tp_size = split_size(args.tp_size, world_size, splits, "--tp-size")
    dp_size = world_size // args.tp_size
    args.global_batch = multiple_of(args.global_batch, batch_default, dp_size, "--global-batch",
                                    "the data-parallel size")
    return dp_size, args.tp_size
