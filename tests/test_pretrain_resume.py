"""End to end: `fabric-lin pretrain` as a subprocess in one process (gla-debug, the sample corpus): on the CPU in
fp32 or, where there is a GPU, with the GPU's defaults (bf16-mixed, each Block compiled and replayed as a CUDA graph).

An uninterrupted run is the reference. Runs stopped by SIGKILL (also while a checkpoint is being written), by
SIGTERM and by Ctrl-C are resumed with `--resume auto` and must log the same loss and the same data checksum at
every step and end with the same weights, bit for bit; so must a run resumed past a damaged checkpoint. A second
Ctrl-C stops at once; a fresh run into a used out_dir is refused; the start-up time counts from Python's start,
also behind a shell. Several processes: test_pretrain_sharded.py.

Run as a script for the long fault-injection tally (not in CI):
    python tests/test_pretrain_resume.py --kills 100
"""
import json
import math
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Dict

import pytest
import torch
import yaml

import fabric_lin_process
from helpers import (
    DEBUG_STEPS as STEPS,
    LOADER_WORKERS,
    RUN_TIMEOUT as TIMEOUT,
    assert_same_run,
    ctrl_c,
    debug_command as command,
    debug_run as run,
    final_weights,
    logged_losses,
    run_with_a_small_tmpfs,
    signal_job,
    start_debug_run as start,
    wait_for,
)

pytestmark = pytest.mark.slow


