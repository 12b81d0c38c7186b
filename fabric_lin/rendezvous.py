"""How long the processes of a run on several nodes wait for each other at the start, and what they say meanwhile.

Started on each node by hand (Fabric's own launch: NODE_RANK, MASTER_ADDR and MASTER_PORT on each), by SLURM, LSF or
MPI, the processes meet at the store that rank 0 opens at MASTER_ADDR:MASTER_PORT (torch.distributed's TCPStore), and
torch.distributed waits there without a word: rank 0 for the others until parallelism.timeout_minutes (30), then a
traceback ("Timed out ... waiting for clients. 1/2 clients joined."); a process that finds nothing at that address
tries again past the same bound. A process never started, a mistyped port or a firewall thus cost half an hour of
silence on every node. Here instead each process bounds its wait by parallelism.join_timeout_minutes, rank 0 says
after a few seconds for how many processes it waits, and at the bound each node's first process says in one line how
many joined and what to check, and ends with JOIN_FAILED_EXIT_CODE, leaving no empty out_dir behind.

The store counts the processes that join it, but under a key that its Python interface cannot read (TCPStore prefixes
every key it is given), so each process counts itself in again, under its node's key of our own, as soon as the store
answers: from a thread, since the main thread waits inside torch.distributed, where neither an exception nor a signal
reaches it. Under torchrun the processes meet at the store of torchrun's agents, which have met before they started
them (torchrun bounds that itself); a run on one node is Fabric's launcher's to watch (`launching_rank_watched`)."""
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator, List, Optional

import torch

from fabric_lin.args import ParallelismArgs
from fabric_lin.errors import JOIN_FAILED_EXIT_CODE, process_rank
from fabric_lin.files import remove_empty_dirs
from fabric_lin.parallelism import LAUNCHING_RANK_PID

# In the run's store: where each process counts itself in (one counter per node), and where those that bound their
# wait count themselves too; where rank 0 leaves the line it stops with, and where the others say they have read it
JOINED_KEY = "fabric_lin/joined/node-{}"
BOUNDED_KEY = "fabric_lin/joined/bounded"
STOPPED_KEY = "fabric_lin/rank-0-stopped-waiting"
STOP_SEEN_KEY = "fabric_lin/rank-0-stopped-waiting/seen"
# How long rank 0 keeps its store open for the others to read why it stops: they poll it twice a second
STOP_GRACE_SECONDS = 3.0
# How long rank 0 waits before it says for whom it waits: longer than a node's processes take to start together
NOTICE_SECONDS = 10.0


@dataclass(frozen=True)
class Rendezvous:
    """Where this process meets the others (rank 0's store), and who it is among them."""

    address: str
    port: int
    nodes: int
    devices: int  # processes per node
    node: int
    local_rank: int

    @property
    def where(self) -> str:
        return f"{self.address}:{self.port}"

    @property
    def processes(self) -> int:
        return self.nodes * self.devices

    @property
    def is_rank_0(self) -> bool:  # in every environment Fabric knows, rank 0 is node 0's first process
        return self.node == 0 and self.local_rank == 0


def rendezvous_of(fabric, num_nodes: int, devices: int) -> Optional[Rendezvous]:
    """The rendezvous to watch before `fabric.launch()`: None on one node and under torchrun."""
    from lightning_fabric.plugins.environments import TorchElasticEnvironment

    environment = getattr(fabric.strategy, "cluster_environment", None)
    if num_nodes == 1 or environment is None or isinstance(environment, TorchElasticEnvironment):
        return None
    # read once here: Fabric's own environment picks a free port where MASTER_PORT is unset, and keeps it
    return Rendezvous(environment.main_address, environment.main_port, num_nodes, devices, fabric.node_rank,
                      fabric.local_rank)


