"""The cluster tier's bench: a Docker engine, an offline image, the project's compose file up for real.

Used by tests/test_cluster.py (marked ``cluster``; run with DISTLAB_CLUSTER=1, as .ci/run does
after the main suite). See engine.py.
"""