def test_reference_run_writes_the_checkpoint_format(reference):
    assert sorted(p.name for p in reference.iterdir() if p.name.startswith("step-")) == [
        f"step-{s:08d}" for s in (2, 4, 6)
    ]
    assert not list(reference.glob(".tmp-*"))
    final = reference / "final"
    assert {"lit_model.pth", "hyperparameters.yaml", "model_config.yaml", "tokenizer.model"} <= {p.name for p in final.iterdir()}
    state = torch.load(final / "lit_model.pth", map_location="cpu", weights_only=True)
    assert {"model", "optimizer", "train_dataloader", "iter_num", "step_count", "rng_states"} <= set(state)
    assert state["step_count"] == STEPS and state["iter_num"] == STEPS * 2  # 4 sequences = 2 micro-batches of 2
    losses = logged_losses(reference)
    assert losses[STEPS] < losses[1] - 0.5  # it learns
    # start-up is logged: time from process start to the first optimizer step, and torch.compile's
    # graph count (compile is on by default on a GPU, off on the CPU: none there)
    compiles = torch.cuda.is_available()
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in records if "time_to_first_step_s" in r]
    assert len(first) == 1 and first[0]["step"] == 1 and 0 < first[0]["time_to_first_step_s"] < TIMEOUT
    assert (first[0]["compiled_graphs"] > 0) if compiles else (first[0]["compiled_graphs"] == 0)
    hparams = yaml.safe_load((final / "hyperparameters.yaml").read_text())
    assert hparams["compile"]["enabled"] is compiles and hparams["compile"]["cache"] is True
    # which checkpoint is newest is read from step.json, without loading the checkpoint
    assert json.loads((final / "step.json").read_text()) == {"step_count": STEPS}
    assert json.loads((reference / "step-00000004" / "step.json").read_text())["step_count"] == 4
    # each checkpoint carries its manifest, and verifies
    from fabric_lin.checkpoint import verify_checkpoint

    for checkpoint in [final, *reference.glob("step-*")]:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
        assert set(manifest["files"]) == {p.name for p in checkpoint.iterdir()} - {"manifest.json"}
        assert verify_checkpoint(checkpoint).ok
    # the CSV logger's file holds every logged step
    import csv

    with open(reference / "logs" / "csv" / "version_0" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss")]
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert float(rows[-1]["loss"]) == pytest.approx(losses[STEPS], rel=1e-6)


def test_sigkill_while_saving_and_at_a_step_then_resume_is_exact(reference, tmp_path):
    out = tmp_path / "out"
    keep = ("--train.keep_last_n", "2")
    # 1: killed as soon as the first checkpoint's temporary directory appears (mid-save)
    proc = start(out, "--resume", "auto", *keep)
    wait_for(lambda: any(out.glob(".tmp-step-*")), proc, poll=0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # 2: resumed, then killed again between steps
    proc = start(out, "--resume", "auto", *keep)
    reached = wait_for(lambda: max(logged_losses(out), default=0) >= 6, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert reached and not (out / "final").exists()
    run(out, "--resume", "auto", *keep)
    assert_same_run(out, reference)
    assert not list(out.glob(".tmp-*"))
    assert len([p for p in out.iterdir() if p.name.startswith("step-")]) == 2  # train.keep_last_n
    # three attempts; the first, killed while saving step 2, was trained again from step 0 by the second
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["attempt"] == 3 and records[0]["attempt"] == 2
    replayed = [json.loads(line) for line in (out / "metrics.superseded.jsonl").read_text().splitlines()]
    assert {r["step"] for r in replayed if "loss" in r and r["attempt"] == 1} == {1, 2}
    assert {r["attempt"] for r in replayed} <= {1, 2}


def test_tensorboard_shows_one_curve_after_a_kill_and_a_resume(reference, tmp_path):
    """SIGKILL after step 5 (the last checkpoint at step 4), then resumed: the resumed attempt writes into the
    same TensorBoard run, which drops the killed attempt's records of steps 5 and later; each step's loss
    appears once, equal to metrics.jsonl's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    tensorboard = ("--logger_name", "tensorboard")
    proc = start(out, *tensorboard)
    wait_for(lambda: max(logged_losses(out), default=0) >= 5, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run(out, "--resume", "auto", *tensorboard)
    assert_same_run(out, reference)
    assert [p.name for p in (out / "logs" / "tensorboard").iterdir()] == ["version_0"]
    events = EventAccumulator(str(out / "logs" / "tensorboard" / "version_0"))
    events.Reload()
    curve = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [step for step, _ in curve] == list(range(1, STEPS + 1))
    assert [value for _, value in curve] == pytest.approx([logged_losses(out)[step] for step in range(1, STEPS + 1)], rel=1e-6)


def test_sigterm_saves_and_exits_zero_then_resume_is_exact(reference, tmp_path):
    out = tmp_path / "out"
    proc = start(out)
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 0
    log = (tmp_path / "out.log").read_text()
    last_step = max(logged_losses(out))
    assert (f"Stopped by SIGTERM at step {last_step}: checkpoint saved in {out / f'step-{last_step:08d}'}; to continue, "
            "run the same command with --resume auto") in log
    assert last_step < STEPS and (out / f"step-{last_step:08d}" / "lit_model.pth").exists()
    assert not (out / "final").exists()
    run(out, "--resume", "auto")
    assert_same_run(out, reference)


def test_sigterm_to_the_whole_job_with_loader_workers_saves_and_resume_is_exact(reference_workers, tmp_path):
    """The DataLoader workers receive the scheduler's SIGTERM too: they leave it to the trainer, which
    checkpoints at the step reached and exits 0, without a traceback."""
    from fabric_lin.checkpoint import verify_checkpoint

    out = tmp_path / "out"
    proc = start(out, *LOADER_WORKERS)
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, proc)
    signal_job(proc, signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 0
    log = (tmp_path / "out.log").read_text()
    last_step = max(logged_losses(out))
    assert (f"Stopped by SIGTERM at step {last_step}: checkpoint saved in {out / f'step-{last_step:08d}'}; to continue, "
            "run the same command with --resume auto") in log
    assert "Traceback" not in log and "killed by signal" not in log
    assert verify_checkpoint(out / f"step-{last_step:08d}").ok and last_step < STEPS and not (out / "final").exists()
    run(out, *LOADER_WORKERS, "--resume", "auto")
    assert_same_run(out, reference_workers)


def test_sigterm_to_the_whole_job_while_saving_leaves_only_whole_checkpoints(reference_workers, tmp_path):
    """SIGTERM while a periodic checkpoint is being written, and again while the stop's own checkpoint is:
    each save completes, no `.tmp-` directory is left, every checkpoint verifies, and the run resumes exactly."""
    from fabric_lin.checkpoint import verify_checkpoint

    out = tmp_path / "out"
    proc = start(out, *LOADER_WORKERS, "--train.save_interval", "1")
    assert wait_for(lambda: any(out.glob(".tmp-step-*")), proc, poll=0.001)
    saving = {p.name for p in out.glob(".tmp-step-*")}
    signal_job(proc, signal.SIGTERM)
    # the stop's checkpoint: a save of a later step
    assert wait_for(lambda: bool({p.name for p in out.glob(".tmp-step-*")} - saving), proc, poll=0.001)
    signal_job(proc, signal.SIGTERM)
    assert proc.wait(timeout=TIMEOUT) == 0
    log = (tmp_path / "out.log").read_text()
    assert "Stopped by SIGTERM at step " in log and "Traceback" not in log
    assert not list(out.glob(".tmp-*"))
    steps = sorted(out.glob("step-*"))
    assert len(steps) >= 2 and all(verify_checkpoint(step).ok for step in steps)
    run(out, *LOADER_WORKERS, "--resume", "auto")
    assert_same_run(out, reference_workers)


def test_ctrl_c_saves_at_the_step_boundary_exits_130_then_resume_is_exact(reference_workers, tmp_path):
    from fabric_lin.checkpoint import verify_checkpoint

    out = tmp_path / "out"
    proc = start(out, *LOADER_WORKERS)
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, proc)
    ctrl_c(proc)
    assert proc.wait(timeout=TIMEOUT) == 130
    log = (tmp_path / "out.log").read_text()
    last_step = max(logged_losses(out))
    # said once (the DataLoader worker leaves Ctrl-C to the trainer), one line on how to continue, no traceback
    assert log.count("Ctrl-C: stopping with a checkpoint at the end of this step (Ctrl-C again to stop at once, without it)") == 1
    assert (f"Stopped by SIGINT at step {last_step}: checkpoint saved in {out / f'step-{last_step:08d}'}; to continue, "
            "run the same command with --resume auto") in log
    assert "Traceback" not in log
    assert verify_checkpoint(out / f"step-{last_step:08d}").ok and last_step < STEPS and not (out / "final").exists()
    run(out, *LOADER_WORKERS, "--resume", "auto")
    assert_same_run(out, reference_workers)


def test_ctrl_c_during_the_start_up_stops_before_the_first_step(tmp_path):
    """Nothing was trained yet (the start-up can take minutes where blocks are compiled): the run stops
    before its first step, with nothing to save, and exits 130."""
    out = tmp_path / "out"
    proc = start(out)
    log = tmp_path / "out.log"
    wait_for(lambda: "Seed set to" in log.read_text(), proc, poll=0.005)  # inside the handler's reach, before the loop
    ctrl_c(proc)
    assert proc.wait(timeout=TIMEOUT) == 130
    text = log.read_text()
    assert ("Stopped by SIGINT before the first step: nothing new to save; to continue, run the same command with "
            "--resume auto") in text
    assert "Traceback" not in text and not list(out.glob("step-*")) and not list(out.glob(".tmp-*"))
    assert not logged_losses(out)


def test_a_second_ctrl_c_stops_at_once_leaving_only_whole_checkpoints(reference, tmp_path):
    """Two Ctrl-C in a row stop inside a step; a second one while the first one's checkpoint is being written
    stops the save: either way no `.tmp-` directory is left, every checkpoint verifies, and the run
    resumes from the newest to the reference's end."""
    from fabric_lin.checkpoint import verify_checkpoint

    out = tmp_path / "out"

    def assert_only_whole_checkpoints(returncode: int, log_from: int) -> None:
        log = (tmp_path / "out.log").read_text()[log_from:]
        assert "Traceback" not in log
        # 130: the exit code of a command stopped by Ctrl-C; a shell shows the same for a process that a
        # Ctrl-C after Python's own handling had ended (its interpreter shutting down) ends
        assert returncode in (130, -signal.SIGINT)
        if returncode == 130:
            assert "fabric-lin pretrain: interrupted (a second Ctrl-C: stopped at once" in log
        assert not list(out.glob(".tmp-*"))
        steps = list(out.glob("step-*"))
        assert steps and all(verify_checkpoint(step).ok for step in steps)

    def first_ctrl_c_taken(log_from: int) -> bool:
        # a second SIGINT sent before the first is taken would merge with it (signals do not queue)
        return "Ctrl-C: stopping with a checkpoint" in (tmp_path / "out.log").read_text()[log_from:]

    proc = start(out)
    wait_for(lambda: max(logged_losses(out), default=0) >= 3, proc)
    ctrl_c(proc)
    assert wait_for(lambda: first_ctrl_c_taken(0), proc, poll=0.001)
    ctrl_c(proc)
    returncode = proc.wait(timeout=TIMEOUT)
    assert returncode == 130  # inside the step: the loop's handler took it
    assert_only_whole_checkpoints(returncode, 0)

    log_from = len((tmp_path / "out.log").read_text())
    logged = max(logged_losses(out))
    proc = start(out, "--resume", "auto")
    wait_for(lambda: max(logged_losses(out), default=0) > logged, proc)  # a step of this run
    ctrl_c(proc)
    assert wait_for(lambda: first_ctrl_c_taken(log_from), proc, poll=0.001)
    assert wait_for(lambda: any(out.glob(".tmp-step-*")), proc, poll=0.001)  # a checkpoint being written
    ctrl_c(proc)
    assert_only_whole_checkpoints(proc.wait(timeout=TIMEOUT), log_from)
    run(out, "--resume", "auto")
    assert_same_run(out, reference)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's compiler keeps its temporaries (ptxas's output, the "
                    "launcher it builds) in TMPDIR: 256 KiB breaks compiling for the GPU, before any save")
def test_saves_take_no_room_in_the_temporary_directory(reference, tmp_path):
    """TMPDIR on a file system of 256 KiB, smaller than one checkpoint of this run (25 MB): every save
    succeeds, so no checkpoint byte passes through it."""
    small = tmp_path / "small_tmp"
    out = tmp_path / "out"
    result = run_with_a_small_tmpfs(small, "256k", command(out), env=f"TMPDIR={small}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert_same_run(out, reference)
    assert (out / "step-00000002" / "lit_model.pth").stat().st_size > 256 * 1024


def test_a_full_disk_at_a_save_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path):
    """out_dir on a file system with room for one checkpoint (25 MB) of two: the second save fails with the file
    system's error in one line, naming the file; its .tmp- directory goes, the first checkpoint stays whole."""
    from fabric_lin.checkpoint import verify_checkpoint

    small, kept = tmp_path / "small", tmp_path / "kept"
    kept.mkdir()
    out = small / "out"
    result = run_with_a_small_tmpfs(small, "40m", command(out, "--train.max_steps", "2", "--train.save_interval", "1"),
                                    copy_to=kept)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.endswith(
        f"fabric-lin pretrain: error: [Errno 28] No space left on device: '{out / '.tmp-final' / 'lit_model.pth'}'\n"
    ), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (kept / "out").iterdir() if "step-" in p.name or "final" in p.name) == ["step-00000001"]
    assert verify_checkpoint(kept / "out" / "step-00000001").ok


def test_resume_past_a_damaged_checkpoint_is_exact(reference, tmp_path):
    """The newest checkpoint's lit_model.pth has one byte changed (same size, loadable): --resume auto says so,
    sets it aside and continues from the step before, ending as the reference does."""
    out = tmp_path / "out"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("final"))  # as if stopped after step 6
    path = out / "step-00000006" / "lit_model.pth"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    log = run(out, "--resume", "auto").stdout
    assert f"Warning: checkpoint {out / 'step-00000006'} is damaged: lit_model.pth's bytes changed since it was written" in log
    assert f"Set aside as {out / '.damaged-step-00000006'}" in log
    assert f"Warning: resuming from {out / 'step-00000004'}, the newest checkpoint that verifies" in log
    assert f"Resuming from {out / 'step-00000004'}" in log
    assert (out / ".damaged-step-00000006" / "lit_model.pth").read_bytes() == bytes(data)  # kept, never deleted
    assert_same_run(out, reference)


