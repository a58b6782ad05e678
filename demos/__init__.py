"""One runnable demo per RUN_MODE (see entrypoint.sh): argparse, tables, plots.

A demo runs the lesson code through ``distlab.loader.load``, so ``IMPL=templates``
(or ``DISTLAB_IMPL=templates``) runs the learner's templates instead of the solutions,
and an unfinished TODO ends the run with one line (``distlab.todo.run_demo``).

Each demo also has ``build_parser()`` and ``resolve_args(args, world_size)``: sizes left to
their defaults adapt to the world size, and a size given that cannot work is a ValueError
naming the flag and a value that can (demos/sizes.py). tests/test_modes.py resolves every
mode's defaults at world sizes 1-8.
"""