def counted_in(rendezvous: Rendezvous, bounded: bool):
    """A client of the run's store, through which this process has counted itself in, or None while nothing answers
    at its address. A plain connection is tried first: a TCPStore client that finds nothing there warns and retries
    for as long as its timeout."""
    from torch.distributed import TCPStore

    try:
        socket.create_connection((rendezvous.address, rendezvous.port), timeout=2).close()
        store = TCPStore(rendezvous.address, rendezvous.port, is_master=False, timeout=timedelta(seconds=5),
                         wait_for_workers=False)
        store.add(JOINED_KEY.format(rendezvous.node), 1)
        if bounded and not rendezvous.is_rank_0:
            store.add(BOUNDED_KEY, 1)
        return store
    except Exception:  # noqa: BLE001 - no such address, nothing listening, or something there that is no store
        return None


def tell_the_others(store, line: str) -> None:
    """Rank 0, stopping: leave `line` in its store, and keep the store open until every process that waits with a
    bound has read it (or for STOP_GRACE_SECONDS): they stop with it, where its store closing under them would end
    them with torch.distributed's error."""
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    try:
        store.set(STOPPED_KEY, line)
        while store.add(STOP_SEEN_KEY, 0) < store.add(BOUNDED_KEY, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no store to leave it in: the others find it closed
        pass


def told_by_rank_0(store) -> Optional[str]:
    """The line rank 0 stopped with, once it has left one (`tell_the_others`), else None."""
    try:
        if not store.check([STOPPED_KEY]):
            return None
        line = store.get(STOPPED_KEY).decode("utf-8", "replace")
        store.add(STOP_SEEN_KEY, 1)
        return line
    except Exception:  # noqa: BLE001 - the store closed: the main thread's error says so
        return None


def joined_per_node(store, rendezvous: Rendezvous) -> Optional[List[int]]:
    """How many processes of each node have counted themselves in, or None where the store stopped answering."""
    try:
        return [int(store.add(JOINED_KEY.format(node), 0)) for node in range(rendezvous.nodes)]
    except Exception:  # noqa: BLE001 - rank 0, and its store, gone
        return None


def nodes_short_of(joined: List[int], devices: int) -> str:
    """The nodes some of whose processes have not joined: "node 1", "nodes 1 and 3", "nodes 1, 2, 3 and 9 more"."""
    short = [str(node) for node, count in enumerate(joined) if count < devices]
    if len(short) <= 1:
        return f"node {short[0]}" if short else "no node"
    if len(short) <= 4:
        return f"nodes {', '.join(short[:-1])} and {short[-1]}"
    return f"nodes {', '.join(short[:3])} and {len(short) - 3} more"


def duration(seconds: float) -> str:
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:g} min"


def waiting_line(rendezvous: Rendezvous, joined: Optional[List[int]], bound: float) -> str:
    """What rank 0 says once while it waits (and the first process of another node, while nothing answers there)."""
    if joined is None:
        return (f"waiting for rank 0's store at {rendezvous.where} (MASTER_ADDR:MASTER_PORT), which answers once node "
                f"0's command runs; this process stops after {duration(bound)} without it "
                f"(parallelism.join_timeout_minutes)")
    missing = rendezvous.processes - sum(joined)
    if missing <= 0:
        return (f"all {rendezvous.processes} processes joined at {rendezvous.where}; waiting for them to connect to "
                f"each other, at most {duration(bound)} (parallelism.join_timeout_minutes)")
    return (f"waiting for {missing} of {rendezvous.processes} processes to join at {rendezvous.where} (missing on "
            f"{nodes_short_of(joined, rendezvous.devices)}); the run stops after {duration(bound)} without them "
            f"(parallelism.join_timeout_minutes)")


def failure_line(rendezvous: Rendezvous, joined: Optional[List[int]], bound: float) -> str:
    """Why the run stops at the bound, and what to check."""
    within = f"within {duration(bound)} (parallelism.join_timeout_minutes"
    if joined is None:
        return (f"nothing answered at {rendezvous.where} (MASTER_ADDR:MASTER_PORT) {within}): check that node 0's "
                f"command runs with the same MASTER_ADDR and MASTER_PORT as this node's, and that no firewall closes "
                f"that port to this node; nothing was written")
    if sum(joined) < rendezvous.processes:
        return (f"{sum(joined)} of {rendezvous.processes} processes joined at {rendezvous.where} {within}; missing on "
                f"{nodes_short_of(joined, rendezvous.devices)}): check that the command was started on every node with "
                f"--num_nodes {rendezvous.nodes} --devices {rendezvous.devices} and the same MASTER_ADDR and "
                f"MASTER_PORT, and that no firewall closes port {rendezvous.port} to the other nodes; "
                f"nothing was written")
    return (f"all {rendezvous.processes} processes joined at {rendezvous.where} but did not connect to each other "
            f"{within}): check that no firewall closes the ports between the nodes that torch.distributed opens "
            f"besides MASTER_PORT, and GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME where a node has several networks; "
            f"nothing was written")


