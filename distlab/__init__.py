"""distlab: the shared lab bench of the course (launcher, models, data, ledger, metrics).

Learners never edit this package; every phase builds on it.
"""
from distlab.todo import LearnerTODO, todo
from distlab.loader import load

__all__ = ["LearnerTODO", "todo", "load"]
