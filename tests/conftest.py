"""The grading switch (--impl, --student-dir, --results-json) and the per-exercise score
live in distlab/pytest_plugin.py, loaded by pyproject.toml's ``-p distlab.pytest_plugin``; what
grading adds, in distlab/grading/plugin.py (``-p distlab.grading.plugin``)."""
