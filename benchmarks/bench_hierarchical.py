"""Hierarchical all-reduce (exercise 3.6) against the flat ring, across a slow link between containers as nodes.

Two containers on a bridge network of their own are the nodes; each runs 2 ranks (torchrun,
static rendezvous), so ranks of one node talk through that node's own address (the kernel
routes it over loopback) and ranks of different nodes over the bridge. Every node's ``eth0``
egress is limited by a ``tc`` token-bucket filter (``tbf``: ``netem`` is not available here)
to RATE_MBIT, so the link between nodes is ~100x slower than the one inside a node, as on a
cluster of GPU machines joined by Ethernet.

Contenders, rotated per repeat and checked bitwise equal (integer-valued float32 inputs: every
order of summation is exact), on the same tensor, in the same launches:

* ``flat ring (3.3)``: ``solutions.phase3_multi_node.ring_allreduce.ring_allreduce`` over all 4 ranks;
* ``dist.all_reduce (gloo)``: gloo's own all-reduce over all 4 ranks, also flat;
* ``hierarchical (3.6)``: ``allreduce_algorithms.hierarchical_allreduce``: reduce to each node's
  leader, all-reduce among the 2 leaders, broadcast inside the node.

The alpha-beta model (allreduce_algorithms' docstring) with both links measured in the same launch
(alpha: half a round trip of 4 bytes; beta: a one-way transfer of PROBE_BYTES between nodes,
INTRA_PROBE_BYTES inside one, answered by 4 bytes):

  flat ring      2(W-1) (alpha_inter + n/W beta_inter)   every step waits for its node-crossing hop
  hierarchical   2 log2(G) alpha_intra + 2 n beta_intra + 2(M-1) (alpha_inter + n/M beta_inter)

so for W=4 ranks on M=2 nodes the ratio flat / hierarchical tends to 2(W-1)/W / (2(M-1)/M) = 1.5 as the
intra-node link gets free: the ring sends 1.5 n across each node boundary, the leaders n.

What the model leaves out, measured in every launch (``_ready_notice_delay``): gloo sends a message
only once the receiver's ready-to-receive notice has arrived, and in the flat ring the notice for a
node-crossing hop leaves through the other node's tbf queue, behind the opposite crossing hop's
data. Here a 0.25 MiB hop took 44 ms alone and 64 ms with its receive posted behind that data, so
on 1 MiB the ring loses ~20% more to hierarchical than the model says; on 4 MiB the wait is small
next to each step.

    python -m benchmarks.bench_hierarchical            # as root, where a Docker engine answers or can start
    python -m benchmarks.bench_hierarchical --rebuild  # rewrite the rows from the launches the JSON keeps

(3 to 6 minutes on 2 shared cores.)

writes benchmarks/results/hierarchical.json. Every container and the network end with the run.
Where no engine can start, ``run`` says why and returns the last written results (marked "not_rerun").
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import RESULTS, machine_info, write_result
from benchmarks.harness import Contender, format_row, load_of, measure, ratio_row, spread, stat_row

MiB = 1 << 20
NODES, RANKS_PER_NODE = 2, 2
RATE_MBIT = 40  # between nodes; a 4 MiB ring all-reduce then takes ~1.3 s, loopback ~100x less
SIZES, QUICK_SIZES = [1 * MiB, 4 * MiB], [1 * MiB]
PROBE_BYTES = 2 * MiB  # ~0.4 s across nodes at 40 Mbit/s: the per-message alpha is < 1% of it
INTRA_PROBE_BYTES = 32 * MiB  # ~10 ms over loopback: 2 MiB took about one round trip there, too noisy
FLAT_RING, FLAT_GLOO, HIER = "flat ring (3.3)", "dist.all_reduce (gloo)", "hierarchical (3.6)"
MARK = "HIERARCHICAL-RESULT "  # the line rank 0 prints its measurements on
# The rendezvous port inside node0's own network namespace (a bridge network made for this run):
# nothing else listens there, and the host's ports are never used.
MASTER_PORT = 29500


# --------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Links:
    """Per-message latency (s) and inverse bandwidth (s/byte) inside a node and between nodes."""

    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float


def predicted_times(nbytes: int, nodes: int, ranks_per_node: int, links: Links) -> dict[str, float]:
    """Seconds the alpha-beta model gives a flat ring and the hierarchical all-reduce of ``nbytes``.

    Ranks are placed in consecutive blocks per node, so the ring (0 -> 1 -> ... -> W-1 -> 0)
    crosses each node boundary once: in each of its 2(W-1) steps every rank sends n/W bytes at
    once, and the step ends when the node-crossing hop has delivered (the slow one).
    """
    world_size, g, m = nodes * ranks_per_node, ranks_per_node, nodes
    ring = 2 * (world_size - 1) * (links.alpha_inter + nbytes / world_size * links.beta_inter)
    intra = 2 * math.ceil(math.log2(g)) * links.alpha_intra + 2 * nbytes * links.beta_intra if g > 1 else 0.0
    inter = 2 * (m - 1) * (links.alpha_inter + nbytes / m * links.beta_inter)
    return {"ring": ring, "hierarchical": intra + inter}


# --------------------------------------------------------------------------- inside the ranks (torchrun)
def _time_round_trip(src: int, dst: int, payload: torch.Tensor, rounds: int) -> list[float]:
    """Seconds for ``payload`` to go src -> dst and 4 bytes to come back, on src's clock (no skew)."""
    from distlab import p2p

    rank, ack, times = dist.get_rank(), torch.zeros(1), []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        if rank == src:
            p2p.send(payload, dst)
            p2p.recv(ack, dst)
        elif rank == dst:
            p2p.recv(payload, src)
            p2p.send(ack, src)
        times.append(time.perf_counter() - start)
    shared = torch.tensor(times, dtype=torch.float64)
    dist.broadcast(shared, src)  # every rank keeps src's times
    return shared.tolist()


