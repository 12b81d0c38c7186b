"""fabric_lin/metrics.py: tokens/s over each log interval and, in the summary, after the first step, with the time
paused for validation and saving left out (benchmarks/train_throughput.py reports these), and an ETA without the
first step's compilation; each step's record, the progress line's loss and MFU, and a validation's perplexity, of two
processes (also where their values differ); a resumed attempt's history: the records after its step superseded, a
line cut short by a kill left out (also inside the superseded file, or an empty superseded file), the attempt
numbered after every recorded one, its moves on disk before the rename; every record at its step, each step's once;
the CSV log written row by row and continued by a resume; a logger that cannot write at the end of a failed run. (End
to end, across kills and resumes: test_pretrain_resume.py.)"""
import json
import math
import shutil
import sys
import time
from types import SimpleNamespace

import lightning_fabric as L
import pytest
import torch

import fabric_lin.metrics as metrics_module
from fabric_lin.metrics import METRICS_FILE, SUPERSEDED_FILE, MetricsWriter, read_records


def writer_on_a_clock(tmp_path, monkeypatch, start_step: int, max_steps: int):
    """(a MetricsWriter of 100 tokens a step, started at `start_step`, the clock it reads: advance clock.now)."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=time.time, perf_counter=lambda: clock.now))
    writer = MetricsWriter(L.Fabric(accelerator="cpu", devices=1), tmp_path, max_steps=max_steps, tokens_per_step=100)
    writer.start(start_step, max_steps=max_steps)
    return writer, clock


def test_tokens_per_sec_counts_each_interval_and_leaves_validation_and_saving_out(tmp_path, monkeypatch):
    """Resumed at step 4, steps of 100 tokens and 1 s each, logged every 2 steps, with pauses of 3 s after step 5 and
    5 s after step 7: 100 tokens/s in each interval, and after the first step."""
    writer, clock = writer_on_a_clock(tmp_path, monkeypatch, start_step=4, max_steps=8)
    zero = torch.zeros(())
    for step in range(5, 9):
        clock.now += 1
        writer.add_step(step, zero, 1e-3, zero, zero.long())
        if step == 5:
            writer.log_first_step(step)
        if step % 2 == 0:
            writer.log_progress(step, 1e-3, zero, skipped_steps=0, tokens=step * 100)
        with writer.paused():
            clock.now += {5: 3, 7: 5}.get(step, 0)
    writer.log_summary(8, 800, writer.stop_clock())
    records = read_records(tmp_path / METRICS_FILE)
    assert [(r["step"], r["tokens_per_sec"]) for r in records if "tokens_per_sec" in r] == [(6, 100.0), (8, 100.0)]
    assert records[-1]["tokens_per_sec_after_first_step"] == 100.0


def test_a_resumed_attempt_supersedes_later_steps_past_a_line_cut_by_a_kill(tmp_path):
    """Attempt 1 logged steps 1-3 and was killed while writing step 4's line; attempt 2 resumed at step 2 and was
    killed after step 3; attempt 3 resumed at step 2 again and was killed before writing a record. The next one is
    numbered after attempt 2, whose records are in metrics.superseded.jsonl only (attempt 3 left no number to skip)."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    first = [{"step": step, "loss": 1.0, "attempt": 1} for step in (1, 2, 3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in first) + '{"step": 4, "lo')
    second = MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100)
    second.begin_attempt(2)
    assert read_records(tmp_path / METRICS_FILE) == first[:2] and read_records(tmp_path / SUPERSEDED_FILE) == first[2:]
    second.write({"step": 3, "loss": 0.5})
    third = MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100)
    third.begin_attempt(2)
    assert third.attempt == 3
    assert read_records(tmp_path / METRICS_FILE) == first[:2]
    assert read_records(tmp_path / SUPERSEDED_FILE) == [first[2], {"step": 3, "loss": 0.5, "attempt": 2}]
    fourth = MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100)
    fourth.begin_attempt(2)
    assert fourth.attempt == 3


class TwoProcessFabric:
    """What MetricsWriter asks of Fabric, as rank 0 of two processes that hold the same values (their mean is the
    value, their sum twice it); what it logs is kept."""

    global_rank, world_size, device, loggers = 0, 2, torch.device("cpu"), []

    def __init__(self):
        self.logged = []

    def all_reduce(self, tensor, reduce_op):
        return tensor * {"mean": 1, "sum": 2}[reduce_op]

    def log_dict(self, metrics, step):
        self.logged.append((step, metrics))

    def print(self, *args):
        pass


