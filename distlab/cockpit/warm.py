"""A pytest plugin for ``check``: start the rank launcher's forkserver while pytest collects.

run_distributed's ranks come from a forkserver that imports torch once (distlab.launch._context);
started on the first test, that import (~1-2 s) waits behind pytest's own start. Started here, in a
thread, it runs on the second core while pytest imports torch and collects, and the first test
finds it ready. Used by ``python -m distlab check`` (``-p distlab.cockpit.warm``); harmless elsewhere.
"""
from __future__ import annotations

import threading


def pytest_configure(config):
    from multiprocessing import forkserver

    from distlab.launch import _context

    _context()  # sets the forkserver's preload list, once per process
    # ensure_running holds the forkserver's lock: the first run_distributed waits for this start
    # instead of starting a second server.
    threading.Thread(target=forkserver.ensure_running, name="distlab-warm-forkserver", daemon=True).start()
