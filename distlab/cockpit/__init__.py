"""The learner's cockpit: ``python -m distlab`` (or the ``distlab`` command).

    distlab status          every exercise, its state and points; a progress bar per phase
    distlab next            the first unfinished exercise: its TODO (file:line), guideline, command
    distlab check 1.1       run exactly that exercise's tests on your templates; one line per test
    distlab hint 1.1        the next hint you have not seen yet, one at a time
    distlab watch [1.1]     re-check an exercise whenever you change its TODO regions (stays on a named one)
    distlab guide 1.1       the exercise's guideline section, without its hints
    distlab reset 1.1       put a TODO region back to its stub (your code is kept in .distlab/reset/)
    distlab restore 1.1     undo that reset: the code it kept goes back
    distlab dev check       for contributors: the manifest (distlab/course.toml) against the tree

The exercises are the manifest's (distlab/manifest.py). Modules: ``course`` (exercises, what is next,
TODO regions, tests, the state file ``.distlab/state.json``),
``checks`` (pytest for one exercise, its verdict), ``hints``, ``reset``, ``cli`` (the commands).
``check --trace DIR`` records every rank of every world the tests start (distlab/trace.py).
"""
