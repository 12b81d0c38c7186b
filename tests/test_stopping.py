"""fabric_lin/stopping.py: each step's skip and stop flags, read by the host a step later unless waited for, and one
process's flags (and a signal during the start-up) reaching the other of two; fused AdamW's found_inf, on which
skipping a non-finite step relies; and, end to end, a run whose every step is non-finite skipping its updates and
stopping with a checkpoint; the signals that ask for a checkpoint and a stop, a first Ctrl-C told by one process.
(Stopped by a signal and resumed: test_pretrain_resume.py.)"""
import os
import signal

import lightning_fabric as L
import pytest
import torch

import fabric_lin_process
from fabric_lin.stopping import StepFlags, StopRequest
from helpers import RUN_TIMEOUT as TIMEOUT, debug_command as command


def test_step_flags_reach_the_host_a_step_later_unless_waited_for():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    flags = StepFlags(fabric)
    assert float(flags.push(1, torch.tensor(False), stop_requested=False)) == 0.0
    assert flags.pop(wait_all=False) == []  # the newest step's flags stay queued
    assert float(flags.push(2, torch.tensor(True), stop_requested=False)) == 1.0  # the optimizer's found_inf
    assert float(flags.push(3, torch.tensor(False), stop_requested=True)) == 0.0
    assert flags.pop(wait_all=False) == [(1, False, False), (2, True, False)]
    assert flags.pop(wait_all=True) == [(3, False, True)]
    assert flags.pop(wait_all=True) == []


def test_settle_counts_skips_in_a_row_and_reads_the_newest_flags_while_skipping_or_stopping():
    flags = StepFlags(L.Fabric(accelerator="cpu", devices=1))
    flags.push(1, torch.tensor(True), stop_requested=False)
    assert flags.settle(wait=True) == (1, False) and flags.nonfinite_in_a_row == 1
    # while updates are skipped the newest step's flags are read at once: train.max_nonfinite_steps stops on time
    flags.push(2, torch.tensor(True), stop_requested=False)
    assert flags.settle(wait=False) == (1, False) and flags.nonfinite_in_a_row == 2
    flags.push(3, torch.tensor(False), stop_requested=False)
    assert flags.settle(wait=True) == (0, False) and flags.nonfinite_in_a_row == 0  # a finite step ends the row
    # a stop read a step late takes the newest step's flags too: the checkpoint counts that step's skip
    flags.push(4, torch.tensor(False), stop_requested=True)
    flags.push(5, torch.tensor(True), stop_requested=False)
    assert flags.settle(wait=False) == (1, True) and flags.nonfinite_in_a_row == 1
    # a stop asked for at the newest of several steps read together stops the run there
    flags.push(6, torch.tensor(False), stop_requested=False)
    flags.push(7, torch.tensor(False), stop_requested=True)
    assert flags.settle(wait=True) == (0, True)


# The other process of test_the_flags_of_one_rank_reach_every_rank: its step 1 is non-finite, a signal reached it
# alone before step 2 (and during the start-up)
PEER_RANK = """
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from fabric_lin.stopping import StepFlags, StopRequest

store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), world_size=2, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=60))
flags = StepFlags(SimpleNamespace(world_size=2))
flags.push(1, torch.tensor(True), stop_requested=False)
flags.push(2, torch.tensor(False), stop_requested=True)
stop = StopRequest()
stop.requested = True
stop.requested_on_any_rank(SimpleNamespace(world_size=2, device=torch.device("cpu")))
dist.destroy_process_group()
"""


def test_the_flags_of_one_rank_reach_every_rank(tmp_path):
    """Two processes, this one and a peer (PEER_RANK, forked as the suite's commands are, run in the repository so
    that it imports this checkout's fabric_lin): the peer's skipped update (left out here at once) and its stop are
    this process's too, as is the signal it received during the start-up."""
    import sys
    from datetime import timedelta
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    repository = Path(__file__).resolve().parents[1]
    log = tmp_path / "peer.log"
    peer = fabric_lin_process.start([sys.executable, "-c", PEER_RANK, str(store.port)], log,
                                    {**os.environ, "CUDA_VISIBLE_DEVICES": ""}, cwd=repository, scripts=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=60))
    try:
        flags = StepFlags(SimpleNamespace(world_size=2))
        # the optimizer's found_inf: this process leaves step 1's update out too, before its host reads a flag
        assert float(flags.push(1, torch.tensor(False), stop_requested=False)) == 1.0
        assert float(flags.push(2, torch.tensor(False), stop_requested=False)) == 0.0
        assert flags.pop(wait_all=True) == [(1, True, False), (2, False, True)]
        assert StopRequest().requested_on_any_rank(SimpleNamespace(world_size=2, device=torch.device("cpu")))
    finally:
        dist.destroy_process_group()
        assert peer.wait(timeout=90) == 0, log.read_text()[-3000:]


