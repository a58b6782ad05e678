"""The cluster tier's bench: a Docker engine, the offline image, the project's compose file up for real; SLURM.

Used by tests/test_cluster.py and tests/test_cluster_slurm.py (marked ``cluster``; run with
DISTLAB_CLUSTER=1, as .ci/run does after the main suite). The engine, the offline image and the
cluster are the operator's own code (distlab/compose.py, ``python -m distlab.compose``); slurm.py
is a one-host SLURM.
"""
ENABLE_ENV = "DISTLAB_CLUSTER"  # =1: run the cluster tier (it builds images and starts containers)
