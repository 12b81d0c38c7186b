"""benchmarks/learning_parity.py on the CPU with a debug model (its comparisons with fla and FP8 need a GPU): the
fp32 yardstick's sequence-at-a-time step is the whole batch's step, the report's differences are those of its own
per-step losses, the reference-bf16 peer trains as ours does, and a peer that cannot run on the CPU is refused
before anything is built."""
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import learning_parity  # noqa: E402

from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402


def one_layer(name: str, **overrides) -> Config:
    """The debug model cut to one layer: the CPU reference ops' cost is per layer."""
    return Config.from_name(name, **{"num_layers": 1, **overrides})


def test_the_fp32_step_a_sequence_at_a_time_is_the_whole_batch_step():
    torch.manual_seed(0)
    config = one_layer("gla-debug")
    model, whole = GPT(config), GPT(config)
    whole.load_state_dict(model.state_dict())
    batch = torch.randint(0, config.vocab_size, (3, 33))
    # SGD without clipping: the update is the gradient itself (AdamW's or clipping would hide its scale)
    trainee = learning_parity.Trainee("fp32", model, torch.optim.SGD(model.parameters(), lr=1.0), fp32=True,
                                      max_norm=float("inf"))
    loss = trainee.step(batch, lr=1.0)

    # the reference: one loss over the whole batch, one backward, the same update
    expected = whole(batch[:, :-1], targets=batch[:, 1:])
    expected.backward()
    torch.optim.SGD(whole.parameters(), lr=1.0).step()
    assert loss == pytest.approx(expected.item(), rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_a_cpu_run_against_the_reference_peers_reports_the_differences_of_its_own_losses(tmp_path, monkeypatch):
    monkeypatch.setattr(learning_parity, "Config", SimpleNamespace(from_name=one_layer))
    report = learning_parity.main(["--model", "gla-debug", "--peers", "fp32", "reference-bf16", "--data", "sample",
                                   "--steps", "3", "--batch_size", "2", "--seq_len", "32", "--warmup", "1",
                                   "--lr", "1e-2", "--out", str(tmp_path / "parity.json")])
    rows = report["per_step"]
    assert [r["step"] for r in rows] == [0, 1, 2] and report["stopped_at_step"] is None
    ours, fp32 = [r["loss"]["ours"] for r in rows], [r["loss"]["fp32"] for r in rows]
    # the same weights: the first step's losses differ by bf16's rounding only; then both models learn
    assert ours[0] == pytest.approx(fp32[0], rel=2e-2) and ours[0] != fp32[0]
    assert fp32[-1] < fp32[0] and ours[-1] < ours[0]
    diffs = [abs(a - b) / b for a, b in zip(ours, fp32)]
    summary = report["ours_against"]["fp32"]
    assert summary["median_relative_difference"] == pytest.approx(statistics.median(diffs))
    assert summary["share_of_steps_ours_lower"] == sum(a < b for a, b in zip(ours, fp32)) / 3
    assert report["against_fp32"]["ours"] == summary
    # on the CPU ours runs on the reference ops too, in the same bf16 autocast: reference-bf16 computes exactly what
    # ours does (a peer from other weights, stepped otherwise or in fp32 would not)
    assert [r["loss"]["reference-bf16"] for r in rows] == ours
    assert report["ours_against"]["reference-bf16"]["median_relative_difference"] == 0.0
    assert report["against_fp32"]["reference-bf16"]["median_relative_difference"] == summary["median_relative_difference"]
    assert (tmp_path / "parity.json").is_file()
    # each model's time per step, the first (compiling) apart from the steady state
    assert all(set(r["seconds"]) == {"ours", "fp32", "reference-bf16"} and min(r["seconds"].values()) > 0 for r in rows)
    assert report["first_step_seconds"] == rows[0]["seconds"]
    assert report["median_step_seconds"]["fp32"] == statistics.median([rows[1]["seconds"]["fp32"], rows[2]["seconds"]["fp32"]])


def test_peers_that_need_a_gpu_are_refused_on_the_cpu():
    with pytest.raises(SystemExit, match="--peers fla fp32: on the CPU only fp32 and reference-bf16 run"):
        learning_parity.main(["--model", "gla-debug", "--peers", "fla", "fp32", "--device", "cpu"])
