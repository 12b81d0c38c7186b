"""fabric_lin/metrics.py: tokens/s over each log interval and, in the summary, after the first step, with the time
paused for validation and saving left out (benchmarks/train_throughput.py reports these); a resumed attempt's
history: the records after its step superseded, a line cut short by a kill left out, the attempt numbered after
every recorded one. (End to end, across kills and resumes: test_pretrain_resume.py.)"""
import json
import time
from types import SimpleNamespace

import lightning_fabric as L
import torch

import fabric_lin.metrics as metrics_module
from fabric_lin.metrics import METRICS_FILE, SUPERSEDED_FILE, MetricsWriter, read_records


def test_tokens_per_sec_counts_each_interval_and_leaves_validation_and_saving_out(tmp_path, monkeypatch):
    """Resumed at step 4, steps of 100 tokens and 1 s each, logged every 2 steps, with pauses of 3 s after step 5 and
    5 s after step 7: 100 tokens/s in each interval, and after the first step."""
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(metrics_module, "time", SimpleNamespace(time=time.time, perf_counter=lambda: clock.now))
    writer = MetricsWriter(L.Fabric(accelerator="cpu", devices=1), tmp_path, max_steps=8, tokens_per_step=100)
    writer.start(4, max_steps=8)
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
