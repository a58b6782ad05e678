"""Grading: a layer above the bench, which never imports it.

``verdict`` (the verdict made in a process that never ran learner code), ``sandbox`` (the audit hook and
the unprivileged user around a graded template), ``isolation`` (the static rules and the bench guard),
``grade`` (``python -m distlab.grading.grade``: Gradescope's results.json), ``plugin`` (the pytest
plugin's grading parts) and ``attach`` (what grading plugs into the bench's hooks, distlab/hooks.py).
"""
