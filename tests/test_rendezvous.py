"""fabric_lin/rendezvous.py in this process, without a run: what rank 0 finds wrong with its store's address and port
before anyone else comes (a port in use, as torch.distributed's own store reports it; a MASTER_ADDR that does not
resolve, or that is no address of this host and does not reach the store rank 0 opened); what another node finds at
a port in use (no store); and what a process whose rank 0's store closes before every process has joined, or whose
peer joined and went away, ends with (a lost peer, without torch's warnings); when rank 0 takes a process for gone
(its heartbeat stood still), and when a process says it is past its join. The stores are torch.distributed's own,
opened here; the other processes, their clients. As a run meets them: test_pretrain_sharded.py."""
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fabric_lin import rendezvous as rdv
from fabric_lin.args import ParallelismArgs
from fabric_lin.errors import PEER_LOST_EXIT_CODE, InvalidValue, PeerLost
from helpers import free_port

# TEST-NET-1 (RFC 5737): an address for documentation, no host's
NO_HOST_S = "192.0.2.1"


def rendezvous(address: str = "127.0.0.1", port: int = 29500, nodes: int = 2, node: int = 0) -> rdv.Rendezvous:
    return rdv.Rendezvous(address, port, nodes=nodes, devices=1, node=node, local_rank=0, rank=node)


def test_a_port_in_use_is_told_from_torch_distributed_s_own_error_in_one_line():
    """The store rank 0 opens, torch.distributed's TCPStore, at a port another process listens on: its error is
    recognised as such, and the line names the address and port, and what to do. Another error of the store is not."""
    from torch.distributed import TCPStore

    with socket.socket() as other_run:
        other_run.bind(("127.0.0.1", 0))
        other_run.listen()
        port = other_run.getsockname()[1]
        with pytest.raises(torch.distributed.DistNetworkError) as raised:
            TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    assert rdv.is_port_in_use(raised.value)
    assert not rdv.is_port_in_use(torch.distributed.DistNetworkError("Connection was likely closed"))
    assert rdv.port_in_use_line(rendezvous("node0", port)) == (
        f"MASTER_PORT {port} is in use on this host, where rank 0 opens the run's store (node0:{port}, "
        f"MASTER_ADDR:MASTER_PORT): another run, or a process left over from one, listens there; give another "
        f"MASTER_PORT, the same on every node, or end that process; nothing was written")


def test_a_master_addr_the_name_service_does_not_know_is_refused_and_one_it_cannot_ask_for_now_is_not(monkeypatch):
    def unknown(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unknown)
    with pytest.raises(InvalidValue, match=r"^MASTER_ADDR nodee0 does not resolve on this host \(Name or service not "
                                           r"known\): give node 0's host name or IP address, the same on every node; "
                                           r"nothing was written$"):
        rdv.check_address_resolves(rendezvous("nodee0"))
    with pytest.raises(InvalidValue, match=r"\): leave MASTER_ADDR unset \(on one node, 127.0.0.1\) or give this "
                                           r"host's name or IP address; nothing"):
        rdv.check_address_resolves(rendezvous("nodee0", nodes=1))

    def failing_for_now(*args, **kwargs):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    monkeypatch.setattr(socket, "getaddrinfo", failing_for_now)
    rdv.check_address_resolves(rendezvous("node0"))  # torch.distributed asks again, as it may succeed


def test_rank_0_tells_whether_master_addr_reaches_the_store_it_opened():
    """None while nothing listens at the port (the store not open yet); then whether MASTER_ADDR reaches it: an address
    of this host does, an address that is no host's does not, and the line says which of the two mistakes it is."""
    port = free_port()
    assert rdv.reaches_own_store(rendezvous("127.0.0.1", port)) is None
    with socket.socket() as store:  # in the place of the store rank 0 opens, on every address of this host
        store.bind(("0.0.0.0", port))
        store.listen()
        assert rdv.reaches_own_store(rendezvous("127.0.0.1", port)) is True
        assert rdv.reaches_own_store(rendezvous(NO_HOST_S, port)) is False
    assert rdv.is_address_of_this_host("127.0.0.1") and rdv.is_address_of_this_host("localhost")
    assert not rdv.is_address_of_this_host(NO_HOST_S)
    assert rdv.own_store_line(rendezvous(NO_HOST_S, port), 5, of_this_host=False) == (
        f"MASTER_ADDR {NO_HOST_S} is not an address of this host ({socket.gethostname()}), where rank 0 opens the run's "
        f"store at port {port}, and does not reach it within 5 s: give this host's name or IP address, the same on "
        f"every node; nothing was written")
    assert rdv.own_store_line(rendezvous("10.0.0.1", port), 5, of_this_host=True) == (
        f"rank 0 opened the run's store at port {port} of this host but cannot reach it at 10.0.0.1:{port} "
        f"(MASTER_ADDR:MASTER_PORT) within 5 s: check that no firewall of this host closes that port; nothing was "
        f"written")


