"""The whole test suite on a busy machine: does it pass, with no false hang, and how much slower is it?

    python -m benchmarks.busy_suite                   # quiet suite, then the suite beside 4 busy processes
    python -m benchmarks.busy_suite --burners 4 --skip-quiet -- tests/test_doctor.py
    python -m benchmarks.busy_suite --json benchmarks/results/busy_suite.json

A learner's laptop is busy with something else; the suite must still tell the truth there.
This runs ``python -m pytest`` (the README's test command; arguments after ``--`` are passed
on) once on the quiet machine and once with ``--burners`` extra processes that spin a core
each at normal priority (4 on 2 cores: the suite gets about a third of the CPU), and reports
for each run: passed or failed, the wall time, the 1-minute load average (sampled every 5 s:
median and highest), and every "hang diagnosed" the suite printed (a false hang is a test
that failed with the doctor's HangError while nothing was hung; on a passing run there are
none). The burners end with the run, whatever ends it. Not part of the suite (it runs the
suite); minutes to an hour.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import machine_info
from distlab.procs import kill_process_tree, marked_environ

REPO = Path(__file__).resolve().parent.parent
_BURN = "while True: pass"


def run_suite(pytest_args: list[str], burners: int, log: str | None = None) -> dict:
    """One run of the suite beside ``burners`` busy processes; what it took and what it said (as it goes, in
    ``log`` too: ``tail -f`` it)."""
    marker = os.urandom(8).hex()
    env = marked_environ(marker)
    spinners = [subprocess.Popen([sys.executable, "-c", _BURN], env=env) for _ in range(burners)]
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(5.0):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.monotonic()
    sampler.start()
    try:
        with open(log or os.devnull, "w") as tee:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            lines = []
            for line in proc.stdout:
                lines.append(line)
                tee.write(line)
                tee.flush()
            proc.wait()
    finally:
        done.set()
        for p in spinners:
            kill_process_tree(p.pid)
            p.wait()
        kill_process_tree(marker=marker)
    wall = time.monotonic() - start
    output = "".join(lines)
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\d+ (passed|failed)", line)), "")
    return {"burners": burners, "passed": proc.returncode == 0, "exit_code": proc.returncode,
            "wall_s": round(wall, 1), "summary": summary.strip("= "),
            "load_median": round(statistics.median(loads), 1) if loads else None,
            "load_max": round(max(loads), 1) if loads else None,
            "hangs_diagnosed": sorted({line.strip()[:200] for line in output.splitlines() if "hang diagnosed" in line}),
            "failed": [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--burners", type=int, default=4, help="busy processes beside the loaded run (default 4)")
    parser.add_argument("--skip-quiet", action="store_true", help="only the loaded run")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--log", default=None, help="the loaded run's pytest output, as it goes")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest (default: the whole suite)")
    args = parser.parse_args(argv)
    if args.burners < 1:
        parser.error(f"--burners {args.burners}: at least 1 busy process (the point is a busy machine)")
    runs = [] if args.skip_quiet else [run_suite(args.pytest_args, 0)]
    runs.append(run_suite(args.pytest_args, args.burners, args.log))
    for r in runs:
        what = "quiet" if r["burners"] == 0 else f"{r['burners']} busy processes"
        print(f"{what:>18}: {'passed' if r['passed'] else 'FAILED'} in {r['wall_s']:.0f} s "
              f"(load median {r['load_median']}, max {r['load_max']}); {r['summary']}; "
              f"hangs diagnosed: {len(r['hangs_diagnosed'])}")
        for line in r["failed"]:
            print(f"{'':>20}{line}")
    if len(runs) == 2:
        print(f"{'slowdown':>18}: {runs[1]['wall_s'] / runs[0]['wall_s']:.2f}x the quiet suite's wall time")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_info(), "pytest_args": args.pytest_args,
                                               "runs": runs}, indent=2) + "\n")
    return 0 if all(r["passed"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
