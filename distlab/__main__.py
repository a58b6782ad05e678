"""``python -m distlab``: the learner's cockpit (see distlab/cockpit/__init__.py); ``python -m distlab dev check``
checks the course's manifest (distlab/course.toml) against the tree, for contributors (CONTRIBUTING.md)."""
from __future__ import annotations

import sys

from distlab.cockpit.cli import main

if __name__ == "__main__":
    sys.exit(main())