def test_a_second_fresh_run_into_the_same_out_dir_is_refused_in_one_line(reference, tmp_path):
    """README's quick-start command run again: out_dir holds the first run; nothing is touched."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    result = fabric_lin_process.run(command(out), TIMEOUT)
    assert result.returncode == 2
    assert result.stderr == (
        f"fabric-lin pretrain: error: out_dir {out} holds the checkpoints of an earlier run (final, step-00000002, "
        "step-00000004, ... (1 more)); a new run would put its own beside them. Continue that run with --resume auto, "
        "write this one to another --out_dir, or start afresh with --overwrite true (deletes those checkpoints)\n"
    )
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


def test_time_to_first_step_counts_from_pythons_start_behind_a_shell(tmp_path):
    """`bash -c "sleep 3; fabric-lin ..."` execs the last command in the shell's process, which keeps the
    shell's start time: the 3 seconds before Python started are not start-up."""
    import shlex

    out = tmp_path / "out"
    shell = "sleep 3; exec " + shlex.join(command(out, "--train.max_steps", "1"))  # exec: what bash does by itself here
    began = time.time()
    proc = subprocess.Popen(["bash", "-c", shell], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def first_step():
        path = out / "metrics.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        return next((r["time_to_first_step_s"] for r in records if "time_to_first_step_s" in r), None)

    wait_for(lambda: first_step() is not None, proc, poll=0.01)
    seen = time.time() - began  # sleep 3 + Python's start-up and first step (+ polling)
    assert proc.wait(timeout=TIMEOUT) == 0
    assert 0 < first_step() < seen - 2.5


def test_resume_from_final_trains_nothing(reference, tmp_path):
    result = run(reference, "--resume", "auto")
    assert "Nothing to train" in result.stdout + result.stderr
    assert "Saved checkpoint" not in result.stdout + result.stderr  # final/ is already the newest


def test_stopped_at_the_last_step_then_resume_writes_final(reference, tmp_path):
    """A signal during the last step saves step-<max_steps>/ and no final/: resuming finishes the run."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(reference / "final", out / f"step-{STEPS:08d}")
    result = run(out, "--resume", "auto", "--eval.final_validation", "true")
    log = result.stdout + result.stderr
    assert "Nothing to train" in log and f"Saved checkpoint {out / 'final'}" in log
    assert json.loads((out / "final" / "step.json").read_text())["step_count"] == STEPS
    assert any("val_loss" in json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines())
    a, b = final_weights(out), final_weights(reference)
    assert all(torch.equal(a[key], b[key]) for key in b)


def test_a_run_extended_past_its_final_resumes_from_its_newest_step(reference, tmp_path):
    """Raising max_steps after a finished run saves step-* directories newer than the old final/:
    --resume auto continues from the newest of them, not from final/."""
    longer = ("--train.max_steps", str(STEPS + 4), "--resume_changes", "[train.max_steps]")
    extended = tmp_path / "extended"  # the reference continued to STEPS + 4 without interruption
    run(extended, "--resume", str(reference / "final"), *longer)
    out = tmp_path / "out"  # the same continuation, stopped after step STEPS + 2
    shutil.copytree(reference, out)
    shutil.copytree(extended / f"step-{STEPS + 2:08d}", out / f"step-{STEPS + 2:08d}")
    result = run(out, "--resume", "auto", *longer)
    assert f"Resuming from {out / f'step-{STEPS + 2:08d}'}" in result.stdout + result.stderr
    a, b = final_weights(out), final_weights(extended)
    assert all(torch.equal(a[key], b[key]) for key in b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_train_as_kernel_launches_do_and_resume(tmp_path):
    """On one GPU compile.mode auto replays each compiled Block as a CUDA graph. Graph replays write into
    memory recorded once, so a buffer read after the next replay overwrote it would show here (as the first
    micro-batch's weight gradients did, with 2 micro-batches per step as here): the same run
    with kernels launched one by one must log the same losses, validation included, and a run resumed from
    a step checkpoint the same losses as the uninterrupted one (bf16-mixed; GPU reductions may reorder, so
    close rather than equal)."""
    gpu = ("--compile.cache", "false", "--eval.interval", "4", "--eval.initial_validation", "true",
           "--eval.final_validation", "true")
    graphs, launches, resumed = tmp_path / "graphs", tmp_path / "launches", tmp_path / "resumed"
    assert "mode reduce-overhead" in run(graphs, *gpu).stdout
    assert "mode default" in run(launches, *gpu, "--compile.mode", "default").stdout
    with_graphs, without = logged_losses(graphs), logged_losses(launches)
    assert sorted(with_graphs) == list(range(1, STEPS + 1)) and sorted(without) == sorted(with_graphs)
    for step in with_graphs:
        assert math.isfinite(with_graphs[step]) and abs(with_graphs[step] - without[step]) <= 2e-3 * without[step], step

    def val_losses(out_dir):
        return [r["val_loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines()) if "val_loss" in r]

    # before the first step (graphs recorded by validation first: no training step has marked one), at steps 4
    # and 8, and the final validation
    assert len(val_losses(graphs)) >= 3
    assert val_losses(graphs) == pytest.approx(val_losses(launches), rel=2e-3)
    resumed.mkdir()
    shutil.copytree(graphs / f"step-{4:08d}", resumed / f"step-{4:08d}")
    run(resumed, *gpu, "--resume", "auto")
    after = logged_losses(resumed)
    assert sorted(after) == list(range(5, STEPS + 1))
    assert [after[s] for s in after] == pytest.approx([with_graphs[s] for s in after], rel=1e-3)


def kill_tally(kills: int, workdir: Path, seed: int = 0) -> int:
    """`kills` trials: start a fresh run, SIGKILL it at a random moment, resume it with --resume auto to
    the end, and compare with the reference exactly. The moment: after a random number of logged steps
    (0 = during start-up) plus a random delay of up to 1.5 steps, so it falls on start-up, data loading,
    forward, backward, optimizer step or a checkpoint write whatever the machine's speed. A trial whose
    run finished before the kill is retried; only real kills count. An exact trial's run directory is
    removed once compared (each holds ~100 MB of checkpoints), a different one kept with its log.
    Returns the number of exact trials."""
    rng = random.Random(seed)
    reference = workdir / "reference"
    if reference.exists():
        shutil.rmtree(reference)
    # the reference run, timing its steps so that the random delays span about one step on this machine
    proc = start(reference)
    seen: Dict[int, float] = {}
    while proc.poll() is None:
        for step in logged_losses(reference):
            seen.setdefault(step, time.time())
        time.sleep(0.005)
    assert proc.returncode == 0 and (reference / "final").exists()
    times = [seen[s + 1] - seen[s] for s in range(1, STEPS) if s in seen and s + 1 in seen]
    step_seconds = sorted(times)[len(times) // 2] if times else 0.5
    print(f"reference: {step_seconds:.3f}s per step (median)", flush=True)
    exact = trial = 0
    mid_save = 0
    while trial < kills:
        out = workdir / f"trial{trial + 1:03d}"
        if out.exists():
            shutil.rmtree(out)
        after_step = rng.randint(0, STEPS - 1)
        delay = rng.uniform(0.0, 1.5 * step_seconds)
        proc = start(out)
        wait_for(lambda: max(logged_losses(out), default=0) >= after_step, proc)
        time.sleep(delay)
        saving = any(out.glob(".tmp-*"))
        if proc.poll() is not None:
            continue  # finished before the kill: not a kill point
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        trial += 1
        mid_save += saving
        killed_at = max(logged_losses(out), default=0)
        run(out, "--resume", "auto")
        try:
            assert_same_run(out, reference)
            exact += 1
            verdict = "exact"
            shutil.rmtree(out)
        except AssertionError as e:
            verdict = f"DIFFERENT: {e} (kept: {out})"
        where = "while saving a checkpoint" if saving else "between/inside steps"
        print(f"trial {trial}: killed after step {killed_at} (+{delay:.2f}s), {where}: {verdict}", flush=True)
    print(f"{exact}/{kills} exact ({mid_save} kills hit a checkpoint write)")
    return exact


if __name__ == "__main__":
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fabric-lin-kills-"))
    if kill_tally(args.kills, workdir) == args.kills and args.workdir is None:
        shutil.rmtree(workdir)  # a temporary directory with nothing left to inspect
    else:
        print(f"runs and logs in {workdir}")
