"""What the point-to-point size check costs per message: checked vs unchecked, in one run.

``distlab.p2p.enable_size_check()`` (on wherever the course's code runs; off with
``DISTLAB_P2P_SIZE_CHECK=0``) sends a 16-byte header with every message and compares it
with the receive buffer. Here 2 gloo ranks ping-pong messages through the course's layer
(``p2p.send`` / ``p2p.recv``: rank 0 sends, rank 1 receives and answers) with the check
off ("unchecked", the reference) and on ("checked"), on the harness (benchmarks/harness.py:
rotated order, a warm-up, the received tensors checked equal, slowest rank per repeat,
3 launches). Both ranks switch the check in the contender's ``prepare``, untimed and at the
same point of the rotation: the header is part of the wire format, so they must agree.

Ratios: time per message checked / unchecked (1 = free). Small messages show the
per-message cost (one more tiny message, a header built and read); large ones that it
does not grow with the payload.

    python -m benchmarks.bench_p2p_check [--quick] [--launches 3]

writes benchmarks/results/p2p_check.json and p2p_check.png.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import Contender, format_row, launch, load_of, measure, ratio_row
from distlab import p2p
from distlab.metrics import format_bytes, format_table

KiB, MiB = 1 << 10, 1 << 20
SIZES = [64, 4 * KiB, 256 * KiB, 4 * MiB]
QUICK_SIZES = [64, 1 * MiB]
CHECKED, UNCHECKED = "checked", "unchecked"


def _round_trips(nbytes: int) -> int:
    """Round trips per timed window: a 64-byte message takes ~0.1-0.3 ms here, shorter than the
    scheduler's noise on a shared machine; a window of 256 round trips (~0.1 s) is not. Large
    messages: 64 MiB moved per window, at least 4 round trips."""
    return max(4, min(256, 32 * MiB // max(nbytes, 1)))


def _ping_pong(send: torch.Tensor, recv: torch.Tensor, round_trips: int) -> torch.Tensor:
    rank = dist.get_rank()
    for _ in range(round_trips):
        if rank == 0:
            p2p.send(send, 1)
            p2p.recv(recv, 1)
        else:
            p2p.recv(recv, 0)
            p2p.send(send, 0)
    return recv


def _set_check(on: bool) -> None:
    p2p.disable_strict()  # strict mode (pytest sets it) checks sizes through the store: not what is measured
    if on:
        assert p2p.enable_size_check(), "DISTLAB_P2P_SIZE_CHECK=0 is set: unset it to measure the check"
    else:
        p2p.disable_size_check()


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bytes must arrive either way: ``torch.equal`` (nothing is summed)."""
    if not torch.equal(got, want):
        raise AssertionError(f"received tensors differ: max abs diff {(got - want).abs().max().item()}")


def _worker(rank: int, world_size: int, sizes: list[int], repeats: int) -> dict:
    torch.set_num_threads(1)  # nothing to compute; leave the cores to gloo's I/O threads
    out = {}
    for nbytes in sizes:
        n = max(1, nbytes // 4)
        send = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        trips = _round_trips(nbytes)
        contenders = []
        for name, on in ((UNCHECKED, False), (CHECKED, True)):
            recv = torch.empty(n)
            contenders.append(Contender(name, run=lambda recv=recv: _ping_pong(send, recv, trips),
                                        prepare=lambda recv=recv, on=on: (_set_check(on), recv.fill_(float("nan"))),
                                        result=lambda recv=recv: recv.clone()))
        out[nbytes] = measure(contenders, UNCHECKED, repeats=repeats, warmup=1, check=_same)
        out[nbytes]["round_trips"] = trips
    _set_check(False)
    return out


def run(quick: bool = False, out_dir: Path | None = None, launches: int = 3) -> dict:
    out_dir = Path(out_dir or RESULTS)
    sizes = QUICK_SIZES if quick else SIZES
    repeats = 5 if quick else 15
    runs = launch(_worker, 2, sizes, repeats, launches=launches, backend="gloo", timeout_s=600)
    result = {"name": "p2p_check", "machine": machine_info(), "launches": launches, "sizes": sizes,
              "note": "2 gloo ranks on one machine ping-pong through distlab.p2p; a time is per message (a window "
                      "of round trips / 2 per message); rows: median and spread over all repeats of all launches",
              "comparisons": {}, "load": load_of(runs),
              # by construction: one header message of 16 bytes (int64 bytes + dtype code) per message
              "extra_messages_per_message": 1, "extra_bytes_per_message": 16}
    rows, bars = [], {}
    for nbytes in sizes:
        size = format_bytes(nbytes)
        pick = lambda r, nbytes=nbytes: r[nbytes]  # noqa: E731
        row = ratio_row(runs, CHECKED, UNCHECKED, key=pick, world_size=2, size=size,
                        meaning="time per message with the size check / without (1 = free)")
        per_message = {name: statistics.median(v for r in runs for v in pick(r["result"])["times"][name])
                       / (2 * pick(runs[0]["result"])["round_trips"]) for name in (UNCHECKED, CHECKED)}
        row["us_per_message"] = {k: v * 1e6 for k, v in per_message.items()}
        row["overhead_us_per_message"] = (per_message[CHECKED] - per_message[UNCHECKED]) * 1e6
        result["comparisons"][f"size check / unchecked, {size}"] = row
        bars[size] = row["ratio"]
        rows.append({"message": size, "unchecked us/msg": f"{per_message[UNCHECKED] * 1e6:.1f}",
                     "checked us/msg": f"{per_message[CHECKED] * 1e6:.1f}",
                     "checked / unchecked [IQR; range; per launch]": format_row(row)})
    result["table"] = rows
    try:
        from distlab.plots import plot_bars

        plot_bars(bars, out_dir / "p2p_check.png", ylabel="time per message, checked / unchecked",
                  title="p2p size check, 2 gloo ranks (1 = free)")
        result["plot"] = "p2p_check.png"
    except Exception as exc:  # a plot is a bonus; the JSON is the result
        result["plot_error"] = str(exc)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two sizes, 5 repeats (well under a minute)")
    parser.add_argument("--launches", type=int, default=3, help="fresh process groups (>= 3 for a spread)")
    args = parser.parse_args(argv)
    result = run(quick=args.quick, launches=args.launches)
    path = write_result("p2p_check", result)
    print(format_table(result["table"]))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