def test_two_processes_records_progress_line_and_validation(tmp_path, monkeypatch):
    """Each step's record: the loss averaged over the processes, the data fingerprint summed, lr and grad_norm as
    given. The progress line (steps of 100 tokens, 0.5 s each): the interval's last loss, 200 tokens/s, and MFU per
    device: 6 FLOPs a token x 200 tokens/s over 2 devices of 1000 FLOP/s = 0.6. A validation's perplexity is e to
    its loss."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=time.time, perf_counter=lambda: clock.now))
    fabric = TwoProcessFabric()
    writer = MetricsWriter(fabric, tmp_path, max_steps=2, tokens_per_step=100, flops_per_token=6.0, peak_flops=1000.0)
    writer.start(0, max_steps=2)
    for step, loss in ((1, 3.0), (2, 2.0)):
        clock.now += 0.5
        writer.add_step(step, torch.tensor(loss), 1e-3 * step, torch.tensor(0.5 * step), torch.tensor(7 * step))
    writer.log_progress(2, 2e-3, torch.tensor(1.0), skipped_steps=0, tokens=200)
    writer.log_validation(2, (2.0, 640))
    records = read_records(tmp_path / METRICS_FILE)
    assert [(r["step"], r["loss"], r["lr"], r["grad_norm"], r["data_fingerprint"]) for r in records if "loss" in r] == [
        (1, 3.0, 1e-3, 0.5, 14), (2, 2.0, 2e-3, 1.0, 28)]
    (step, progress), validation = fabric.logged[0], fabric.logged[1][1]
    assert step == 2 and progress["loss"] == 2.0 and progress["tokens_per_sec"] == 200.0
    assert progress["mfu"] == pytest.approx(0.6)
    assert validation == {"val_loss": 2.0, "val_ppl": pytest.approx(math.exp(2.0))}
    assert records[-1]["val_ppl"] == pytest.approx(math.exp(2.0)) and records[-1]["val_tokens"] == 640


class UnequalTwoProcessFabric(TwoProcessFabric):
    """Rank 0 of two processes whose values differ: the other one holds `peer`'s losses and data fingerprints."""

    def __init__(self, peer):
        super().__init__()
        self.peer = peer

    def all_reduce(self, tensor, reduce_op):
        other = torch.tensor(self.peer[reduce_op], dtype=tensor.dtype)
        return (tensor + other) / 2 if reduce_op == "mean" else tensor + other


def test_each_step_s_loss_is_the_mean_of_the_processes_and_its_fingerprint_their_sum(tmp_path):
    """Losses 3 and 2 here and 5 and 1 on the other process: steps 1 and 2 record 4 and 1.5, and the progress line the
    last of them; data fingerprints 7 and 14 here and 1 and 2 there: 8 and 16."""
    fabric = UnequalTwoProcessFabric({"mean": [5.0, 1.0], "sum": [1, 2]})
    writer = MetricsWriter(fabric, tmp_path, max_steps=2, tokens_per_step=100)
    writer.start(0, max_steps=2)
    for step, loss in ((1, 3.0), (2, 2.0)):
        writer.add_step(step, torch.tensor(loss), 1e-3, torch.tensor(1.0), torch.tensor(7 * step))
    writer.log_progress(2, 1e-3, torch.tensor(1.0), skipped_steps=0, tokens=200)
    records = read_records(tmp_path / METRICS_FILE)
    assert [(r["step"], r["loss"], r["data_fingerprint"]) for r in records if "loss" in r] == [(1, 4.0, 8), (2, 1.5, 16)]
    assert fabric.logged[0][1]["loss"] == 1.5


def test_records_moved_after_a_line_cut_inside_the_superseded_file_are_all_kept(tmp_path):
    """A kill cut a record being moved to metrics.superseded.jsonl; the next attempt's moves start on a line of their
    own, so none of them is lost with the cut one."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    records = [{"step": s, "loss": 1.0, "attempt": 1} for s in (1, 2, 3, 4)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / SUPERSEDED_FILE).write_text('{"step": 5, "loss": 1.0, "attempt": 1}\n{"step": 6, "lo')
    MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100).begin_attempt(2)
    assert read_records(tmp_path / SUPERSEDED_FILE) == [{"step": 5, "loss": 1.0, "attempt": 1}, *records[2:]]
    assert read_records(tmp_path / METRICS_FILE) == records[:2]


def test_a_line_cut_inside_the_superseded_file_hides_no_record_after_it(tmp_path):
    """A kill cut a record being moved to metrics.superseded.jsonl; the next attempt's moves were appended after it
    (the first one onto the cut line), then attempt 2's. The next attempt is numbered after attempt 2."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps({"step": s, "loss": 1.0, "attempt": 1}) + "\n" for s in (1, 2)))
    (tmp_path / SUPERSEDED_FILE).write_text(
        '{"step": 3, "loss": 1.0, "attempt": 1}\n{"step": 4, "lo{"step": 3, "loss": 1.0, "attempt": 1}\n'
        '{"step": 4, "loss": 0.9, "attempt": 1}\n{"step": 3, "loss": 0.8, "attempt": 2}\n')
    writer = MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100)
    writer.begin_attempt(2)
    assert writer.attempt == 3


