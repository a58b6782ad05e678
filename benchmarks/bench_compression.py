"""Gradient compression: bytes per step vs test accuracy, ours beside PyTorch's own hooks.

2 ranks train the digits MLP (4810 float32 parameters, one DDP bucket) under torch DDP
with each communication hook, and CommLedger counts the bytes every rank hands to
torch.distributed per step (median over steps).

* fp16 / bf16: ours vs ``ddp_comm_hooks.default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``;
* PowerSGD rank 2: ours vs ``ddp_comm_hooks.powerSGD_hook`` (same rank, error feedback,
  warm start; torch starts compressing after ``start_powerSGD_iter`` steps and skips
  tensors that would not shrink by ``min_compression_rate``);
* top-k (10%, error feedback): no built-in; compared with the uncompressed fp32 all-reduce.

Ratios are ours / built-in: bytes (< 1 = fewer bytes than the built-in) and accuracy.

Run: ``python -m benchmarks.bench_compression [--quick]``.
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from benchmarks.common import comparison, write_result
from distlab.spawn import run_distributed

WORLD_SIZE = 2
FP32_BYTES = 4 * 4810  # the uncompressed all-reduce of every parameter


def _torch_hooks():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    def torch_powersgd():
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            min_compression_rate=1.0, use_error_feedback=True, warm_start=True)
        return powerSGD_hook.powerSGD_hook, state

    return {"fp16": lambda: (default_hooks.fp16_compress_hook, None),
            "bf16": lambda: (default_hooks.bf16_compress_hook, None),
            "powersgd": torch_powersgd}


def _worker(rank, world_size, epochs):
    from demos.compression import train_digits

    ours, builtin = {}, {}
    for method in ("ddp", "fp16", "bf16", "topk", "powersgd"):
        ours[method] = train_digits(method, rank, world_size, epochs=epochs)
    for method, make in _torch_hooks().items():
        builtin[method] = train_digits(method, rank, world_size, epochs=epochs, hook_and_state=make())
    dist.barrier()
    return ours, builtin


def run(quick: bool = False) -> dict:
    epochs = 2 if quick else 4
    ours, builtin = run_distributed(_worker, WORLD_SIZE, epochs, backend="gloo", timeout_s=600)[0]
    base_acc = ours["ddp"]["accuracy"]
    comparisons, table = {}, []
    for method in ("fp16", "bf16", "topk", "powersgd"):
        o = ours[method]
        ref_bytes = builtin[method]["bytes_per_step"] if method in builtin else FP32_BYTES
        ref_acc = builtin[method]["accuracy"] if method in builtin else base_acc
        ref_name = "torch hook" if method in builtin else "fp32 all-reduce"
        comparisons[f"{method} bytes/step vs {ref_name}"] = comparison(
            o["bytes_per_step"], ref_bytes, WORLD_SIZE, "4810 params", metric="bytes", unit="B")
        comparisons[f"{method} accuracy vs {ref_name}"] = comparison(
            o["accuracy"], ref_acc, WORLD_SIZE, "4810 params", metric="accuracy", unit="fraction")
        table.append({"method": method, "bytes/step": o["bytes_per_step"], "vs fp32": o["bytes_per_step"] / FP32_BYTES,
                      "accuracy": o["accuracy"], "reference": ref_name, "reference bytes/step": ref_bytes,
                      "reference accuracy": ref_acc})
    result = {"name": "compression", "comparisons": comparisons, "table": table,
              "uncompressed_accuracy": base_acc, "fp32_bytes_per_step": FP32_BYTES, "epochs": epochs}
    try:
        from distlab.plots import plot_bars
        from benchmarks.common import RESULTS
        plot_bars({r["method"]: r["vs fp32"] for r in table}, RESULTS / "compression_bytes.png",
                  ylabel="bytes per step / fp32 all-reduce", title="gradient compression (digits MLP, 2 ranks)")
    except Exception as exc:  # a plot is a bonus; the JSON is the result
        result["plot_error"] = str(exc)
    return result


def main(argv: list[str] | None = None) -> None:
    from distlab.metrics import format_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    path = write_result("compression", result)
    print(format_table([{k: (f"{v:.3f}" if isinstance(v, float) else v) for k, v in row.items()}
                        for row in result["table"]]))
    print(f"uncompressed accuracy {result['uncompressed_accuracy']:.3f}; wrote {path}")


if __name__ == "__main__":
    main()
