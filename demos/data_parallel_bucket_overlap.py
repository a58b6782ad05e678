"""RUN_MODE=data_parallel_bucket_overlap: TinyCNN on digits under bucketed DDP, overlapped with backward.

    RUN_MODE=data_parallel_bucket_overlap ./entrypoint.sh [--bucket-mb 0.01] [--epochs 6]
    IMPL=templates RUN_MODE=data_parallel_bucket_overlap ./entrypoint.sh   # your template_ddp_bucketed.py

The same training loop and summary as demos/data_parallel_overlap.py (imported from
there), with ``DDPBucketed``: at the default 0.01 MiB the table shows 3 all-reduces
per step instead of one per parameter, for the same gradient bytes.
See phase3_multi_node/guidelines_ddp_zero.md#ddp-buckets.
"""
from __future__ import annotations

from demos.data_parallel_overlap import build_parser, resolve_args, train_demo  # noqa: F401 (the same flags)
from distlab.loader import load
from distlab.todo import run_demo


def main(argv: list[str] | None = None) -> None:
    ddp = load("phase3_multi_node", "ddp_bucketed")
    train_demo(lambda model, args: ddp.DDPBucketed(model, bucket_size_mb=args.bucket_mb),
               "DDP, bucketed all-reduce overlapped with backward", argv)


if __name__ == "__main__":
    run_demo(main)
