"""requirements.txt's lower bounds are the versions the code needs, not wishes.

Only torch 2.14.1 / torchvision 0.29.1 can be installed here, so an older torch cannot be
run. What can be checked is that no API the code uses is newer than the lower bound: the
table names each version-gated API the course calls, with the torch release that added it.
A new use of a newer API fails this test until requirements.txt (and the table) say so.
"""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = [p for d in ("distlab", "solutions", "demos", "benchmarks") for p in (REPO / d).rglob("*.py")] + \
          list(REPO.glob("phase*/*.py"))

# pattern in the source -> (torch version that added it, what it is)
GATED = {
    r"\bgroup_(src|dst)\s*=": ((2, 6), "group_src/group_dst of send/recv/broadcast/gather/scatter"),
    r"from torch\.distributed\.fsdp import fully_shard": ((2, 6), "FSDP2's fully_shard, public in torch.distributed.fsdp"),
    r"register_post_accumulate_grad_hook": ((2, 1), "Tensor.register_post_accumulate_grad_hook"),
    r"from torch\.distributed\.tensor import|torch\.distributed\.tensor\.": ((2, 5), "the public torch.distributed.tensor (DTensor)"),
}
# torch minor -> the torchvision release built for it
TORCHVISION_FOR = {(2, 4): (0, 19), (2, 5): (0, 20), (2, 6): (0, 21), (2, 7): (0, 22), (2, 8): (0, 23)}


def _lower_bound(package: str) -> tuple[int, int]:
    text = (REPO / "requirements.txt").read_text()
    m = re.search(rf"^{package}\s*>=\s*(\d+)\.(\d+)", text, flags=re.M)
    assert m, f"requirements.txt gives {package} no lower bound"
    return int(m.group(1)), int(m.group(2))


def test_torch_lower_bound_covers_every_gated_api_the_code_uses():
    needed, why = (0, 0), []
    for path in SOURCES:
        text = path.read_text()
        for pattern, (version, what) in GATED.items():
            if re.search(pattern, text):
                if version > needed:
                    needed = version
                why.append(f"{path.relative_to(REPO)}: {what} (torch {version[0]}.{version[1]})")
    have = _lower_bound("torch")
    assert have >= needed, (f"requirements.txt allows torch {have[0]}.{have[1]}, but the code needs "
                            f"{needed[0]}.{needed[1]}:\n" + "\n".join(w for w in why if str(needed[1]) in w))


def test_torchvision_lower_bound_is_the_pair_of_torchs():
    torch_low, vision_low = _lower_bound("torch"), _lower_bound("torchvision")
    assert TORCHVISION_FOR.get(torch_low) == vision_low, \
        f"torch>={torch_low} pairs with torchvision>={TORCHVISION_FOR.get(torch_low)}, not {vision_low}"