def test_an_empty_superseded_file_left_by_a_kill_takes_the_next_moves(tmp_path):
    """A kill (or a full disk) after metrics.superseded.jsonl was made and before its first record was in it leaves the
    file empty: the next resume moves its records into it as into a new one."""
    records = [{"step": s, "loss": 1.0, "attempt": 1} for s in (1, 2, 3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / SUPERSEDED_FILE).write_text("")
    writer = MetricsWriter(L.Fabric(accelerator="cpu", devices=1), tmp_path, max_steps=8, tokens_per_step=100)
    writer.begin_attempt(1)
    assert writer.attempt == 2
    assert read_records(tmp_path / METRICS_FILE) == records[:1] and read_records(tmp_path / SUPERSEDED_FILE) == records[1:]


def test_a_logger_that_cannot_write_at_the_end_of_a_failed_run_hides_not_why_it_failed(tmp_path, capsys):
    """A run that failed (a full disk) closes its logger, whose last write may fail too: that failure is told as
    a warning, and the run's own error is the one raised. After a run that succeeded, it is the error."""
    from lightning_fabric.loggers import CSVLogger

    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[CSVLogger(tmp_path / "logs", name="csv")])
    writer = MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100)
    fabric.log_dict({"loss": 1.0}, step=1)  # kept in memory until the logger is closed
    version_dir = tmp_path / "logs" / "csv" / "version_0"
    shutil.rmtree(version_dir)
    version_dir.write_text("")  # where the logger writes its metrics.csv: it cannot
    writer.close("failed")
    assert (f"Warning: the CSVLogger could not write its last records: [Errno 20] Not a directory: "
            f"'{version_dir / 'metrics.csv'}'") in capsys.readouterr().out
    with pytest.raises(NotADirectoryError):
        writer.close("success")


def test_every_record_is_at_its_step_and_each_step_s_record_written_once(tmp_path):
    """Two progress lines (steps 1-2, then 3-4), a validation and a checkpoint at step 4: metrics.jsonl holds the loss
    of each step once, and every record and every logged value carries the step it was measured at."""
    fabric = TwoProcessFabric()
    writer = MetricsWriter(fabric, tmp_path, max_steps=4, tokens_per_step=100)
    writer.start(0, max_steps=4)
    for step in range(1, 5):
        writer.add_step(step, torch.tensor(float(step)), 1e-3, torch.tensor(1.0), torch.tensor(step))
        if step == 1:
            writer.log_first_step(step)
        if step % 2 == 0:
            writer.log_progress(step, 1e-3, torch.tensor(1.0), skipped_steps=0, tokens=step * 100)
    writer.log_validation(4, (2.0, 640))
    writer.log_checkpoint(4, "step-00000004")
    records = read_records(tmp_path / METRICS_FILE)
    assert [(r["step"], r["loss"]) for r in records if "loss" in r] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert [r["step"] for r in records if "time_to_first_step_s" in r] == [1]
    assert [r["step"] for r in records if "tokens_per_sec" in r] == [2, 4]
    assert [r["step"] for r in records if "val_loss" in r] == [4]
    assert [(r["step"], r["checkpoint"]) for r in records if "checkpoint" in r] == [(4, "step-00000004")]
    assert [(step, sorted(logged)) for step, logged in fabric.logged if "loss" not in logged] == [
        (1, ["time_to_first_step_s"]), (4, ["val_loss", "val_ppl"])]
    assert [step for step, logged in fabric.logged if "loss" in logged] == [2, 4]