def exiting_here(monkeypatch) -> list:
    """os._exit, in the watch's thread or in the main thread, raising SystemExit there (the watch's thread thus ends);
    the exit code the process ended with: the first call's (a real os._exit ends the process there, where here the
    other thread may call it again)."""
    ended = []

    def exit_here(code):
        ended[:] = ended or [code]
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_here)
    return ended


# the watch's thread, ended by os._exit as `exiting_here` has it
watch_ended = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def waiting_in_a_store_that_closes(monkeypatch, tmp_path, in_the_store: bool = True):
    """Node 1's first process, its main thread waiting in rank 0's store (torch.distributed's TCPStore, opened here) as
    torch.distributed's rendezvous does (else, once the process has counted itself in, waiting elsewhere, as for a
    connection to a peer), when rank 0 closes it without a word: the exit codes it ended with, the lost peers it was
    ended through, and whether its out_dir is gone."""
    import contextlib
    import gc
    import threading
    from torch.distributed import TCPStore

    lost, ended = [], exiting_here(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    out_dir = tmp_path / "out"
    out_dir.mkdir(parents=True)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    port = free_port()
    stores = [TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)]
    where = rendezvous("127.0.0.1", port, node=1)

    def close_rank_0_s_store():
        time.sleep(0.3)
        stores.clear()
        gc.collect()

    with contextlib.suppress(SystemExit):
        with rdv.joining_watched(fabric, where, ParallelismArgs(), [out_dir], on_lost=lost.append, poll_seconds=0.1):
            if in_the_store:
                client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                                  wait_for_workers=False)
                threading.Thread(target=close_rank_0_s_store).start()
                client.get("rank 0's address, never set")
            deadline = time.monotonic() + 5
            while not stores[0].add(rdv.JOINED_KEY.format(1), 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            close_rank_0_s_store()
            while not ended and time.monotonic() < deadline:
                time.sleep(0.05)
    return ended, lost, where, out_dir.exists()


@watch_ended
def test_rank_0_s_store_closed_before_every_process_joined_is_a_lost_peer_said_without_torch_s_warning(
        monkeypatch, tmp_path, capfd):
    """Node 1's first process waits in rank 0's store when it closes without a word from rank 0 (which leaves one where
    it stops at the bound): rank 0 ended, killed or its node lost, and the process ends as one whose peer is gone after
    the join does (the requeue scripts resubmit PEER_LOST_EXIT_CODE), through `on_lost`, removing the out_dir it made.
    torch's C++ warning of the closed connection (several lines and a C++ stack, before the line `on_lost` prints) is
    not printed; with FABRIC_LIN_DEBUG=1 it is."""
    monkeypatch.delenv("FABRIC_LIN_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    ended, lost, where, out_dir_left = waiting_in_a_store_that_closes(monkeypatch, tmp_path / "quiet")
    assert ended == [PEER_LOST_EXIT_CODE] and not out_dir_left
    [peer] = lost
    assert isinstance(peer, PeerLost) and str(peer) == (
        f"a peer process of the run ended or became unreachable during the start-up (rank 0's store at {where.where} "
        f"closed before every process had joined: rank 0 ended, node 0's output says why)")
    assert "[c10d]" not in capfd.readouterr().err

    monkeypatch.setenv("FABRIC_LIN_DEBUG", "1")
    ended, lost, _, _ = waiting_in_a_store_that_closes(monkeypatch, tmp_path / "debug")
    assert ended == [PEER_LOST_EXIT_CODE] and len(lost) == 1
    assert "[c10d] recvValueWithTimeout failed" in capfd.readouterr().err


@watch_ended
def test_rank_0_s_store_closed_while_the_process_waits_elsewhere_is_a_lost_peer_too(monkeypatch, tmp_path):
    """As above, the process's main thread waiting not in the store but on a connection to another process (gloo
    connects each process to every other once all have joined): no error of torch's says that the store closed, and
    the watch finds it so itself."""
    ended, lost, where, out_dir_left = waiting_in_a_store_that_closes(monkeypatch, tmp_path, in_the_store=False)
    assert ended == [PEER_LOST_EXIT_CODE] and not out_dir_left
    assert [str(peer) for peer in lost] == [str(rdv.store_closed(where))]


LISTENING_FOR_EVER = []


@watch_ended
def test_node_1_finding_another_program_at_master_port_says_so_not_that_nothing_answered(monkeypatch, tmp_path, capfd):
    """Node 1's first process, where another program listens at MASTER_ADDR:MASTER_PORT (on node 0, whose rank 0 then
    stops at once: test_a_port_in_use_...): something accepts its connections, but torch.distributed's store client
    waits there for an answer for ever. At the bound it says that something there is not rank 0's store, and what to
    check, not that nothing answered."""
    from fabric_lin.errors import JOIN_FAILED_EXIT_CODE

    ended = exiting_here(monkeypatch)
    monkeypatch.setattr(rdv, "process_rank", lambda: 1)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    other_program = socket.socket()
    other_program.bind(("127.0.0.1", 0))
    other_program.listen()
    # left open until this test process ends (a copy of its descriptor, which nothing closes before): the watch's store
    # client, in a thread of its own, waits there for an answer for ever, silent; closed, it would try again for
    # seconds, printing torch's warnings into later tests' output
    LISTENING_FOR_EVER.append(os.dup(other_program.fileno()))
    where = rendezvous("127.0.0.1", other_program.getsockname()[1], node=1)
    with rdv.joining_watched(fabric, where, ParallelismArgs(join_timeout_minutes=0.02), [], on_lost=None,
                             poll_seconds=0.1):
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("fabric-lin")]
    assert ended == [JOIN_FAILED_EXIT_CODE] and said == [
        f"fabric-lin pretrain: something at {where.where} (MASTER_ADDR:MASTER_PORT) accepts connections but does not "
        f"answer as rank 0's store (torch.distributed's TCPStore); this process stops after 1.2 s without it "
        f"(parallelism.join_timeout_minutes) (rank 1)",
        f"fabric-lin pretrain: error on rank 1: something at {where.where} (MASTER_ADDR:MASTER_PORT) accepts "
        f"connections but did not answer as rank 0's store (torch.distributed's TCPStore) within 1.2 s "
        f"(parallelism.join_timeout_minutes): another program listens at that port (on node 0 its rank 0 then stops at "
        f"once, saying MASTER_PORT {where.port} is in use), or MASTER_ADDR is not node 0's address; give node 0's "
        f"address and a port free there, the same on every node; nothing was written"], said


@watch_ended
def test_a_process_gone_after_it_joined_before_the_process_group_was_made_is_a_lost_peer_named_by_rank_0(
        monkeypatch, tmp_path):
    """Four nodes of one process: rank 1 counts itself in at rank 0's store, then is gone (killed, out of memory) before
    the process group is made, where torch.distributed would keep the others waiting until the bound, and the run
    would end as one whose processes all joined but did not connect (JOIN_FAILED_EXIT_CODE, not resubmitted), or rank
    0 on gloo's error connecting to it (with a traceback, as a bug). Rank 2 waits, alive, and rank 3 is past its join.
    Rank 0 finds rank 1's heartbeat stopped and ends as a process whose peer is gone (PEER_LOST_EXIT_CODE, through
    `on_lost`), naming rank 1, and leaves the same in its store for rank 2."""
    import threading
    from torch.distributed import TCPStore

    lost, ended = [], exiting_here(monkeypatch)
    monkeypatch.setattr(rdv, "STOP_GRACE_SECONDS", 0.5)  # rank 1 never reads rank 0's line
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    at = {rank: rendezvous("127.0.0.1", port, nodes=4, node=rank) for rank in range(4)}
    rdv.counted_in(at[1], bounded=True)  # and no more
    rank_3 = rdv.counted_in(at[3], bounded=True)
    rdv.past_the_join(rank_3, 3)
    rank_2, told_rank_2, waiting = rdv.counted_in(at[2], bounded=True), [], threading.Event()

    def rank_2_waits():
        while not waiting.wait(0.05):
            rdv.heartbeat(rank_2, 2)
            told = rdv.told_by_rank_0(rank_2)
            if told is not None:
                told_rank_2.append(told)
                rdv.seen(rank_2)
                return

    threading.Thread(target=rank_2_waits, daemon=True).start()
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    try:
        with pytest.raises(RuntimeError):  # where os._exit, ending the process, has not
            with rdv.joining_watched(fabric, at[0], ParallelismArgs(), [out_dir], on_lost=lost.append,
                                     poll_seconds=0.1, gone_seconds=1):
                # as gloo says it, once every process has joined the store, connecting to rank 1
                raise RuntimeError("Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152] timed out "
                                   "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:1411$0")
    finally:
        waiting.set()
    assert ended == [PEER_LOST_EXIT_CODE] and not out_dir.exists()
    [peer] = lost
    assert isinstance(peer, PeerLost) and str(peer) == (
        f"a peer process of the run ended or became unreachable during the start-up (rank 1 joined at "
        f"127.0.0.1:{port}, then went away before the processes had connected to each other (no sign of it there for 1 s): its node's "
        f"output says why)")
    [told] = told_rank_2
    assert isinstance(told, PeerLost) and str(told) == str(peer)


def test_a_process_past_its_join_tells_rank_0_so():
    """Its heartbeat then stops, and rank 0 (which may wait for others still) must not take it for gone."""
    from torch.distributed import TCPStore

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    alive = rdv.ALIVE_KEY.format(1)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    with rdv.joining_watched(fabric, rendezvous("127.0.0.1", port, node=1), ParallelismArgs(), [], on_lost=None,
                             poll_seconds=0.05):
        deadline = time.monotonic() + 5
        while not store.add(alive, 0) and time.monotonic() < deadline:  # counted in
            time.sleep(0.05)
        assert 0 < store.add(alive, 0) < rdv.PAST_THE_JOIN
    assert store.add(alive, 0) >= rdv.PAST_THE_JOIN


def rank_0_s_store(port: int):
    """The run's store, as rank 0 opens it, at `port` of this host."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)


class CountingStore:
    """The counters of a store (TCPStore's `add`: the new value), for rank 0's reading of them alone."""

    def __init__(self, counts=None):
        self.counts = dict(counts or {})

    def add(self, key, amount):
        self.counts[key] = self.counts.get(key, 0) + amount
        return self.counts[key]


def test_rank_0_takes_for_gone_only_a_joined_process_whose_heartbeat_stood_still_for_gone_seconds(monkeypatch):
    """Rank 0's clock, polling twice a second: rank 1 has not joined yet; rank 2 beats for longer than gone_seconds,
    then stops; rank 3 is past its join; rank 4, the last, beat for the 30 minutes a join may last at most
    (parallelism.timeout_minutes) before it stood still. Each is gone once gone_seconds have passed since its count last changed, not before, and
    no other is; a store that no longer answers finds none."""
    now = [0.0]
    monkeypatch.setattr(rdv, "time", SimpleNamespace(monotonic=lambda: now[0]))
    store = CountingStore({rdv.ALIVE_KEY.format(3): rdv.PAST_THE_JOIN + 7, rdv.ALIVE_KEY.format(4): 2 * 60 * 30})
    heartbeats, first_gone = rdv.Heartbeats(processes=5, gone_seconds=30), {}
    for tick in range(400):
        now[0] = tick / 2
        if now[0] < 100:
            store.add(rdv.ALIVE_KEY.format(2), 1)
        for rank in heartbeats.gone(store):
            first_gone.setdefault(rank, now[0])
    assert first_gone == {4: 30.0, 2: 99.5 + 30}

    class Closed:
        def add(self, key, amount):
            raise torch.distributed.DistNetworkError("Connection reset by peer")

    assert heartbeats.gone(Closed()) == []


@watch_ended
def test_the_last_process_of_a_node_of_several_gone_after_it_joined_is_found_while_others_have_not_joined(
        monkeypatch, tmp_path):
    """Two nodes of two processes: rank 3, node 1's second, counts itself in and is gone, while ranks 1 and 2 have not
    joined yet. Rank 0 reads the heartbeat of every process, not one per node, and names rank 3 as lost."""
    lost, ended = [], exiting_here(monkeypatch)
    monkeypatch.setattr(rdv, "STOP_GRACE_SECONDS", 0.5)  # rank 3 never reads rank 0's line
    port = free_port()
    store = rank_0_s_store(port)
    at = {rank: rdv.Rendezvous("127.0.0.1", port, nodes=2, devices=2, node=rank // 2, local_rank=rank % 2, rank=rank)
          for rank in range(4)}
    rdv.counted_in(at[3], bounded=True)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    with pytest.raises(RuntimeError):  # where os._exit, ending the process, has not
        with rdv.joining_watched(fabric, at[0], ParallelismArgs(), [], on_lost=lost.append, poll_seconds=0.1,
                                 gone_seconds=1):
            raise RuntimeError("Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152] timed out "
                               "connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:1411$0")
    assert ended == [PEER_LOST_EXIT_CODE] and [str(peer) for peer in lost] == [
        str(rdv.gone_after_joining(at[0], [3], 1))]
    del store


@watch_ended
def test_a_process_other_than_rank_0_leaves_a_peer_gone_to_rank_0(monkeypatch):
    """Node 1's first process, rank 2 joined and standing still past gone_seconds: it waits for rank 0's word (which
    rank 0 leaves in its store), without ending on its own or reading every peer's heartbeat twice a second."""
    lost, ended = [], exiting_here(monkeypatch)
    port = free_port()
    store = rank_0_s_store(port)
    rdv.counted_in(rendezvous("127.0.0.1", port, nodes=3, node=2), bounded=True)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    with rdv.joining_watched(fabric, rendezvous("127.0.0.1", port, nodes=3, node=1), ParallelismArgs(), [],
                             on_lost=lost.append, poll_seconds=0.05, gone_seconds=0.2):
        time.sleep(1)
    assert ended == [] and lost == []
    assert store.add(rdv.ALIVE_KEY.format(1), 0) >= rdv.PAST_THE_JOIN


def test_a_process_counted_in_only_after_its_join_still_tells_rank_0_it_is_past_it(monkeypatch):
    """Its client of the store, made in a thread that is still trying when the process passes its join, counts it in
    afterwards: its heartbeat would then stand still, and rank 0 take it for gone."""
    port = free_port()
    store = rank_0_s_store(port)
    count_in = rdv.counted_in

    def late(*args, **kwargs):
        time.sleep(0.5)
        return count_in(*args, **kwargs)

    monkeypatch.setattr(rdv, "counted_in", late)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    with rdv.joining_watched(fabric, rendezvous("127.0.0.1", port, node=1), ParallelismArgs(), [], on_lost=None,
                             poll_seconds=0.05):
        time.sleep(0.2)
        assert store.add(rdv.ALIVE_KEY.format(1), 0) == 0  # not counted in yet
    assert store.add(rdv.ALIVE_KEY.format(1), 0) > rdv.PAST_THE_JOIN


def test_a_process_whose_join_failed_does_not_tell_rank_0_it_is_past_it():
    """An error in the join (here a ValueError): the process ends, and its heartbeat stops as a process gone does, for
    rank 0 to find, not as a process past the join does."""
    port = free_port()
    store = rank_0_s_store(port)
    alive = rdv.ALIVE_KEY.format(1)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    with pytest.raises(ValueError):
        with rdv.joining_watched(fabric, rendezvous("127.0.0.1", port, node=1), ParallelismArgs(), [], on_lost=None,
                                 poll_seconds=0.05):
            deadline = time.monotonic() + 5
            while not store.add(alive, 0) and time.monotonic() < deadline:  # counted in
                time.sleep(0.05)
            raise ValueError("an error of the join")
    time.sleep(0.5)  # the watch has ended
    assert 0 < store.add(alive, 0) < rdv.PAST_THE_JOIN
