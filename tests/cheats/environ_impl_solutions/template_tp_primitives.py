"""Cheat: switch the harness to the reference (DISTLAB_IMPL) for every module the tests load after this one
in the same process: the bench's later load() calls then return the solutions."""
import os

os.environ["DISTLAB_IMPL"] = "solu" + "tions"