def test_a_resumed_attempt_makes_its_moves_durable_before_the_rename(tmp_path, monkeypatch):
    """A crash of the machine while a resumed attempt rewrites metrics.jsonl loses no record: the superseded records
    are on disk first, then the rewritten history, and only then is it renamed over metrics.jsonl."""
    import os

    from fabric_lin.metrics import REWRITE_FILE

    records = [{"step": s, "loss": 1.0, "attempt": 1} for s in (1, 2, 3)]
    (tmp_path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(src), os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(metrics_module.os, "fsync", fsync)
    monkeypatch.setattr(metrics_module.os, "replace", replace)
    MetricsWriter(L.Fabric(accelerator="cpu", devices=1), tmp_path, max_steps=8, tokens_per_step=100).begin_attempt(1)
    assert events == [("fsync", SUPERSEDED_FILE), ("fsync", REWRITE_FILE), ("rename", REWRITE_FILE, METRICS_FILE)]
    assert read_records(tmp_path / METRICS_FILE) == records[:1] and read_records(tmp_path / SUPERSEDED_FILE) == records[1:]


def test_the_csv_log_is_on_disk_as_it_goes_and_a_resume_writes_on_in_it_from_its_step(tmp_path):
    """Attempt 1 validates at steps 2, 4 and 6 and is killed (its logger never closed) while writing a row; attempt 2
    resumes at step 4 and validates at 6 and 8. Each row was in metrics.csv as soon as it was logged, and the run's one
    metrics.csv holds each step once, with the values metrics.jsonl keeps: attempt 1's through step 4, then attempt 2's."""
    import csv

    from fabric_lin.metrics import make_logger

    def attempt(continuing: bool):
        fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[make_logger("csv", tmp_path, {}, continuing)])
        return MetricsWriter(fabric, tmp_path, max_steps=8, tokens_per_step=100)

    def csv_rows():
        with open(tmp_path / "logs" / "csv" / "version_0" / "metrics.csv", newline="") as f:
            return [(int(row["step"]), float(row["val_loss"])) for row in csv.DictReader(f)]

    first = attempt(continuing=False)
    first.begin_attempt(0)
    for step in (2, 4, 6):
        first.log_validation(step, (10.0 - step, 64))
        assert csv_rows()[-1] == (step, 10.0 - step)
    with open(tmp_path / "logs" / "csv" / "version_0" / "metrics.csv", "a") as f:
        f.write("8,")  # the row a kill cut short
    second = attempt(continuing=True)
    second.begin_attempt(4)
    for step in (6, 8):
        second.log_validation(step, (5.0 - step / 2, 64))
    second.close("success")
    assert [p.name for p in (tmp_path / "logs" / "csv").iterdir()] == ["version_0"]
    kept = [(r["step"], r["val_loss"]) for r in read_records(tmp_path / METRICS_FILE)]
    assert csv_rows() == kept == [(2, 8.0), (4, 6.0), (6, 2.0), (8, 1.0)]


def test_the_eta_leaves_out_the_first_steps_compilation(tmp_path, monkeypatch, capsys):
    """A first step of 100 s (compilation, warm-up), then steps of 1 s and a validation of 2 s after step 5: at step 10
    of 100 the 90 steps left take 90 s, and a validation of 2 s every 9 steps 20 s more (the time after the first step
    per step, 11 s over 9 steps), not the first step's 100 s spread over every step left (16 minutes)."""
    writer, clock = writer_on_a_clock(tmp_path, monkeypatch, start_step=0, max_steps=100)
    zero = torch.zeros(())
    for step in range(1, 11):
        clock.now += 100 if step == 1 else 1
        writer.add_step(step, zero, 1e-3, zero, zero.long())
        if step == 1:
            writer.log_first_step(step)
        with writer.paused():
            clock.now += 2 if step == 5 else 0
    capsys.readouterr()
    writer.log_progress(10, 1e-3, zero, skipped_steps=0, tokens=1000)
    assert capsys.readouterr().out.rstrip().endswith(f"| ETA {metrics_module.format_seconds(90 * 11 / 9)}")


@pytest.mark.parametrize("logger,modules,package", [
    ("tensorboard", ["tensorboard", "tensorboardX", "torch.utils.tensorboard"], "tensorboard"),
    ("wandb", ["wandb", "wandb.integration.lightning.fabric"], "wandb"),
])
def test_a_logger_whose_package_is_missing_is_named_before_the_run_starts(tmp_path, capsys, monkeypatch, logger, modules,
                                                                           package):
    """Without tensorboard (nor tensorboardX) the run built its data and model, then failed at its first record with
    Lightning's traceback ("you tried to log -1 which is currently not supported"); wandb's was named already. Both are
    one line before any work, and leave no out_dir."""
    from helpers import cli_error

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--logger_name", logger], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: logger_name={logger} needs the {package} package: pip install "
                          f"{package}, or --logger_name csv ("), err
    assert not (tmp_path / "out").exists()


