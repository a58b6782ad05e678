"""``python -m distlab``: the learner's cockpit (see distlab/cockpit/__init__.py)."""
from __future__ import annotations

import sys

from distlab.cockpit.cli import main

if __name__ == "__main__":
    sys.exit(main())
