"""The options of ``python -m distlab.plan`` (distlab/plan.py), apart so that --help shows every default."""
from __future__ import annotations

import argparse


class _Help(argparse.ArgumentDefaultsHelpFormatter):  # every default in --help; "(default: ...)" stays as written
    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if "(default:" in action.help else super()._get_help_string(action)


def parser(presets: list[str], description: str) -> argparse.ArgumentParser:
    """``python -m distlab.plan``'s options (``presets``: the --preset names), every default shown by --help."""
    ap = argparse.ArgumentParser(prog="python -m distlab.plan", description=description,
                                 formatter_class=_Help, usage="%(prog)s (--preset NAME | --layers L --hidden H "
                                 "--seq S) --gpus N [options]\n       %(prog)s --reproduce megatron")
    ap.add_argument("--reproduce", choices=["megatron"], help="print Megatron-LM's Table 1 beside the step-time "
                    "model's predictions and best layouts (distlab/plan_time.py), then exit (default: plan)")
    ap.add_argument("--preset", choices=presets, help="a published model's sizes (default: none)")
    pre = "the preset's"
    for name, kind, default in (("params", float, "the architecture's count"), ("layers", int, pre), ("hidden", int, pre),
                                ("heads", int, pre + ", else hidden/128"), ("vocab", int, pre + ", else 32000"),
                                ("seq", int, pre), ("ffn", int, pre + ", else 4 x hidden"), ("experts", int, "1"),
                                ("top-k", int, "1")):
        ap.add_argument(f"--{name}", type=kind, help=f"model {name} (default: {default})")
    ap.add_argument("--untied", action="store_true", help="LM head not tied to the embedding")
    ap.add_argument("--gpus", type=int, help="GPUs in the cluster (default: none; required without --reproduce)")
    ap.add_argument("--gpu-mem", type=float, default=80.0, help="GB per GPU")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (tensor parallelism stays inside)")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    ap.add_argument("--global-batch", type=int, default=512, help="sequences per step, all ranks")
    ap.add_argument("--dtype-bytes", type=int, default=2, help="bytes per parameter, gradient, activation")
    ap.add_argument("--optimizer-bytes", type=int, default=12, help="optimizer bytes per parameter (K)")
    for axis in ("tp", "pp", "cp", "ep"):
        ap.add_argument(f"--{axis}", type=int, help=f"hold the {axis} degree (default: try every one)")
    ap.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="0: DDP; 1-3: ZeRO stage (default: try each)")
    ap.add_argument("--recompute", choices=["yes", "no"], help="activation recomputation (default: try both)")
    ap.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU")
    ap.add_argument("--intra-gbs", type=float, default=450.0, help="GB/s inside a node")
    ap.add_argument("--inter-gbs", type=float, default=50.0, help="GB/s across nodes")
    ap.add_argument("--top", type=int, default=10, help="feasible plans to print")
    return ap
