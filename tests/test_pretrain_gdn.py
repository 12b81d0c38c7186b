"""End to end on the CPU: `fabric-lin pretrain` of the Gated DeltaNet debug recipe (config_hub/debug_gdn.yaml,
cut to a few steps) as a subprocess. The loss falls; a run killed with SIGKILL after a checkpoint and resumed
with `--resume auto` logs the same loss and data at every step and ends with the same weights, bit for bit."""
import json
import signal
import time
from pathlib import Path

import pytest
import torch

import fabric_lin_process
from helpers import CONFIG_HUB, final_weights, pretrain_command, run_ok

pytestmark = pytest.mark.slow

STEPS = 8
SHORT = [
    "--config", str(CONFIG_HUB / "debug_gdn.yaml"),
    "--train.max_steps", str(STEPS), "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
    "--train.max_seq_length", "96", "--train.lr_warmup_steps", "2", "--train.save_interval", "2",
    "--eval.interval", "1000", "--eval.max_iters", "1", "--eval.initial_validation", "false",
    "--eval.final_validation", "false",
]
TIMEOUT = 300


def command(out_dir: Path, *extra: str):
    return [*pretrain_command(out_dir, *SHORT), *extra]


def losses(out_dir: Path) -> dict:
    found = {}
    path = out_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by SIGKILL
            continue
        if "loss" in record:
            found[record["step"]] = (record["loss"], record["data_fingerprint"])
    return found


def test_gdn_debug_recipe_learns_and_resumes_bit_exact_after_sigkill(tmp_path):
    reference = tmp_path / "reference"
    run_ok(command(reference), TIMEOUT)
    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert expected[STEPS][0] < expected[1][0] - 0.5  # it learns
    weights = final_weights(reference)
    assert any(".attn.A_log" in name for name in weights) and any("q_conv1d" in name for name in weights)

    out = tmp_path / "killed"
    out.mkdir()
    proc = fabric_lin_process.start(command(out, "--resume", "auto"), tmp_path / "killed.log")
    deadline = time.time() + TIMEOUT
    while not (out / "step-00000004" / "lit_model.pth").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "step-00000004").is_dir() and not (out / "final").exists()
    run_ok(command(out, "--resume", "auto"), TIMEOUT)
    assert losses(out) == expected  # the same loss (exact) and the same batches at every step
    resumed = final_weights(out)
    assert resumed.keys() == weights.keys()
    for name in weights:
        assert torch.equal(resumed[name], weights[name]), name
