"""Code given to single lessons: plumbing that is not the lesson, and the bench's copies of what was taught.

Each module names its lesson in its docstring; the README's map of ``distlab/`` lists them by phase.
A template may not import the bench's copy of its own exercise (``distlab.grading.isolation.BENCH_COPIES``).
"""
