"""distlab.p2p: the NCCL-safe point-to-point layer, and its strict mode on gloo.

The layer is checked against what each rank knows it must receive (every rank builds
every rank's tensor from a seed) and against CommLedger's byte counts. Strict mode is
checked on small seeded examples of each NCCL hazard it exists for: each must raise
``StrictP2PError`` with the reason, although gloo alone runs every one of them.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distlab import p2p, p2p_sizes
from distlab.comm import CommLedger
from distlab.spawn import run_distributed


def _seeded(rank: int, step: int, n: int = 5, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, generator=g).to(dtype)


def _worker_layer(rank, world_size, check="strict"):
    if check == "strict":
        p2p.enable_strict()  # every pattern below must pass NCCL's rules too
    else:  # the size check alone, as outside pytest: a header travels with every message
        p2p.disable_strict()
        assert p2p.enable_size_check() and p2p.size_check_enabled()
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    ledger = CommLedger()
    with ledger:
        # A ring step (grouped send right / receive left); at W=2 both go to one peer.
        got = torch.empty(5)
        p2p.send_recv(_seeded(rank, 0), right, got, left)
        assert torch.equal(got, _seeded(left, 0)), f"rank {rank}: ring step received the wrong tensor"
        # Exchange with a partner, asynchronous, plus an empty tensor that is skipped on both ends.
        peer = rank ^ 1
        if peer < world_size:
            got = torch.empty(5)
            work = p2p.exchange(_seeded(rank, 1), got, peer, async_op=True)
            p2p.exchange(torch.empty(0), torch.empty(0), peer)
            work.wait()
            assert torch.equal(got, _seeded(peer, 1)), f"rank {rank}: exchange with {peer} received the wrong tensor"
        # 1F1B's steady state between ranks 0 and 1: 0 sends activations forward and receives
        # gradients back, 1 the reverse, three micro-batches; the Outbox groups each send with
        # the next receive, so NCCL never needs to buffer.
        if rank < 2 and world_size >= 2:
            box = p2p.Outbox()
            for mb in range(3):
                buf = torch.empty(5)
                if rank == 0:
                    box.put(_seeded(0, 10 + mb), 1)
                    box.recv(buf, 1)
                    assert torch.equal(buf, _seeded(1, 20 + mb)), f"rank 0: gradient {mb} wrong"
                else:
                    box.recv(buf, 0)
                    assert torch.equal(buf, _seeded(0, 10 + mb)), f"rank 1: activation {mb} wrong"
                    box.put(_seeded(1, 20 + mb), 0)
            box.finish()
    expected = 5 * 4 * (1 + (rank ^ 1 < world_size) + 3 * (rank < 2 and world_size >= 2))
    assert ledger.sent_bytes() == expected, f"rank {rank}: sent {ledger.sent_bytes()} bytes, expected {expected}"
    # Inbox: the others announce, then send; rank 0 receives each message from the rank that announced it.
    inbox = p2p.Inbox(0, "layer")
    if rank == 0:
        seen: dict[int, list[int]] = {}
        for _ in range(2 * (world_size - 1)):
            sender, note = inbox.next()
            got = p2p.recv(torch.empty(5), sender)
            assert torch.equal(got, _seeded(sender, 30 + int(note))), f"message {note} of rank {sender} wrong"
            seen.setdefault(sender, []).append(int(note))
        assert seen == {r: [0, 1] for r in range(1, world_size)}, f"announcements seen: {seen}"
    else:
        for k in range(2):
            inbox.announce(str(k))
            p2p.send(_seeded(rank, 30 + k), 0)
    again = p2p.Inbox(0, "layer")  # the same name opened again: a fresh, empty queue
    if rank == world_size - 1:
        again.announce("again")
    if rank == 0:
        assert again.next() == (world_size - 1, "again"), "a reopened inbox must start empty"
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_p2p_layer_delivers_by_order_and_passes_strict_mode(world_size):
    assert run_distributed(_worker_layer, world_size, backend="gloo") == [True] * world_size


def test_p2p_layer_delivers_the_same_under_the_size_check():
    """The headers change nothing a caller sees: same tensors, and the ledger's bytes are the payload's."""
    assert run_distributed(_worker_layer, 3, "size", backend="gloo") == [True] * 3


# --------------------------------------------------------------------------- the size check
def _worker_size_mismatch(rank, world_size, case):
    p2p.disable_strict()  # as outside pytest: strict mode off, the size check on (what init_from_env does)
    on = p2p.enable_size_check()
    stale = torch.full((8,), -1.0)
    if case == "short":  # the probe: 4 floats sent, received into 8; gloo keeps the last 4 stale
        dist.send(torch.ones(4), dst=1) if rank == 0 else dist.recv(stale, src=0)
    elif case == "dtype":  # same bytes, another dtype: gloo reinterprets the bits
        p2p.send(torch.ones(4), 1) if rank == 0 else p2p.recv(torch.empty(4, dtype=torch.int32), 0)
    elif case == "batched":  # a ring step whose chunks disagree (the uneven last chunk): grouped both ways
        p2p.exchange(torch.ones(3 if rank == 0 else 5), torch.empty(5), 1 - rank)
    elif case == "deferred":  # the CUDA path (no host sync per receive): caught at the flush, same message
        with p2p.defer_size_checks_on_cpu():
            dist.send(torch.ones(4), dst=1) if rank == 0 else dist.recv(stale, src=0)
            assert p2p._deferred or rank == 0, "the verdict was read at the receive: a host sync on CUDA"
    elif case == "deferred, last receive":  # the rank ends with a header unread: the launcher's flush reads it
        p2p_sizes._defer_on_cpu = True  # CUDA's path, with no flush of its own (the context manager would flush)
        dist.send(torch.ones(4), dst=1) if rank == 0 else dist.recv(stale, src=0)
    return on, stale.tolist()


SIZE_MISMATCHES = {
    "short": r"rank 1: receive #0 from rank 0 got 16 bytes of float32 into a buffer of 32 bytes of float32 \(8,\): "
             r"the last 16 bytes of the buffer keep old values",
    "dtype": r"rank 1: receive #0 from rank 0 got 16 bytes of float32 into a buffer of 16 bytes of int32 \(4,\)\.",
    "batched": r"rank 1: receive #0 from rank 0 got 12 bytes of float32 into a buffer of 20 bytes",
    "deferred": r"rank 1: receive #0 from rank 0 got 16 bytes of float32 into a buffer of 32 bytes of float32 \(8,\): "
                r"the last 16 bytes of the buffer keep old values",
    "deferred, last receive": r"rank 1: receive #0 from rank 0 got 16 bytes of float32 into a buffer of 32 bytes",
}


@pytest.mark.parametrize("case", list(SIZE_MISMATCHES))
def test_size_check_catches_a_message_that_does_not_fit_its_buffer(case, monkeypatch):
    monkeypatch.delenv(p2p.SIZE_CHECK_ENV, raising=False)  # on by default
    with pytest.raises(Exception, match=SIZE_MISMATCHES[case]) as info:
        run_distributed(_worker_size_mismatch, 2, case, backend="gloo", timeout_s=30)
    assert "P2PSizeError" in str(info.value) and "DISTLAB_P2P_SIZE_CHECK=0 turns" in str(info.value), str(info.value)


def test_size_check_is_off_only_when_asked(monkeypatch):
    """DISTLAB_P2P_SIZE_CHECK=0: no check, and the short message goes through as gloo lets it (what the check is for)."""
    monkeypatch.setenv(p2p.SIZE_CHECK_ENV, "0")
    (on0, _), (on1, received) = run_distributed(_worker_size_mismatch, 2, "short", backend="gloo", timeout_s=30)
    assert not on0 and not on1, "DISTLAB_P2P_SIZE_CHECK=0 must turn the check off"
    assert received == [1.0] * 4 + [-1.0] * 4, f"gloo should accept the short message silently: {received}"


def _worker_short_message_as_a_learner_writes_it(rank, world_size):
    p2p.disable_strict()  # as outside pytest; the launcher alone must have turned the size check on
    stale = torch.full((8,), -1.0)
    dist.send(torch.ones(4), dst=1) if rank == 0 else dist.recv(stale, src=0)
    return stale.tolist()


def test_the_launcher_turns_the_size_check_on_in_every_rank(monkeypatch):
    """run_distributed (tests, demos) checks sizes without the worker asking: the probe's short message raises."""
    monkeypatch.delenv(p2p.SIZE_CHECK_ENV, raising=False)
    with pytest.raises(Exception, match=SIZE_MISMATCHES["short"]):
        run_distributed(_worker_short_message_as_a_learner_writes_it, 2, backend="gloo", timeout_s=30)


