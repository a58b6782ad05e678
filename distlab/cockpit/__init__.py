"""The learner's cockpit: ``python -m distlab`` (or the ``distlab`` command).

    distlab status          every exercise, its state and points; a progress bar per phase
    distlab next            the first unfinished exercise: its TODO (file:line), guideline, command
    distlab check 1.1       run exactly that exercise's tests on your templates; one line per test
    distlab hint 1.1        the next hint you have not seen yet, one at a time
    distlab watch           re-check the current exercise whenever you save its template
    distlab reset 1.1       put a TODO region back to its stub (your code is kept in .distlab/reset/)

Modules: ``course`` (exercises, TODO regions, tests, the state file ``.distlab/state.json``),
``checks`` (pytest for one exercise, its verdict), ``hints``, ``reset``, ``cli`` (the commands).
``check --trace DIR`` records every rank of every world the tests start (distlab/trace.py).
"""
