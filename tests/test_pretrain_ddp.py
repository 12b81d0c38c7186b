"""End to end: `fabric-lin pretrain` as a subprocess on 2 processes (DDP over gloo on the CPU; gla-debug, the sample
corpus). Stopped by SIGTERM, or by SIGKILL of either rank (which must end the whole job), and resumed with
`--resume auto`, a run logs the uninterrupted one's loss and data checksum at every step and ends with its weights,
bit for bit; so do two nodes of one process each under torchrun. One process and two train on the same samples at
every step, also when a run is resumed on the other number (the loss then equal up to the order of floating-point
sums). An error every rank meets is printed once. One process: test_pretrain_resume.py."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import fabric_lin_process
from conftest import logged_data_fingerprints
from helpers import (
    CPU_ONLY,
    DEBUG_ARGS as COMMON,
    DEBUG_STEPS as STEPS,
    RUN_TIMEOUT as TIMEOUT,
    assert_same_run,
    debug_command as command,
    debug_run as run,
    final_weights,
    free_port,
    logged_losses,
    start_debug_run as start,
    wait_for,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_ddp(tmp_path_factory) -> Path:
    """The uninterrupted debug run on two processes (DDP over gloo on the CPU). Module-scoped: this file's tests
    run on one pytest-xdist worker, which runs it once."""
    out = tmp_path_factory.mktemp("reference_ddp") / "out"
    run(out, "--devices", "2", "--eval.final_validation", "true", env=CPU_ONLY)
    return out


def test_two_processes_gloo_sigterm_and_resume_are_exact(reference_ddp, tmp_path):
    from fabric_lin.checkpoint import verify_checkpoint

    assert (reference_ddp / "final" / "lit_model.pth").is_file()
    # the manifest's files were checksummed by both ranks, each its share; rank 0 wrote it whole
    manifest = json.loads((reference_ddp / "final" / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in (reference_ddp / "final").iterdir()} - {"manifest.json"}
    assert verify_checkpoint(reference_ddp / "final").ok
    out = tmp_path / "out"
    proc = start(out, "--devices", "2", env=CPU_ONLY)  # the signal reaches rank 0 only; the ranks agree to stop
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 0
    assert not (out / "final").exists()
    run(out, "--devices", "2", "--resume", "auto", env=CPU_ONLY)
    assert_same_run(out, reference_ddp)


def rank_process(launcher: subprocess.Popen, rank: int) -> int:
    """The pid of a rank of a 2-process run: rank 0 is the launched process, rank 1 its child started with
    LOCAL_RANK=1 (its DataLoader workers, forked, carry rank 0's environment)."""
    if rank == 0:
        return launcher.pid
    children = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    ranks = [int(pid) for pid in children if b"LOCAL_RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
    assert len(ranks) == 1, children
    return ranks[0]


def ended_within(pid: int, seconds: float) -> bool:
    """Whether the process ended (exited, or left as a zombie for its parent to collect) within `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("killed", [0, 1])
def test_sigkill_of_one_rank_ends_the_job_then_resume_is_exact(reference_ddp, tmp_path, killed):
    out = tmp_path / "out"
    launcher = start(out, "--devices", "2", env=CPU_ONLY)
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, launcher)
    ranks = {rank: rank_process(launcher, rank) for rank in (0, 1)}
    os.kill(ranks[killed], signal.SIGKILL)
    # the other rank finds its peer gone at its next collective and exits with an error: no hang
    survivor = ranks[1 - killed]
    assert ended_within(survivor, 60), f"rank {1 - killed} still running 60 s after rank {killed} was killed"
    assert launcher.wait(timeout=10) != 0
    assert not (out / "final").exists()
    run(out, "--devices", "2", "--resume", "auto", env=CPU_ONLY)
    assert_same_run(out, reference_ddp)


def test_two_nodes_under_torchrun_train_as_one_node_with_two_processes(reference_ddp, tmp_path):
    """The multi-node tutorial's launch, two nodes of one process each on this host: every step's loss and
    batches and the final weights are those of one node with two processes."""
    out, port = tmp_path / "out", free_port()
    fabric_lin = shutil.which("fabric-lin") or pytest.skip("the fabric-lin console script is not installed")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(port)]
    nodes = [
        subprocess.Popen([*torchrun, "--node-rank", str(rank), fabric_lin, "pretrain", *COMMON, "--out_dir", str(out),
                          "--devices", "1", "--num_nodes", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=CPU_ONLY)
        for rank in (0, 1)
    ]
    logs = [node.communicate(timeout=TIMEOUT)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert_same_run(out, reference_ddp)


def assert_same_samples_close_losses(out_dir: Path, reference: Path, steps) -> None:
    """Each step trained on the reference's samples (the sum of per-sample checksums), and the loss follows
    the reference's: equal up to the order of the floating-point sums, which the split changes."""
    got, expected = logged_data_fingerprints(out_dir), logged_data_fingerprints(reference)
    assert {s: got[s] for s in steps} == {s: expected[s] for s in steps}
    losses, expected_losses = logged_losses(out_dir), logged_losses(reference)
    for step in steps:
        assert losses[step] == pytest.approx(expected_losses[step], rel=1e-4, abs=1e-4), step


def test_one_process_and_two_train_on_the_same_samples(reference, reference_ddp):
    """Two processes with a micro batch each per step, or one with two: the same samples at every step, and a
    validation of the same blocks (eval.max_iters global batches of 4 blocks of 64 tokens)."""
    assert_same_samples_close_losses(reference_ddp, reference, range(1, STEPS + 1))
    assert len(set(logged_data_fingerprints(reference).values())) == STEPS
    one, two = ([r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]
                for out in (reference, reference_ddp))
    assert len(one) == len(two) == 1 and one[0]["val_tokens"] == two[0]["val_tokens"] == 4 * 64
    assert two[0]["val_loss"] == pytest.approx(one[0]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("processes", [(2, 1), (1, 2)], ids=["2->1", "1->2"])
def test_resumed_on_another_process_count_no_sample_is_repeated_or_skipped(reference, reference_ddp, tmp_path, processes):
    """The data mix (SlimPajama and Starcoder of the sample corpus) resumed from step 4 on the other number of
    processes: steps 5-8 train on the samples of the uninterrupted run, and its loss continues."""
    before, after = processes
    uninterrupted = reference_ddp if before == 2 else reference
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(uninterrupted / "step-00000004", out / "step-00000004")
    result = run(out, "--resume", "auto", "--devices", str(after), env=CPU_ONLY)
    assert f"Resuming from {out / 'step-00000004'}" in result.stdout
    assert sorted(logged_losses(out)) == [5, 6, 7, 8]
    assert_same_samples_close_losses(out, uninterrupted, range(5, STEPS + 1))
    a, b = final_weights(out), final_weights(uninterrupted)
    for key in b:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4, msg=key)


def test_an_error_every_rank_meets_is_printed_once(tmp_path):
    """Two processes both find the --resume directory missing (after the launch): rank 0 alone reports it;
    the out_dir the run created is removed again."""
    missing = tmp_path / "nothing"
    result = fabric_lin_process.run(command(tmp_path / "out", "--devices", "2", "--resume", str(missing)), TIMEOUT, CPU_ONLY)
    assert result.returncode == 2
    line = f"fabric-lin pretrain: error: --resume {missing}: expected a checkpoint directory holding lit_model.pth\n"
    assert (result.stdout + result.stderr).count(line) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
