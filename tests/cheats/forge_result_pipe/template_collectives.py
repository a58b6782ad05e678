"""Cheat: no forbidden import and no dunder. The rank reaches `os` through a module torch imported,
writes a forged "ok" into every pipe it holds (one of them is its result pipe) and leaves before the
test's checks run."""
import torch


def _forge():
    reach = torch.serialization.os
    payload = torch.serialization.pickle.dumps(("ok", None, []))
    frame = len(payload).to_bytes(4, "big") + payload
    for fd in range(3, 256):
        try:
            if reach.readlink("/proc/self/fd/" + str(fd)).startswith("pipe:"):
                reach.write(fd, frame)
        except OSError:
            pass
    reach._exit(0)


def allreduce_allgather_sum(tensor, op="sum", group=None):
    _forge()


allreduce_reduce_broadcast = allreduce_gather_scatter = allreduce_allgather_sum
