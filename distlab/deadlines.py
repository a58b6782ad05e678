"""``DISTLAB_TIMEOUT_SCALE``: the one multiplier of every course deadline, for a machine its user knows is slow.

Torch-free, so that the cockpit reads it before anything heavy loads; distlab/doctor_watch.py applies it to the
launcher's deadlines (a run's, the hang delay, the process group's, the torchrun watchdog's, each test's
pytest-timeout), distlab/cockpit/warm.py to the warm launcher's start, distlab/launch_agent.py to the rendezvous'
wait for the other nodes (torchrun's join timeout) and procs.Deadline to a job's (a torchrun job's in phase 4's
tests, each seeded bug's nested pytest in distlab/bugs.py). Past each deadline, a run or job still progressing on
a busy machine is waited for up to doctor_watch.hard_cap_s, then said slow ("slow machine (load ...), not your
code: rerun"), never blamed.
"""
from __future__ import annotations

import os

TIMEOUT_SCALE_ENV = "DISTLAB_TIMEOUT_SCALE"


def timeout_scale() -> float:
    """DISTLAB_TIMEOUT_SCALE as a number (1 when unset): every course deadline is multiplied by it."""
    setting = os.environ.get(TIMEOUT_SCALE_ENV, "").strip()
    try:
        value = float(setting) if setting else 1.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{TIMEOUT_SCALE_ENV}={setting!r} must be a number > 0 that multiplies every deadline "
                         f"(e.g. {TIMEOUT_SCALE_ENV}=3 on a slow machine)")
    return value