def _measure_link(src: int, dst: int, probe_bytes: int, rounds: int = 5) -> dict:
    """alpha = half a 4-byte round trip; beta = (big one-way + 4-byte answer - that round trip) / bytes."""
    small = _time_round_trip(src, dst, torch.zeros(1), rounds + 1)[1:]  # the first opens the connection
    big = _time_round_trip(src, dst, torch.zeros(probe_bytes // 4), rounds)
    rtt = statistics.median(small)
    return {"alpha": rtt / 2, "beta": max(statistics.median(big) - rtt, 1e-12) / probe_bytes,
            "bandwidth_Bps": [probe_bytes / max(t - rtt, 1e-12) for t in big], "src": src, "dst": dst}


def _equal(got: torch.Tensor, want: torch.Tensor) -> None:
    # Integer-valued float32 inputs: every partial sum is exact in any order, so all contenders agree bitwise.
    if not torch.equal(got, want):
        diff = (got - want).abs()
        raise AssertionError(f"max abs diff {diff.max().item():.3g} at element {int(diff.argmax())}")


def _time_pattern(pattern, rounds: int = 5) -> list[float]:
    """Seconds per round of ``pattern()`` (every rank calls it), slowest rank, starts aligned by a barrier."""
    times = []
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        pattern()
        times.append(time.perf_counter() - start)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _ready_notice_delay(nbytes: int, ranks_per_node: int, offset_s: float = 0.02) -> dict[str, list[float]]:
    """What a node-crossing hop of the flat ring costs when the opposite direction is busy.

    gloo sends a message only once the receiver's "ready to receive" notice has arrived (its TCP
    pair: a send waits for the peer's NOTIFY_RECV_READY). In the ring that notice, from the first
    rank of node 1 to the last of node 0, leaves through node 1's tbf queue, where the last rank's
    data for rank 0 may already wait. Three timings of the hop (n/W bytes, on its receiver, from the
    moment both ends post it, ``offset_s`` after a barrier):

    * ``crossing hop alone``: nothing else moving (what the model charges per step);
    * ``receive posted behind queued data``: the last rank sends to rank 0 from the barrier on,
      so the notice waits behind that data;
    * ``receive posted before``: the same, but the receive is posted at the barrier, before the
      queue fills.
    The offset is the experiment's variable (the skew that ranks of a running ring drift into), not a wait
    for an event.
    """
    from distlab import p2p

    rank, world_size, g = dist.get_rank(), dist.get_world_size(), ranks_per_node
    chunk, incoming = torch.ones(nbytes // 4 // world_size), torch.empty(nbytes // 4 // world_size)
    src, dst, other = g - 1, g, world_size - 1

    def trial(kind: str) -> float:
        dist.barrier()
        start, took = time.perf_counter(), 0.0
        if kind != "crossing hop alone" and rank in (other, 0):
            (p2p.send(chunk, 0) if rank == other else p2p.recv(incoming, other))
        if rank == src:
            time.sleep(offset_s)
            p2p.send(chunk, dst)
        elif rank == dst:
            if kind != "receive posted before":
                time.sleep(offset_s)
            p2p.recv(incoming, src)
            took = time.perf_counter() - start - offset_s
        shared = torch.tensor([took], dtype=torch.float64)
        dist.broadcast(shared, dst)
        return shared.item()

    kinds = ["crossing hop alone", "receive posted behind queued data", "receive posted before"]
    return {kind: [trial(kind) for _ in range(5)] for kind in kinds}


def _worker_race(rank: int, world_size: int, ranks_per_node: int, sizes: list[int], probe_bytes: int,
                 intra_probe_bytes: int, repeats: int) -> dict:
    """Measure both links, then race the three all-reduces on each size (every rank; ranks in node blocks)."""
    from solutions.phase3_multi_node import allreduce_algorithms as algos
    from solutions.phase3_multi_node import ring_allreduce as ring

    torch.set_num_threads(1)  # the adds are tiny next to the link; leave the cores to gloo's I/O
    g = ranks_per_node
    groups = algos.make_node_groups(g)
    links = {"intra": _measure_link(0, 1, intra_probe_bytes), "inter": _measure_link(g - 1, g, probe_bytes)}
    out = {"links": links, "by_size": {}, "ready_notice": {}}
    fns = {FLAT_GLOO: dist.all_reduce, FLAT_RING: ring.ring_allreduce,
           HIER: lambda t: algos.hierarchical_allreduce(t, groups)}
    for nbytes in sizes:
        x = torch.randint(-64, 64, (nbytes // 4,), generator=torch.Generator().manual_seed(rank)).float()
        contenders = []
        for name, fn in fns.items():
            buf = torch.empty_like(x)  # each its own, refilled from x before every timed call
            contenders.append(Contender(name, run=lambda fn=fn, buf=buf: (fn(buf), buf)[1],
                                        prepare=lambda buf=buf: buf.copy_(x)))
        out["by_size"][str(nbytes)] = measure(contenders, FLAT_GLOO, repeats=repeats, warmup=1, check=_equal)
        out["ready_notice"][str(nbytes)] = _ready_notice_delay(nbytes, g)
    return out


def worker(sizes: list[int], probe_bytes: int, repeats: int) -> dict | None:
    """One rank of the job under torchrun: check that ranks sit in node blocks, then ``_worker_race``."""
    from distlab.launch import init_from_env, shutdown

    env = init_from_env(backend="gloo")
    try:
        g = int(os.environ["LOCAL_WORLD_SIZE"])
        hosts: list = [None] * env.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        blocks = [hosts[i:i + g] for i in range(0, env.world_size, g)]
        if any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
            raise RuntimeError(f"ranks are not placed in consecutive blocks of {g} per node: {hosts}")
        out = _worker_race(env.rank, env.world_size, g, sizes, probe_bytes, INTRA_PROBE_BYTES, repeats)
        return {"hosts": hosts, **out} if env.rank == 0 else None
    finally:
        shutdown()


# --------------------------------------------------------------------------- around the containers
class ShapedNodes:
    """``nodes`` containers on a bridge network of their own, each one's eth0 egress limited by tbf.

    Containers mount this machine's Python environment and the repository read-only at the same
    paths (distlab/compose.py's offline way), and get NET_ADMIN so ``tc`` works inside them.
    ``close`` removes the containers and the network; use it in ``finally``.
    """

    def __init__(self, image: str, nodes: int, rate_mbit: float, sysctls: tuple[str, ...] = ()) -> None:
        from distlab.compose import REPO, docker, python_mounts

        self.docker, self.rate_mbit = docker, rate_mbit
        self.prefix = f"distlab-hier-{os.urandom(4).hex()}"
        self.network, self.names = None, []
        try:
            self._start(image, nodes, sysctls, REPO, python_mounts())
        except BaseException:
            self.close()  # whatever was made before the failure
            raise

    def _start(self, image: str, nodes: int, sysctls: tuple[str, ...], repo: Path, mounted: list[str]) -> None:
        self.network = self.prefix
        self.docker("network", "create", self.network, timeout=60)
        mounts = [a for d in [*mounted, str(repo)] for a in ("-v", f"{d}:{d}:ro")]
        env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/sbin:/usr/bin:/sbin:/bin",
               "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
               "GLOO_SOCKET_IFNAME": "eth0",  # every rank's address is its node's eth0; same-node peers go via lo
               # The course's p2p size check sends a header message per transfer; the model counts one message.
               "DISTLAB_P2P_SIZE_CHECK": "0"}
        for i in range(nodes):
            name = f"{self.prefix}-node{i}"
            self.names.append(name)  # before the run: a run that fails half-way may still leave a container
            self.docker("run", "-d", "--rm", "--init", "--name", name, "--hostname", name, "--network", self.network,
                        "--cap-add", "NET_ADMIN", *[a for x in sysctls for a in ("--sysctl", x)], *mounts,
                        "-w", str(repo), *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
                        image, "tail", "-f", "/dev/null", timeout=120)
        for name in self.names:
            self._shape(name)

    def _shape(self, name: str) -> None:
        # burst 64 KB: one 64 KB TSO segment fits (a smaller bucket would drop it), ~13 ms at 40 Mbit/s;
        # latency 400 ms: the queue holds a ring step's burst instead of dropping it (TCP then stalls).
        tc = ["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", f"{self.rate_mbit}mbit",
              "burst", "64kb", "latency", "400ms"]
        self.docker("exec", name, *tc, timeout=30)
        shown = self.docker("exec", name, "tc", "qdisc", "show", "dev", "eth0", timeout=30).stdout
        if "tbf" not in shown:
            raise RuntimeError(f"{name}: tc shows no tbf on eth0 after adding it:\n{shown}")

    def launch(self, args: list[str], timeout_s: float) -> dict:
        """One torchrun job over all nodes (fresh processes); rank 0's result and the load around it."""
        before = os.getloadavg()
        procs = []
        try:
            for i, name in enumerate(self.names):
                argv = ["docker", "exec", name, sys.executable, "-m", "torch.distributed.run",
                        f"--nnodes={len(self.names)}", f"--nproc_per_node={RANKS_PER_NODE}", f"--node_rank={i}",
                        f"--master_addr={self.names[0]}", f"--master_port={MASTER_PORT}",
                        "-m", "benchmarks.bench_hierarchical", "--worker", *args]
                procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            deadline = time.monotonic() + timeout_s
            outs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
        finally:
            for p in procs:  # only after a timeout or an error; the containers' rm -f ends what runs inside
                if p.poll() is None:
                    p.kill()
                    p.wait()
        failed = [(n, p.returncode, o) for n, p, o in zip(self.names, procs, outs) if p.returncode != 0]
        if failed:
            name, code, out = failed[0]
            raise RuntimeError(f"{name}'s torchrun exited {code}:\n{out[-3000:]}")
        lines = [line for line in outs[0].splitlines() if line.startswith(MARK)]
        if not lines:
            raise RuntimeError(f"rank 0 printed no result line:\n{outs[0][-3000:]}")
        return {"result": json.loads(lines[-1][len(MARK):]), "loadavg_before": before,
                "loadavg_after": os.getloadavg()}

    def close(self) -> None:
        """Remove the containers and the network; RuntimeError naming any that remain."""
        for name in self.names:
            self.docker("rm", "-f", name, timeout=60, check=False)
        if self.network:
            self.docker("network", "rm", self.network, timeout=60, check=False)
        left = (self.docker("ps", "-aq", "--filter", f"name={self.prefix}", timeout=60).stdout.split()
                + self.docker("network", "ls", "-q", "--filter", f"name={self.prefix}", timeout=60).stdout.split())
        if left:
            raise RuntimeError(f"{self.prefix}: these containers/networks outlived the run: {left}; docker rm -f them")


# --------------------------------------------------------------------------- rows
def _links_of(run: dict) -> Links:
    links = run["result"]["links"]
    return Links(links["intra"]["alpha"], links["intra"]["beta"], links["inter"]["alpha"], links["inter"]["beta"])


def rows(runs: list[dict], sizes: list[int], rate_mbit: float) -> dict[str, dict]:
    """The comparisons: each flat all-reduce / hierarchical with the model's prediction, and the link check."""
    world_size = NODES * RANKS_PER_NODE
    where = f"{NODES} nodes x {RANKS_PER_NODE} ranks, {rate_mbit:g} Mbit/s between nodes"
    out = {}
    bandwidths = [[bw * 8 / 1e6 / rate_mbit for bw in r["result"]["links"]["inter"]["bandwidth_Bps"]] for r in runs]
    out["inter-node bandwidth / tbf rate"] = stat_row(
        bandwidths, metric="bandwidth", world_size=2, size=f"{PROBE_BYTES / MiB:g} MiB one way, {where}",
        load=load_of(runs),
        meaning=f"measured one-way TCP payload rate between nodes / the {rate_mbit:g} Mbit/s set with tc tbf "
                "(about 0.95: Ethernet, IP and TCP headers count against the rate)")
    for nbytes in sizes:
        size = f"{nbytes / MiB:g} MiB, {where}"
        pick = lambda result, nbytes=nbytes: result["by_size"][str(nbytes)]  # noqa: E731
        predicted = []
        for r in runs:
            t = predicted_times(nbytes, NODES, RANKS_PER_NODE, _links_of(r))
            predicted.append(t["ring"] / t["hierarchical"])
        p = spread(predicted)
        model = (f"the alpha-beta model with the links measured in each launch predicts {p['median']:.2f} "
                 f"(launches {' '.join(f'{v:.2f}' for v in predicted)})")
        hop = {kind: statistics.median(v for r in runs for v in r["result"]["ready_notice"][str(nbytes)][kind])
               for kind in runs[0]["result"]["ready_notice"][str(nbytes)]}
        for flat, what in ((FLAT_RING, "the learner's ring (3.3)"), (FLAT_GLOO, "gloo's all_reduce")):
            row = ratio_row(runs, flat, HIER, world_size=world_size, size=size, key=pick,
                            meaning=f"time of the flat all-reduce ({what}) / hierarchical (3.6), same tensor, "
                                    f"same launch (above 1: hierarchical faster); {model}")
            row["predicted"] = p
            if flat == FLAT_RING:
                row["crossing_hop_s"] = hop
            out[f"{flat} / {HIER}, {nbytes / MiB:g} MiB"] = row
        # measured / predicted per repeat, with that launch's prediction: 1 = the model is exact
        per_launch = []
        for r, pred in zip(runs, predicted):
            times = pick(r["result"])["times"]
            per_launch.append([f / h / pred for f, h in zip(times[FLAT_RING], times[HIER])])
        # The model's ring step: one crossing hop of n/W (alpha + bytes x beta of the probes), per launch.
        model_step = statistics.median(_links_of(r).alpha_inter + nbytes / world_size * _links_of(r).beta_inter
                                       for r in runs)
        out[f"{FLAT_RING} / {HIER}, {nbytes / MiB:g} MiB: measured / model"] = stat_row(
            per_launch, metric="ratio", world_size=world_size, size=size, load=load_of(runs),
            model_ring_step_s=model_step,
            meaning="(flat ring / hierarchical, measured) / the alpha-beta model's ratio for the same launch's "
                    "links (1: the model is exact; above 1: hierarchical wins by more). What the model leaves out: "
                    "gloo sends only after the receiver's ready notice arrives, and in the ring the notice for a "
                    "node-crossing hop leaves through the other node's tbf queue, behind the opposite crossing "
                    f"hop's data: the hop ({nbytes / MiB / world_size:g} MiB) took "
                    f"{hop['crossing hop alone'] * 1e3:.0f} ms alone, "
                    f"{hop['receive posted behind queued data'] * 1e3:.0f} ms with its receive posted behind that "
                    f"data, {hop['receive posted before'] * 1e3:.0f} ms posted before it (model "
                    f"{model_step * 1e3:.0f} ms; alone it beats the model by tbf's 64 KB burst, sent at line rate); "
                    f"the ring has {2 * (world_size - 1)} such steps, the leaders' "
                    "all-reduce 2, and the model's alpha (a 4-byte round trip on an idle link) leaves the wait out")
    return out


def _check_shaping(runs: list[dict], rate_mbit: float) -> None:
    """Refuse timings taken over a link that is not the one set (tbf missing, or far below its rate)."""
    for r in runs:
        mbit = statistics.median(r["result"]["links"]["inter"]["bandwidth_Bps"]) * 8 / 1e6
        intra = 1 / r["result"]["links"]["intra"]["beta"] * 8 / 1e6
        if not 0.7 * rate_mbit <= mbit <= 1.05 * rate_mbit:
            raise RuntimeError(f"the inter-node link carried {mbit:.1f} Mbit/s, not about the {rate_mbit:g} set "
                               "with tc tbf: check the qdisc on each node's eth0 (tc qdisc show dev eth0)")
        if intra < 10 * rate_mbit:
            raise RuntimeError(f"the intra-node link carried only {intra:.0f} Mbit/s, under 10x the inter-node "
                               f"{rate_mbit:g}: same-node ranks must not go through the shaped eth0")


# --------------------------------------------------------------------------- run
def run(quick: bool = False, out_dir: Path | None = None, launches: int = 3, rate_mbit: float = RATE_MBIT,
        sysctls: tuple[str, ...] = ()) -> dict:
    from distlab.compose import EngineUnavailable, base_image, start_engine

    sizes, repeats = (QUICK_SIZES, 3) if quick else (SIZES, 5)
    work = Path(tempfile.mkdtemp(prefix="distlab-hier-"))
    engine, nodes = None, None
    try:
        try:
            engine = start_engine(work)
            image = base_image(work)
        except EngineUnavailable as exc:
            return _not_rerun(str(exc))
        started = time.monotonic()
        nodes = ShapedNodes(image, NODES, rate_mbit, sysctls)
        args = ["--sizes", *map(str, sizes), "--probe-bytes", str(PROBE_BYTES), "--repeats", str(repeats)]
        runs = []
        for i in range(launches):
            runs.append(nodes.launch(args, timeout_s=600))
            print(f"   launch {i + 1}/{launches}: {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if nodes is not None:
            nodes.close()
        if engine is not None:
            engine.stop()
        shutil.rmtree(work, ignore_errors=True)
    _check_shaping(runs, rate_mbit)
    return {"name": "hierarchical", "machine": machine_info(), "launches": launches, "repeats": repeats,
            "sizes": sizes, "rate_mbit": rate_mbit, "sysctls": list(sysctls), "nodes": NODES,
            "ranks_per_node": RANKS_PER_NODE, "comparisons": rows(runs, sizes, rate_mbit),
            "note": "containers as nodes on a bridge network, each node's eth0 egress limited by tc tbf; ranks "
                    "of a node talk over its loopback. Contenders rotated per repeat, results bitwise equal, "
                    "a repeat's time is the slowest rank's; links measured in every launch",
            "seconds": time.monotonic() - started,
            "runs": runs}  # every launch's measurements: the rows can be rebuilt from them


def _not_rerun(why: str) -> dict:
    """The last written results, marked, where no Docker engine can run the benchmark here."""
    path = RESULTS / "hierarchical.json"
    print(f"   bench_hierarchical needs a Docker engine and root: {why}", flush=True)
    if not path.exists():
        raise RuntimeError(f"no Docker engine here ({why}) and no earlier {path} to keep: run it as root "
                           "where dockerd runs or can start")
    result = json.loads(path.read_text())
    result["not_rerun"] = why
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 MiB only, 3 repeats, 3 launches")
    parser.add_argument("--launches", type=int, default=3, help="fresh torchrun jobs (>= 3 for a spread)")
    parser.add_argument("--rate-mbit", type=float, default=RATE_MBIT, help="tbf rate between nodes")
    parser.add_argument("--sysctl", action="append", default=[],
                        help="a node's network sysctl for a diagnosis (e.g. net.ipv4.tcp_slow_start_after_idle=0)")
    parser.add_argument("--out", default="hierarchical", help="results name: benchmarks/results/<out>.json")
    parser.add_argument("--rebuild", action="store_true",
                        help="rebuild the rows of benchmarks/results/<out>.json from the launches it keeps (no run)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank, under torchrun
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES, help=argparse.SUPPRESS)
    parser.add_argument("--probe-bytes", type=int, default=PROBE_BYTES, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=5, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        result = worker(args.sizes, args.probe_bytes, args.repeats)
        if result is not None:
            print(MARK + json.dumps(result), flush=True)
        return
    if args.rebuild:  # the same rows from the same measurements (after a change to how rows are written)
        result = json.loads((RESULTS / f"{args.out}.json").read_text())
        _check_shaping(result["runs"], result["rate_mbit"])
        result["comparisons"] = rows(result["runs"], result["sizes"], result["rate_mbit"])
    else:
        result = run(quick=args.quick, launches=args.launches, rate_mbit=args.rate_mbit, sysctls=tuple(args.sysctl))
    if "not_rerun" in result:
        raise SystemExit(f"not run: {result['not_rerun']}")
    path = write_result(args.out, result)
    for name, row in result["comparisons"].items():
        print(f"   {name:<60} {format_row(row)}\n      {row['meaning']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
