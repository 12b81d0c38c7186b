"""fabric_lin/rendezvous.py in this process, without a run: what rank 0 finds wrong with its store's address and port
before anyone else comes (a port in use, as torch.distributed's own store reports it; a MASTER_ADDR that does not
resolve, or that is no address of this host and does not reach the store rank 0 opened), and what a process whose
rank 0's store closes before every process has joined ends with (a lost peer). As a run meets them:
test_pretrain_sharded.py."""
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
    return rdv.Rendezvous(address, port, nodes=nodes, devices=1, node=node, local_rank=0)


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


def waiting_in_a_store_that_closes(monkeypatch, tmp_path):
    """Node 1's first process, its main thread waiting in rank 0's store (torch.distributed's TCPStore, opened here) as
    torch.distributed's rendezvous does, when rank 0 closes it without a word: the exit codes it ended with, the lost
    peers it was ended through, and whether its out_dir is gone."""
    import gc
    import threading
    from torch.distributed import TCPStore

    lost, ended = [], []

    def exit_here(code):
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_here)
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

    with pytest.raises(SystemExit):
        with rdv.joining_watched(fabric, where, ParallelismArgs(), [out_dir], on_lost=lost.append):
            client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False)
            threading.Thread(target=close_rank_0_s_store).start()
            client.get("rank 0's address, never set")
    return ended, lost, where, out_dir.exists()


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


def test_node_1_finding_another_program_at_master_port_says_so_not_that_nothing_answered(monkeypatch, tmp_path, capfd):
    """Node 1's first process, where another program listens at MASTER_ADDR:MASTER_PORT (on node 0, whose rank 0 then
    stops at once: test_a_port_in_use_...): something accepts its connections, but torch.distributed's store client
    waits there for an answer for ever. At the bound it says that something there is not rank 0's store, and what to
    check, not that nothing answered."""
    from fabric_lin.errors import JOIN_FAILED_EXIT_CODE

    ended = []
    monkeypatch.setattr(os, "_exit", ended.append)
    monkeypatch.setattr(rdv, "process_rank", lambda: 1)
    fabric = SimpleNamespace(strategy=SimpleNamespace(launcher=None))
    with socket.socket() as other_program:
        other_program.bind(("127.0.0.1", 0))
        other_program.listen()
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