_SHORT_MESSAGE_SCRIPT = """
import torch, torch.distributed as dist
from distlab.launch import init_from_env
env = init_from_env()
stale = torch.full((8,), -1.0)
dist.send(torch.ones(4), dst=1) if env.rank == 0 else dist.recv(stale, src=0)
print(f"rank {env.rank} kept {stale.tolist()}", flush=True)
"""


def test_init_from_env_turns_the_size_check_on_under_torchrun(tmp_path):
    """The probe as a torchrun script, strict mode off (outside pytest): the job fails naming the short message."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    script = tmp_path / "short.py"
    script.write_text(_SHORT_MESSAGE_SCRIPT)
    env = {**os.environ, "DISTLAB_STRICT_P2P": "0", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop(p2p.SIZE_CHECK_ENV, None)
    out = subprocess.run([sys.executable, "-m", "distlab.launch", "--standalone", "--nnodes=1", "--nproc_per_node=2",
                          str(script)], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "kept [1.0, 1.0, 1.0, 1.0, -1.0" not in text, text[-3000:]
    assert "got 16 bytes of float32 into a buffer of 32 bytes" in text, text[-3000:]


def _worker_size_and_strict(rank, world_size):
    from distlab import intercept

    states = []
    def state():
        return (p2p.size_check_enabled(), p2p.strict_enabled(), intercept.pg_roles("send"))
    p2p.enable_strict()
    assert p2p.enable_size_check() and p2p.enable_size_check()  # idempotent
    states.append(state())  # strict mode checks sizes itself: no headers
    p2p.disable_strict()
    states.append(state())  # the size check takes over
    p2p.enable_strict()
    states.append(state())
    p2p.disable_size_check()
    states.append(state())
    return states


def test_size_check_gives_way_to_strict_mode_and_comes_back_after_it():
    assert run_distributed(_worker_size_and_strict, 1, backend="gloo") == [[
        (True, True, ("p2p_strict",)), (True, False, ("p2p_sizes",)), (True, True, ("p2p_strict",)),
        (False, True, ("p2p_strict",))]]


# --------------------------------------------------------------------------- the hazards
def _worker_hazard(rank, world_size, hazard):
    p2p.enable_strict()
    peer = 1 - rank
    if hazard == "tags":  # (a)+(b): the receiver relies on tags to take the messages out of order
        first, second = torch.empty(4), torch.empty(4)
        if rank == 0:
            dist.send(torch.ones(4), dst=1, tag=1)
            dist.send(torch.zeros(4), dst=1, tag=2)
        else:
            dist.recv(second, src=0, tag=2)
            dist.recv(first, src=0, tag=1)
    elif hazard == "dtype":  # (b): the k-th receive does not fit the k-th send
        if rank == 0:
            p2p.send(torch.ones(4), 1)
        else:
            p2p.recv(torch.empty(4, dtype=torch.int32), 0)
    elif hazard == "blocking":  # (c): each sends first, then receives; gloo buffers, NCCL would hang
        dist.send(torch.ones(3), dst=peer)
        dist.recv(torch.empty(3), src=peer)
    elif hazard == "1f1b":  # (c): the old pipeline's steady state at p=2, ungrouped isends
        works = []
        if rank == 0:
            works.append(dist.isend(torch.ones(3), dst=1))  # activation 0
            works.append(dist.isend(torch.ones(3), dst=1))  # activation 1
            dist.recv(torch.empty(3), src=1)  # gradient 0
        else:
            dist.recv(torch.empty(3), src=0)  # activation 0
            works.append(dist.isend(torch.ones(3), dst=0))  # gradient 0
            dist.recv(torch.empty(3), src=0)  # activation 1
        for w in works:
            w.wait()
    elif hazard == "any_source":
        if rank == 0:
            dist.send(torch.ones(2), dst=1)
        else:
            dist.recv(torch.empty(2))
    elif hazard == "cpu_on_nccl":  # (d): the group's backend would be NCCL for this CPU tensor
        with p2p.simulate_backend("cpu:gloo,cuda:nccl"):  # a CPU-side gloo backend: allowed
            p2p.exchange(torch.ones(2), torch.empty(2), peer)
        with p2p.simulate_backend("nccl"):
            p2p.exchange(torch.ones(2), torch.empty(2), peer)
    return True


HAZARDS = {
    "tags": "the tags differ: NCCL ignores tags",
    "dtype": "expects 16 bytes of int32 .* is 16 bytes of float32",
    "blocking": "ungrouped opposite sends",
    "1f1b": "ungrouped opposite sends",
    "any_source": "NCCL has none",
    "cpu_on_nccl": "cpu tensor .* backend for cpu tensors is nccl",
}


@pytest.mark.parametrize("hazard", list(HAZARDS))
def test_strict_mode_catches_nccl_hazard_that_gloo_runs(hazard):
    with pytest.raises(Exception, match=HAZARDS[hazard]) as info:
        run_distributed(_worker_hazard, 2, hazard, backend="gloo", timeout_s=30)
    assert "StrictP2PError" in str(info.value), str(info.value)


# --------------------------------------------------------------------------- no tags, no any-source (static)
_P2P_CALLS = {"send", "recv", "isend", "irecv", "P2POp"}
_TAG_POSITION = {"send": 3, "recv": 3, "isend": 3, "irecv": 3, "P2POp": 4}  # dist.send(tensor, dst, group, tag)
_SOURCE_KEYWORDS = {"src", "group_src", "frm", "peer", "group_peer"}


def _p2p_violations(path) -> tuple[list[str], int]:
    """``tag`` arguments and receives that name no source in one file; and how many p2p calls it has."""
    import ast

    problems, calls = [], 0
    text = path.read_text()
    if not any(name in text for name in ("send", "recv", "P2POp")):
        return problems, calls  # parsing is the cost: skip files that cannot hold a p2p call
    for node in ast.walk(ast.parse(text, str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name not in _P2P_CALLS or not (node.args or node.keywords):  # conn.recv(): a pipe, not a tensor
            continue
        calls += 1
        where = f"{path}:{node.lineno}: {ast.unparse(node)[:90]}"
        keywords = {k.arg for k in node.keywords}
        if "tag" in keywords or len(node.args) > _TAG_POSITION[name]:
            problems.append(f"{where}: a tag (NCCL has none: messages match by order)")
        receives = name in ("recv", "irecv") or (
            name == "P2POp" and node.args and isinstance(node.args[0], (ast.Attribute, ast.Name))
            and (getattr(node.args[0], "attr", None) or getattr(node.args[0], "id", None)) == "irecv")
        source_at = 2 if name == "P2POp" else 1  # P2POp(op, tensor, peer, ...); recv(tensor, src, ...)
        if receives and len(node.args) <= source_at and not keywords & _SOURCE_KEYWORDS:
            problems.append(f"{where}: a receive from any source (NCCL has none: name the sender)")
    return problems, calls


def test_no_tags_and_no_any_source_receives_in_lesson_code():
    """Every p2p call in solutions/, the templates and distlab/ names its peer and carries no tag."""
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = sorted([*repo.glob("solutions/**/*.py"), *repo.glob("phase*/template_*.py"), *repo.glob("distlab/**/*.py")])
    problems, calls = [], 0
    for path in files:
        found, n = _p2p_violations(path)
        problems += found
        calls += n
    # The walk must see the code it guards (the course sends with p2p.send/recv/batch and P2POp).
    assert calls >= 20, f"only {calls} p2p calls found in {len(files)} files: is the walk looking in the right place?"
    assert not problems, "NCCL-unsafe point-to-point calls:\n" + "\n".join(problems)
