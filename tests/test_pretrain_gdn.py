"""End to end on the CPU: `fabric-lin pretrain` of the Gated DeltaNet debug recipe (config_hub/debug_gdn.yaml,
cut to a few steps) as a subprocess. The loss falls; a run killed with SIGKILL after a checkpoint and resumed
with `--resume auto` logs the same loss and data at every step and ends with the same weights, bit for bit."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
SHORT = [
    "--config", str(ROOT / "config_hub" / "debug_gdn.yaml"),
    "--train.max_steps", str(STEPS), "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
    "--train.max_seq_length", "96", "--train.lr_warmup_steps", "2", "--train.save_interval", "2",
    "--eval.interval", "1000", "--eval.max_iters", "1", "--eval.initial_validation", "false",
    "--eval.final_validation", "false",
]
TIMEOUT = 300


def command(out_dir: Path, *extra: str):
    return [sys.executable, "-m", "fabric_lin.cli", "pretrain", *SHORT, "--out_dir", str(out_dir), *extra]


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


def final_weights(out_dir: Path) -> dict:
    return torch.load(out_dir / "final" / "lit_model.pth", map_location="cpu", weights_only=True)["model"]


def test_gdn_debug_recipe_learns_and_resumes_bit_exact_after_sigkill(tmp_path):
    reference = tmp_path / "reference"
    result = subprocess.run(command(reference), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected = losses(reference)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert expected[STEPS][0] < expected[1][0] - 0.5  # it learns
    weights = final_weights(reference)
    assert any(".attn.A_log" in name for name in weights) and any("q_conv1d" in name for name in weights)

    out = tmp_path / "killed"
    out.mkdir()
    log = open(tmp_path / "killed.log", "wb")
    proc = subprocess.Popen(command(out, "--resume", "auto"), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + TIMEOUT
    while not (out / "step-00000004" / "lit_model.pth").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "step-00000004").is_dir() and not (out / "final").exists()
    result = subprocess.run(command(out, "--resume", "auto"), capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert losses(out) == expected  # the same loss (exact) and the same batches at every step
    resumed = final_weights(out)
    assert resumed.keys() == weights.keys()
    for name in weights:
        assert torch.equal(resumed[name], weights[name]), name


@pytest.mark.parametrize("name", ["gdn_340M", "gdn_1B"])
def test_gdn_recipes_are_flames_340M_recipe(name):
    from test_pretrain import parse_run_config

    from fabric_lin.config import Config

    cfg = parse_run_config(ROOT / "config_hub" / f"{name}.yaml")
    train, opt = cfg.train, cfg.optimizer
    assert Config.from_name(cfg.model_name).block_type == "gdn"
    assert train.global_batch_size * train.max_seq_length == 524_288
    train.gradient_accumulation_iters(devices=8, num_nodes=1)
    assert tuple(opt.betas) == (0.9, 0.95) and opt.weight_decay == 0.01 and train.max_norm == 1.0
    assert train.min_lr == pytest.approx(0.1 * opt.lr)
    if name == "gdn_340M":
        assert (train.total_steps(), train.lr_warmup_steps, opt.lr) == (20480, 1024, 3e-4)
        assert type(cfg.data).__name__ == "SlimPajamaStarcoder" and cfg.data.use_starcoder


def test_gdn_debug_recipe_runs_on_cpu_defaults():
    from test_pretrain import parse_run_config

    cfg = parse_run_config(ROOT / "config_hub" / "debug_gdn.yaml")
    assert cfg.model_name == "gdn-debug" and type(cfg.data).__name__ == "SampleCorpus"
    assert cfg.precision == "32-true" and cfg.compile.enabled is False and cfg.devices == 1
