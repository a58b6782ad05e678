"""Cheat: __import__ through sys.modules['builtins']."""
import sys

_imp = vars(sys.modules["builtins"])["__import__"]
DistributedSampler = _imp("solu" + "tions.phase1_data_parallel.data_loader", fromlist=["x"]).DistributedSampler
