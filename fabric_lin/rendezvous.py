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
them (torchrun bounds that itself); a run on one node is Fabric's launcher's to watch (`launching_rank_watched`).

Rank 0 opens the store on node 0, on one node too, and there the address and the port can be wrong before anyone else
comes: a MASTER_PORT that another process (another run, or one left over from one) listens on (torch.distributed's
EADDRINUSE traceback), a MASTER_ADDR that does not resolve or does not reach node 0 itself (rank 0's own client of
its store then tries again, warning each second, for timeout_minutes). Each is said in one line, at once, naming the
address, the port and the fix. On the other nodes, the same port in use shows as something at MASTER_ADDR:MASTER_PORT
that accepts connections but does not answer as a store (torch.distributed's client then waits for an answer for
ever), which they tell apart from nothing answering there.

A process whose store closes under it before every process has joined lost rank 0, as a process that loses a peer
later does: it ends as one (PEER_LOST_EXIT_CODE, the one line of `PeerLost`). A process other than rank 0 that joined
and went away before the processes connected to each other leaves them waiting for it in torch.distributed (or fails
gloo's connection to it); so each process beats, in the store, from the moment it joins until it is past the join,
and rank 0 takes one whose heartbeat stands still for GONE_SECONDS for lost, and tells the others, who end as it does.
torch's C++ warnings (several lines and a C++ stack for each connection its store client fails to make or loses) are
held back meanwhile, unless FABRIC_LIN_DEBUG is set: the line said here is what a process ends with."""
import ctypes
import errno
import os
import re
import socket
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from fabric_lin.args import ParallelismArgs
from fabric_lin.errors import (JOIN_FAILED_EXIT_CODE, PEER_LOST_EXIT_CODE, InvalidValue, PeerLost, debug_enabled,
                               named_for_rank, process_rank)
from fabric_lin.files import remove_empty_dirs
from fabric_lin.parallelism import LAUNCHING_RANK_PID

# In the run's store: where each process counts itself in (one counter per node), and where those that bound their
# wait count themselves too; where rank 0 leaves the line it stops with, and where the others say they have read it
JOINED_KEY = "fabric_lin/joined/node-{}"
BOUNDED_KEY = "fabric_lin/joined/bounded"
STOPPED_KEY = "fabric_lin/rank-0-stopped-waiting"
STOP_SEEN_KEY = "fabric_lin/rank-0-stopped-waiting/seen"
# Where rank 0, stopping on a process gone after it joined, leaves what is lost (`PeerLost`'s cause), before the line
LOST_KEY = "fabric_lin/rank-0-stopped-waiting/lost"
# Where each process but rank 0 counts its heartbeats from the moment it joins (one each poll of its watch), and adds
# PAST_THE_JOIN once it is past the process group's join: rank 0, which may wait for others still, then no longer
# watches it
ALIVE_KEY = "fabric_lin/alive/rank-{}"
PAST_THE_JOIN = 1 << 40
# How long the heartbeat of a process that has joined may stand still before rank 0 takes it for gone (killed, out of
# memory, its node lost or stopped): it beats each poll of its watch (twice a second), and the margin is for a main
# thread that holds Python's lock a while as the process starts, or a node too busy to run the watch's thread
GONE_SECONDS = 30.0
# How long this module's own client of the store tries to connect, and waits for an answer from it
CLIENT_SECONDS = 5.0
# How long rank 0 keeps its store open for the others to read why it stops: they poll it twice a second
STOP_GRACE_SECONDS = 3.0
# How long rank 0 waits before it says for whom it waits: longer than a node's processes take to start together
NOTICE_SECONDS = 10.0
# How long rank 0 tries to reach its own store at MASTER_ADDR, once the store listens, before it stops: a connection to
# one's own host is made at once or never
OWN_STORE_SECONDS = 5.0
# c10's log level of ERROR: torch's C++ errors printed, its warnings not (TORCH_CPP_LOG_LEVEL=ERROR)
C10_ERROR_LEVEL = 2
# torch.distributed's errors, in the process group's join, of a connection to a peer that it could not make or lost
# (gloo connects every process to every other once all have joined; NCCL does later)
CONNECTION_FAILED = re.compile(r"connectFullMesh failed|Connection (refused|reset|closed)")
# getaddrinfo's answers that a name is unknown, not that the name service failed for now (EAI_AGAIN)
UNKNOWN_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


@dataclass(frozen=True)
class Rendezvous:
    """Where this process meets the others (rank 0's store), and who it is among them."""

    address: str
    port: int
    nodes: int
    devices: int  # processes per node
    node: int
    local_rank: int
    rank: int  # global

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
    """The rendezvous to watch before `fabric.launch()`: None for one process and under torchrun."""
    from lightning_fabric.plugins.environments import TorchElasticEnvironment

    environment = getattr(fabric.strategy, "cluster_environment", None)
    if num_nodes * devices == 1 or environment is None or isinstance(environment, TorchElasticEnvironment):
        return None
    # read once here: Fabric's own environment picks a free port where MASTER_PORT is unset, and keeps it
    return Rendezvous(environment.main_address, environment.main_port, num_nodes, devices, fabric.node_rank,
                      fabric.local_rank, fabric.global_rank)


def counted_in(rendezvous: Rendezvous, bounded: bool):
    """A client of the run's store, through which this process has counted itself in, or None where none could be
    made (something there that is no store, or that closed since). Its first heartbeat comes first: a process that
    counted itself in has one."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(rendezvous.address, rendezvous.port, is_master=False,
                         timeout=timedelta(seconds=CLIENT_SECONDS), wait_for_workers=False)
        if not rendezvous.is_rank_0:
            store.add(ALIVE_KEY.format(rendezvous.rank), 1)
        store.add(JOINED_KEY.format(rendezvous.node), 1)
        if bounded and not rendezvous.is_rank_0:
            store.add(BOUNDED_KEY, 1)
        return store
    except Exception:  # noqa: BLE001
        return None


class CountingIn:
    """Called, the client of `counted_in` once it is made, else None, each call going on with it: it is made in a
    thread of its own, one try at a time, since a TCPStore client that meets a port that accepts but does not answer
    (a stopped process's, or another program's) waits there for ever, whatever its timeout, and whoever calls this must
    keep to its bound. Each try connects plainly first: a TCPStore client that finds nothing there warns and retries
    for as long as its timeout. `accepting`: whether, at the latest try, something accepted the connection but has not
    answered as a store, which a process waiting for rank 0's store tells apart from nothing answering there."""

    def __init__(self, rendezvous: Rendezvous, bounded: bool):
        self.rendezvous, self.bounded = rendezvous, bounded
        self.made: List[object] = []
        self.trying: Optional[threading.Thread] = None
        self.accepting = False

    def attempt(self) -> None:
        if not answers(self.rendezvous.address, self.rendezvous.port, 2):
            self.accepting = False
            return
        self.accepting = True  # until the store answers, if it ever does
        store = counted_in(self.rendezvous, self.bounded)
        if store is not None:
            self.made.append(store)
            self.accepting = False

    def __call__(self) -> Optional[object]:
        if not self.made and (self.trying is None or not self.trying.is_alive()):
            self.trying = threading.Thread(target=self.attempt, name="rendezvous-count-in", daemon=True)
            self.trying.start()
            self.trying.join(0.1)  # where the store answers, at once
        return self.made[0] if self.made else None

    def settled(self, timeout: float) -> Optional[object]:
        """The client, where the try under way when this process passed its join makes one within `timeout` s."""
        if not self.made and self.trying is not None:
            self.trying.join(timeout)
        return self.made[0] if self.made else None


def tell_the_others(store, line: str, lost: Optional[PeerLost] = None) -> None:
    """Rank 0, stopping: leave `line` in its store (and, where it stops on a lost process, `lost`), and keep the store
    open until every process that waits with a bound has read it (or for STOP_GRACE_SECONDS): they stop with it, where
    its store closing under them would end them with torch.distributed's error."""
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    try:
        if lost is not None:
            store.set(LOST_KEY, lost.cause)
        store.set(STOPPED_KEY, line)
        while store.add(STOP_SEEN_KEY, 0) < store.add(BOUNDED_KEY, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - no store to leave it in: the others find it closed
        pass


def told_by_rank_0(store) -> Union[None, str, PeerLost]:
    """The line rank 0 stopped with, once it has left one (`tell_the_others`), or the lost process it stopped on, else
    None. Its reading is told to rank 0 apart (`seen`), once this process is sure to end with it: rank 0 then closes
    its store."""
    try:
        if not store.check([STOPPED_KEY]):
            return None
        if store.check([LOST_KEY]):  # left before the line
            return PeerLost("the start-up", store.get(LOST_KEY).decode("utf-8", "replace"))
        return store.get(STOPPED_KEY).decode("utf-8", "replace")
    except Exception:  # noqa: BLE001 - the store closed: the main thread's error says so
        return None


def seen(store) -> None:
    """Tell rank 0 that this process has read the line it stopped with (`told_by_rank_0`)."""
    try:
        store.add(STOP_SEEN_KEY, 1)
    except Exception:  # noqa: BLE001 - rank 0 no longer waits for it
        pass


def heartbeat(store, rank: int) -> bool:
    """One heartbeat of this process (ALIVE_KEY), and whether rank 0's store took it, else it is gone."""
    try:
        store.add(ALIVE_KEY.format(rank), 1)
        return True
    except Exception:  # noqa: BLE001
        return False


def past_the_join(store, rank: int) -> None:
    try:
        store.add(ALIVE_KEY.format(rank), PAST_THE_JOIN)
    except Exception:  # noqa: BLE001 - rank 0's store gone, as the process group can do without it
        pass


class Heartbeats:
    """Rank 0's reading of the others' heartbeats (ALIVE_KEY): which of the processes that joined, and are not past the
    process group's join yet, have not beaten for `gone_seconds` (killed, out of memory, their node lost or stopped),
    where torch.distributed would keep the others waiting for them until the bound. Each count is timed by rank 0's
    clock when it is seen to change: rank 0's own pauses take no other process for gone."""

    def __init__(self, processes: int, gone_seconds: float):
        self.processes, self.gone_seconds = processes, gone_seconds
        self.changed: Dict[int, Tuple[int, float]] = {}  # rank: its count, and when rank 0 saw it change

    def gone(self, store) -> List[int]:
        now = time.monotonic()
        try:
            counts = [int(store.add(ALIVE_KEY.format(rank), 0)) for rank in range(1, self.processes)]
        except Exception:  # noqa: BLE001 - rank 0's own store gone: its main thread's error says why
            return []
        gone = []
        for rank, count in enumerate(counts, start=1):
            if count == 0 or count >= PAST_THE_JOIN:  # not joined yet, or past the join
                continue
            if self.changed.get(rank, (0, now))[0] != count:
                self.changed[rank] = (count, now)
            elif now - self.changed[rank][1] >= self.gone_seconds:
                gone.append(rank)
        return gone


def joined_per_node(store, rendezvous: Rendezvous) -> Optional[List[int]]:
    """How many processes of each node have counted themselves in, or None where the store stopped answering."""
    try:
        return [int(store.add(JOINED_KEY.format(node), 0)) for node in range(rendezvous.nodes)]
    except Exception:  # noqa: BLE001 - rank 0, and its store, gone
        return None


def listed(word: str, numbers: List[int]) -> str:
    """ "node 1", "nodes 1 and 3", "nodes 1, 2, 3 and 9 more" (`word`: "node"), "no node"."""
    named = [str(number) for number in numbers]
    if len(named) <= 1:
        return f"{word} {named[0]}" if named else f"no {word}"
    if len(named) <= 4:
        return f"{word}s {', '.join(named[:-1])} and {named[-1]}"
    return f"{word}s {', '.join(named[:3])} and {len(named) - 3} more"


def nodes_short_of(joined: List[int], devices: int) -> str:
    """The nodes some of whose processes have not joined."""
    return listed("node", [node for node, count in enumerate(joined) if count < devices])


def duration(seconds: float) -> str:
    return f"{seconds:g} s" if seconds < 120 else f"{seconds / 60:g} min"


def waiting_line(rendezvous: Rendezvous, joined: Optional[List[int]], bound: float, accepting: bool = False) -> str:
    """What rank 0 says once while it waits (and the first process of another node, while no store answers there;
    `accepting`: something there accepts connections, `CountingIn`)."""
    if joined is None and accepting:
        return (f"something at {rendezvous.where} (MASTER_ADDR:MASTER_PORT) accepts connections but does not answer as "
                f"rank 0's store (torch.distributed's TCPStore); this process stops after {duration(bound)} without it "
                f"(parallelism.join_timeout_minutes)")
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


def failure_line(rendezvous: Rendezvous, joined: Optional[List[int]], bound: float, accepting: bool = False) -> str:
    """Why the run stops at the bound, and what to check (`accepting`: as for `waiting_line`)."""
    within = f"within {duration(bound)} (parallelism.join_timeout_minutes"
    if joined is None and accepting:  # on node 0, rank 0 finds its port in use and stops at once
        return (f"something at {rendezvous.where} (MASTER_ADDR:MASTER_PORT) accepts connections but did not answer as "
                f"rank 0's store (torch.distributed's TCPStore) {within}): another program listens at that port (on "
                f"node 0 its rank 0 then stops at once, saying MASTER_PORT {rendezvous.port} is in use), or "
                f"MASTER_ADDR is not node 0's address; give node 0's address and a port free there, the same on every "
                f"node; nothing was written")
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


def answers(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts a connection at host:port within `timeout` seconds."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:  # refused, unreachable, timed out, or a name that does not resolve
        return False


def is_address_of_this_host(address: str) -> bool:
    """Whether `address` (a name or an IP address) names this host: a socket can be bound to it (where it resolves)."""
    try:
        found = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.bind((sockaddr[0], 0, *sockaddr[2:]))
                return True
            except OSError as error:
                if error.errno != errno.EADDRNOTAVAIL:  # in use, or not allowed: this host's all the same
                    return True
    return False


def unresolved_line(rendezvous: Rendezvous, error: socket.gaierror) -> str:
    fix = ("leave MASTER_ADDR unset (on one node, 127.0.0.1) or give this host's name or IP address"
           if rendezvous.nodes == 1 else "give node 0's host name or IP address, the same on every node")
    return (f"MASTER_ADDR {rendezvous.address} does not resolve on this host ({error.strerror}): {fix}; nothing was "
            f"written")


def check_address_resolves(rendezvous: Rendezvous) -> None:
    """Refuse a MASTER_ADDR that the name service does not know, where torch.distributed would ask again, warning each
    second, for parallelism.timeout_minutes. A name service that fails for now (EAI_AGAIN) is let through."""
    try:
        socket.getaddrinfo(rendezvous.address, rendezvous.port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        if error.errno in UNKNOWN_NAME:
            raise InvalidValue(unresolved_line(rendezvous, error)) from None


def reaches_own_store(rendezvous: Rendezvous) -> Optional[bool]:
    """On rank 0: None while its store does not listen yet (nothing answers at MASTER_PORT through the loopback), else
    whether MASTER_ADDR:MASTER_PORT reaches it, as rank 0's own client of its store must."""
    if not any(answers(loopback, rendezvous.port, 1) for loopback in ("127.0.0.1", "::1")):
        return None
    return answers(rendezvous.address, rendezvous.port, 2)


def own_store_line(rendezvous: Rendezvous, waited: float, of_this_host: bool) -> str:
    """Why rank 0 stops where its own client cannot reach its store at MASTER_ADDR:MASTER_PORT (`of_this_host`: whether
    MASTER_ADDR is an address of this host, `is_address_of_this_host`)."""
    if not of_this_host:
        fix = ("leave MASTER_ADDR unset (on one node, 127.0.0.1) or give this host's name or IP address"
               if rendezvous.nodes == 1 else "give this host's name or IP address, the same on every node")
        return (f"MASTER_ADDR {rendezvous.address} is not an address of this host ({socket.gethostname()}), where rank 0 "
                f"opens the run's store at port {rendezvous.port}, and does not reach it within {duration(waited)}: "
                f"{fix}; nothing was written")
    return (f"rank 0 opened the run's store at port {rendezvous.port} of this host but cannot reach it at "
            f"{rendezvous.where} (MASTER_ADDR:MASTER_PORT) within {duration(waited)}: check that no firewall of this "
            f"host closes that port; nothing was written")


def port_in_use_line(rendezvous: Rendezvous) -> str:
    every = "" if rendezvous.nodes == 1 else ", the same on every node"
    return (f"MASTER_PORT {rendezvous.port} is in use on this host, where rank 0 opens the run's store "
            f"({rendezvous.where}, MASTER_ADDR:MASTER_PORT): another run, or a process left over from one, listens "
            f"there; give another MASTER_PORT{every}, or end that process; nothing was written")


def is_port_in_use(error: BaseException) -> bool:
    """Whether torch.distributed's error is its store's port found in use."""
    return isinstance(error, torch.distributed.DistNetworkError) and "EADDRINUSE" in str(error)


def store_closed(rendezvous: Rendezvous) -> PeerLost:
    """What a process whose rank 0's store closed before every process had joined lost: rank 0 (killed, its node lost,
    ended on an error of its own) as a peer later is. Where rank 0 stopped waiting at the bound, the others read why
    (`told_by_rank_0`) before its store closes."""
    return PeerLost("the start-up", f"rank 0's store at {rendezvous.where} closed before every process had joined: "
                                    f"rank 0 ended, node 0's output says why")


def c10_log_level() -> Optional[ctypes.c_int]:
    """The level below which torch's C++ messages are not printed (c10's FLAGS_caffe2_log_level, which
    TORCH_CPP_LOG_LEVEL sets as torch loads), where torch's c10 library exposes it, else None."""
    for library in sorted((Path(torch.__file__).parent / "lib").glob("*c10.*")):  # libc10.so, libc10.dylib, c10.dll
        try:
            return ctypes.c_int.in_dll(ctypes.CDLL(str(library)), "FLAGS_caffe2_log_level")
        except (OSError, ValueError):
            continue
    return None


def gone_after_joining(rendezvous: Rendezvous, ranks: List[int], gone_seconds: float) -> PeerLost:
    """What the processes lose where those of `ranks` joined, then went away before the process group was made."""
    it, its = ("it", "its node's") if len(ranks) == 1 else ("them", "their nodes'")
    return PeerLost("the start-up", f"{listed('rank', ranks)} joined at {rendezvous.where}, then went away before the "
                                    f"processes had connected to each other (no sign of {it} there for "
                                    f"{duration(gone_seconds)}): {its} output says why")


@contextmanager
def torch_warnings_quiet() -> Iterator[None]:
    """Within: torch's C++ warnings not printed, its errors still. While the processes meet, torch.distributed's store
    warns, in several lines with a C++ stack, of each connection it fails to make (every second while it tries again)
    and of the store closing under it, before the error that is said in one line (`joining_watched`), and before
    the line this module says of a wait it bounds. With FABRIC_LIN_DEBUG=1, or a TORCH_CPP_LOG_LEVEL of one's own,
    they are printed."""
    level = None if debug_enabled() or "TORCH_CPP_LOG_LEVEL" in os.environ else c10_log_level()
    if level is None:
        yield
        return
    before = level.value
    level.value = max(before, C10_ERROR_LEVEL)
    try:
        yield
    finally:
        level.value = before


@contextmanager
def joining_watched(fabric, rendezvous: Optional[Rendezvous], parallelism: ParallelismArgs, created: List[Path],
                    on_lost: Callable[[PeerLost], None], prog: str = "fabric-lin pretrain",
                    poll_seconds: float = 0.5, gone_seconds: float = GONE_SECONDS) -> Iterator[None]:
    """Within: `fabric.launch()`, the rendezvous. A MASTER_ADDR that does not resolve is refused first. Rank 0 stops
    in one line where its store's port is in use (`InvalidValue`, raised once the processes Fabric's launcher started
    are ended) or where MASTER_ADDR does not reach its own store (exit code 2 where MASTER_ADDR is not this host's,
    else JOIN_FAILED_EXIT_CODE). On several nodes, each process counts itself in at the store as soon as it answers,
    and, unless Fabric's launcher started it (the process that did, its node's first, ends it), it waits at most
    parallelism.join_timeout_minutes (and timeout_minutes) from here, and no longer than rank 0: then it ends the
    processes it started, removes the empty directories `created` (out_dir and its new parents) and ends with
    JOIN_FAILED_EXIT_CODE, and, as the first process of its node, says why in one line; rank 0 says once, after a few
    seconds, for how many it waits. One whose rank 0's store closes before then lost rank 0: it ends likewise, but
    through `on_lost` (which says so in one line and ends the process with PEER_LOST_EXIT_CODE) where it speaks for its
    node. So does rank 0 where a process that joined has gone (its heartbeat stood still for `gone_seconds`) before the
    process group was made, and every process that waits with a bound, told by rank 0. torch's C++ warnings are held
    back meanwhile (`torch_warnings_quiet`)."""
    if rendezvous is None:
        yield
        return
    check_address_resolves(rendezvous)
    with torch_warnings_quiet(), rendezvous_watched(fabric, rendezvous, parallelism, created, on_lost, prog,
                                                    poll_seconds, gone_seconds):
        yield


@contextmanager
def rendezvous_watched(fabric, rendezvous: Rendezvous, parallelism: ParallelismArgs, created: List[Path],
                       on_lost: Callable[[PeerLost], None], prog: str, poll_seconds: float,
                       gone_seconds: float) -> Iterator[None]:
    """`joining_watched`, once MASTER_ADDR has resolved."""
    launcher = os.environ.get(LAUNCHING_RANK_PID)
    started_by_launcher = rendezvous.local_rank != 0 and launcher == str(os.getppid())
    if rendezvous.nodes == 1 and not rendezvous.is_rank_0:  # watched by `launching_rank_watched`
        yield
        return
    bounded = rendezvous.nodes > 1 and not started_by_launcher
    speaks = rendezvous.local_rank == 0
    bound = 60 * min(parallelism.join_timeout_minutes, parallelism.timeout_minutes)
    notice = min(NOTICE_SECONDS, bound / 2)
    joined, passed, ending = threading.Event(), threading.Event(), threading.Lock()
    exit_codes: List[int] = []  # the code the process ends with, once `end` is called

    def counts(store) -> Optional[List[int]]:
        return None if store is None else joined_per_node(store, rendezvous)

    def say(line: str, error: bool = False) -> None:  # as the CLI reports: rank 0's plain, the others' naming the rank
        line = named_for_rank(f"error: {line}" if error else line, process_rank())
        print(f"{prog}: {line}", file=sys.stderr, flush=True)

    def end_children() -> None:  # Fabric's launcher's, in the rendezvous: nothing else would end them
        for child in getattr(fabric.strategy.launcher, "procs", []):
            child.kill()
            child.wait()

    def end(line: str, store=None, exit_code: int = JOIN_FAILED_EXIT_CODE, lost: Optional[PeerLost] = None,
            told: bool = False) -> None:
        # once: the watch's bound and the main thread's error may come together; the second waits here until the
        # first's os._exit ends the process, and passes only where os._exit returned (a test's stand-in for it)
        with ending:
            if exit_codes:
                os._exit(exit_codes[0])
            exit_codes.append(exit_code)
            end_once(line, store, exit_code, lost, told)

    def end_once(line: str, store, exit_code: int, lost: Optional[PeerLost], told: bool) -> None:
        try:
            if rendezvous.is_rank_0 and store is not None:
                tell_the_others(store, line, lost)
            if told:  # only now: rank 0's store closing, the main thread's error, waits for the lock
                seen(store)
            end_children()
            remove_empty_dirs(created)  # no process of the run is past the rendezvous: none writes there
            # a process that Fabric's launcher started leaves the line to the process that started it, while it lives
            if lost is not None and (speaks or launcher != str(os.getppid())):
                on_lost(lost)
            elif speaks:
                sys.stdout.flush()
                say(line, error=True)
        finally:  # whatever fails above: the main thread waits where nothing else would end it
            os._exit(exit_code)

    def watch() -> None:
        start, store, noticed, reached, listened = time.monotonic(), None, False, not rendezvous.is_rank_0, None
        client = CountingIn(rendezvous, bounded) if rendezvous.nodes > 1 else None
        heartbeats = Heartbeats(rendezvous.processes, gone_seconds)
        while not joined.wait(poll_seconds):
            store = client() if store is None and client is not None else store
            accepting = store is None and client is not None and client.accepting
            waited = time.monotonic() - start
            # rank 0's store gone: where the main thread waits on a peer instead (gloo connects to each), it is not told
            if store is not None and not rendezvous.is_rank_0 and not heartbeat(store, rendezvous.rank):
                if not joined.is_set():
                    lost = store_closed(rendezvous)
                    end(str(lost), exit_code=PEER_LOST_EXIT_CODE, lost=lost)
            gone = heartbeats.gone(store) if store is not None and rendezvous.is_rank_0 else []
            if gone and not joined.is_set():
                lost = gone_after_joining(rendezvous, gone, gone_seconds)
                end(str(lost), store, exit_code=PEER_LOST_EXIT_CODE, lost=lost)
            if not reached:  # rank 0: its own client of its store reaches it (the others' bound says the rest)
                reached = store is not None or reaches_own_store(rendezvous)
                listened = listened or (time.monotonic() if reached is False else None)
                if reached is False and time.monotonic() - listened >= OWN_STORE_SECONDS:
                    ours = is_address_of_this_host(rendezvous.address)  # else a mistake in what was given: exit 2
                    end(own_store_line(rendezvous, OWN_STORE_SECONDS, ours), exit_code=JOIN_FAILED_EXIT_CODE if ours else 2)
            if not bounded:
                continue
            # the counts (a key per node) read when said only, not by every process twice a second
            if speaks and not noticed and waited >= notice and (rendezvous.is_rank_0 or store is None):
                noticed = True
                say(waiting_line(rendezvous, counts(store), bound, accepting))
            told = told_by_rank_0(store) if store is not None and not rendezvous.is_rank_0 else None
            if isinstance(told, PeerLost) and not joined.is_set():
                end(str(told), store, exit_code=PEER_LOST_EXIT_CODE, lost=told, told=True)
            if (told is not None or waited >= bound) and not joined.is_set():
                end(told or failure_line(rendezvous, counts(store), bound, accepting), store, told=told is not None)
        if passed.is_set() and client is not None and not rendezvous.is_rank_0:
            store = store or client.settled(CLIENT_SECONDS)  # it counts itself in yet: its heartbeat would stand still
            if store is not None:
                past_the_join(store, rendezvous.rank)

    watching = threading.Thread(target=watch, name="rendezvous-watch", daemon=True)
    watching.start()
    try:
        yield
        passed.set()
    except torch.distributed.DistNetworkError as error:
        if rendezvous.is_rank_0 and is_port_in_use(error):
            with ending:  # the processes Fabric's launcher started would wait for a store that never opens
                end_children()
            raise InvalidValue(port_in_use_line(rendezvous)) from None
        if not rendezvous.is_rank_0 and not joined.is_set():  # rank 0's store closed while this process waited in it
            lost = store_closed(rendezvous)
            end(str(lost), exit_code=PEER_LOST_EXIT_CODE, lost=lost)
        raise
    except RuntimeError as error:
        # a peer that had joined and went away since (or one that a firewall keeps out): rank 0 finds the first from
        # its heartbeat within gone_seconds and tells the others (the watch ends the process); the second is raised
        if rendezvous.nodes > 1 and CONNECTION_FAILED.search(str(error)) and not joined.is_set():
            time.sleep(gone_seconds + STOP_GRACE_SECONDS + 4 * poll_seconds)
        raise
    finally:
        joined.set()
        if passed.is_set():  # past the join before it goes on, whatever it meets next, as rank 0 reads it
            watching.join(CLIENT_SECONDS + 1)
