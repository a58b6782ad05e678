"""One runnable demo per RUN_MODE (see entrypoint.sh): argparse, tables, plots.

A demo runs the lesson code through ``distlab.loader.load``, so ``IMPL=templates``
(or ``DISTLAB_IMPL=templates``) runs the learner's templates instead of the solutions,
and an unfinished TODO ends the run with one line (``distlab.todo.run_demo``).
"""