def test_scheduler_signals_and_ctrl_c_ask_for_a_stop_and_the_handlers_are_given_back():
    names = ("SIGTERM", "SIGUSR1", "SIGINT")  # SLURM's --signal=USR1@<seconds> warns before the time limit
    before = {name: signal.getsignal(getattr(signal, name)) for name in names}
    with StopRequest(announce=False) as stop:
        # each taken over (a signal left to its default action would end this process: no checkpoint)
        assert [name for name in names if signal.getsignal(getattr(signal, name)) == before[name]] == []
        signal.raise_signal(signal.SIGUSR1)
        assert stop.requested and stop.signal_name == "SIGUSR1"
        signal.raise_signal(signal.SIGTERM)
        try:
            signal.raise_signal(signal.SIGINT)  # after a scheduler's signals, a first Ctrl-C: the checkpoint is still made
        except KeyboardInterrupt:
            pytest.fail("a first Ctrl-C after SIGUSR1 and SIGTERM stopped at once, without a checkpoint")
        assert stop.signal_name == "SIGUSR1"  # the first signal names the stop, whatever came after it
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert {name: signal.getsignal(getattr(signal, name)) for name in names} == before



def test_a_first_ctrl_c_is_told_by_the_announcing_process_only(capfd):
    """A terminal's Ctrl-C reaches every process of a run: the first (announce) says what it does, the others keep
    quiet; a scheduler's signal is told by the stop's own line, not on arrival."""
    told = "\nCtrl-C: stopping with a checkpoint at the end of this step (Ctrl-C again to stop at once, without it)\n"
    with StopRequest(announce=True):
        signal.raise_signal(signal.SIGTERM)
        assert capfd.readouterr().err == ""
        signal.raise_signal(signal.SIGINT)
        assert capfd.readouterr().err == told
    with StopRequest(announce=False) as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and capfd.readouterr().err == ""


def test_a_second_ctrl_c_stops_at_once_after_a_scheduler_s_signal_in_between():
    fabric = L.Fabric(accelerator="cpu", devices=1)
    with StopRequest(announce=False) as stop:
        assert not stop.requested_on_any_rank(fabric)
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"  # the first Ctrl-C asks for a stop with a checkpoint
        assert stop.requested_on_any_rank(fabric)
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)

def test_fused_adamw_found_inf_leaves_the_update_out():
    # what the loop relies on to skip a non-finite step without the host reading the flag first
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.full((4,), float("nan"))
    optimizer.found_inf = torch.tensor(1.0)
    optimizer.step()
    assert torch.equal(weight.detach(), torch.ones(4)) and float(optimizer.state[weight]["step"]) == 0
    weight.grad = torch.ones(4)
    optimizer.found_inf = torch.tensor(0.0)
    optimizer.step()
    assert (weight.detach() < 1).all() and float(optimizer.state[weight]["step"]) == 1


@pytest.mark.slow
def test_nonfinite_steps_are_skipped_then_stop_with_checkpoint(tmp_path):
    """Weights of 1e38 overflow the activations: every step's loss is non-finite; updates are skipped
    and the run stops after train.max_nonfinite_steps, saving the untouched weights."""
    from fabric_lin.config import Config

    config_path = tmp_path / "model_config.yaml"
    Config.from_name("gla-debug", initializer_range=1e38).save(config_path)
    cmd = command(tmp_path / "out", "--train.max_nonfinite_steps", "2")
    cmd[cmd.index("--model_name"): cmd.index("--model_name") + 2] = ["--model_config", str(config_path)]
    result = fabric_lin_process.run(cmd, TIMEOUT)
    assert result.returncode != 0
    assert "2 consecutive steps with a non-finite loss or gradient norm" in result.stderr
    assert "update skipped" in result.stdout + result.stderr
    state = torch.load(tmp_path / "out" / "step-00000002" / "lit_model.pth", map_location="cpu", weights_only=True)
    assert state["skipped_steps"] == 2
    # no update was ever made: AdamW's step counts and moments as they started
    moments = list(state["optimizer"]["state"].values())
    assert moments and all(float(m["step"]) == 0 and not m["exp_avg"].any() and not m["exp_avg_sq"].any() for m in moments)