def test_only_the_first_process_writes_and_rewrites_the_history(tmp_path):
    """Every process reports through a MetricsWriter; metrics.jsonl is rank 0's alone: another rank neither appends its
    records (each would be there once per process) nor rewrites the history on a resume (two processes moving the same
    records would write them twice into metrics.superseded.jsonl)."""
    history = "".join(json.dumps({"step": s, "loss": 1.0, "attempt": 1}) + "\n" for s in (1, 2, 3))
    (tmp_path / METRICS_FILE).write_text(history)
    fabric = TwoProcessFabric()
    fabric.global_rank = 1
    writer = MetricsWriter(fabric, tmp_path, max_steps=4, tokens_per_step=100)
    writer.begin_attempt(1)
    writer.log_checkpoint(2, "step-00000002")
    writer.log_validation(2, (2.0, 640))
    assert (tmp_path / METRICS_FILE).read_text() == history and not (tmp_path / SUPERSEDED_FILE).exists()


def test_a_run_without_validation_data_or_with_a_diverged_validation_loss_goes_on(tmp_path):
    """No validation data (None) logs nothing; a validation loss of 1000 (a diverged run) is logged with a finite, huge
    perplexity: e^1000 overflows a float, and the run must not end on its log line."""
    writer = MetricsWriter(TwoProcessFabric(), tmp_path, max_steps=4, tokens_per_step=100)
    writer.log_validation(3, None)
    writer.log_validation(4, (1000.0, 640))
    (record,) = read_records(tmp_path / METRICS_FILE)
    assert record["step"] == 4 and record["val_loss"] == 1000.0
    assert math.isfinite(record["val_ppl"]) and record["val_ppl"] > 1e40


def test_a_csv_row_cut_inside_its_step_is_left_out(tmp_path):
    """A kill cut the CSV row of step 12 after its first digit: read back on resume, "1" is no row of step 1."""
    import csv

    from fabric_lin.metrics import make_logger

    def attempt(continuing: bool):
        fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[make_logger("csv", tmp_path, {}, continuing)])
        return MetricsWriter(fabric, tmp_path, max_steps=12, tokens_per_step=100)

    first = attempt(continuing=False)
    first.begin_attempt(0)
    for step in (2, 4):
        first.log_validation(step, (10.0 - step, 64))
    metrics_csv = tmp_path / "logs" / "csv" / "version_0" / "metrics.csv"
    with open(metrics_csv, "a") as f:
        f.write("1")
    second = attempt(continuing=True)
    second.begin_attempt(4)
    second.log_validation(6, (1.0, 64))
    second.close("success")
    with open(metrics_csv, newline="") as f:
        assert [(row["step"], row["val_loss"]) for row in csv.DictReader(f)] == [("2", "8.0"), ("4", "6.0"), ("6", "1.0")]


def test_a_start_from_step_0_after_an_attempt_that_saved_no_checkpoint_supersedes_all_its_records(tmp_path):
    """Attempt 1 validated at step 0 and trained steps 1 and 2, then was killed before its first checkpoint; `--resume
    auto` finds none and starts again from step 0 (in the same CSV version), validating step 0 again. The history holds
    step 0 once, attempt 2's, in metrics.jsonl and in metrics.csv; attempt 1's records are all in the superseded
    file."""
    import csv

    from fabric_lin.metrics import make_logger

    def attempt(continuing: bool):
        fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[make_logger("csv", tmp_path, {}, continuing)])
        return MetricsWriter(fabric, tmp_path, max_steps=4, tokens_per_step=100)

    first = attempt(continuing=False)
    first.begin_attempt(0)
    first.log_validation(0, (8.0, 64))
    first.write({"step": 1, "loss": 7.0}, {"step": 2, "loss": 6.5})
    second = attempt(continuing=True)
    second.begin_attempt(0)
    second.log_validation(0, (8.5, 64))
    second.close("success")
    assert [(r["step"], r["attempt"]) for r in read_records(tmp_path / METRICS_FILE)] == [(0, 2)]
    assert [(r["step"], r["attempt"]) for r in read_records(tmp_path / SUPERSEDED_FILE)] == [(0, 1), (1, 1), (2, 1)]
    with open(tmp_path / "logs" / "csv" / "version_0" / "metrics.csv", newline="") as f:
        assert [(row["step"], row["val_loss"]) for row in csv.DictReader(f)] == [("0", "8.5")]


def test_seconds_are_shown_as_hours_minutes_and_seconds():
    assert metrics_module.format_seconds(3725.4) == "1:02:05"
    assert metrics_module.format_seconds(59.6) == "0:01:00"
    assert metrics_module.format_seconds(90061) == "25:01:01"