@contextmanager
def joining_watched(fabric, rendezvous: Optional[Rendezvous], parallelism: ParallelismArgs, created: List[Path],
                    prog: str = "fabric-lin pretrain", poll_seconds: float = 0.5) -> Iterator[None]:
    """Within: `fabric.launch()`, the rendezvous. This process counts itself in at the store as soon as it answers.
    Unless Fabric's launcher started it (the process that did, its node's first, ends it), it waits at most
    parallelism.join_timeout_minutes (and timeout_minutes) from here, and no longer than rank 0: then it ends the
    processes it started, removes the empty directories `created` (out_dir and its new parents) and ends with
    JOIN_FAILED_EXIT_CODE, and, as the first process of its node, says why in one line. Rank 0 says once, after a few
    seconds, for how many it waits."""
    if rendezvous is None:
        yield
        return
    launcher = os.environ.get(LAUNCHING_RANK_PID)
    bounded = not (rendezvous.local_rank != 0 and launcher == str(os.getppid()))
    speaks = bounded and rendezvous.local_rank == 0
    bound = 60 * min(parallelism.join_timeout_minutes, parallelism.timeout_minutes)
    notice = min(NOTICE_SECONDS, bound / 2)
    joined, ending = threading.Event(), threading.Lock()

    def counts(store) -> Optional[List[int]]:
        return None if store is None else joined_per_node(store, rendezvous)

    def say(line: str, error: bool = False) -> None:  # as the CLI reports: rank 0's plain, the others' naming the rank
        rank = process_rank()
        if error:
            line = f"error{'' if rank == 0 else f' on rank {rank}'}: {line}"
        elif rank != 0:
            line = f"{line} (rank {rank})"
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    def end(line: str, store=None) -> None:
        ending.acquire()  # once: the watch's bound and the main thread's error may come together; the second waits
        try:
            if rendezvous.is_rank_0 and store is not None:
                tell_the_others(store, line)
            for child in getattr(fabric.strategy.launcher, "procs", []):  # Fabric's launcher's, in the rendezvous
                child.kill()
                child.wait()
            if speaks:
                sys.stdout.flush()
                say(line, error=True)
            remove_empty_dirs(created)  # no process of the run is past the rendezvous: none writes there
        finally:  # whatever fails above: the main thread waits where nothing else would end it
            os._exit(JOIN_FAILED_EXIT_CODE)

    def watch() -> None:
        start, store, noticed = time.monotonic(), None, False
        while not joined.wait(poll_seconds):
            if store is None:
                store = counted_in(rendezvous, bounded)
            waited = time.monotonic() - start
            # the counts (a key per node) read when said only, not by every process twice a second
            if speaks and not noticed and waited >= notice and (rendezvous.is_rank_0 or store is None):
                noticed = True
                say(waiting_line(rendezvous, counts(store), bound))
            told = told_by_rank_0(store) if bounded and store is not None and not rendezvous.is_rank_0 else None
            if told is not None or (bounded and waited >= bound):
                if not joined.is_set():
                    end(told or failure_line(rendezvous, counts(store), bound), store)

    threading.Thread(target=watch, name="rendezvous-watch", daemon=True).start()
    try:
        yield
    except torch.distributed.DistNetworkError:
        # rank 0's store closed while this process waited in it: rank 0 ended, or stopped waiting before this process
        # read why
        if not rendezvous.is_rank_0 and not joined.is_set():
            end(f"rank 0's store at {rendezvous.where} closed before every process had joined: rank 0 stopped waiting "
                f"or ended (node 0's output says why); nothing was written")
        raise
    finally:
        joined.set()
