"""benchmarks/train_throughput.py's report, from measurements made up here (the measurements themselves need a GPU):
its default run (both regimes and the data loader, fla measured) writes its report, and every ratio in it sets a
measurement against one of the same regime - regime (a) against fla's regime (a), real loop against real loop -,
never the data loader."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import train_throughput  # noqa: E402


def step(tokens_per_s: int, peak_memory_gib: float, ms_per_step: float = 1000.0) -> dict:
    """What a training measurement (regime (a) or the real loop) reports."""
    return {"model": "a model", "tokens_per_s": tokens_per_s, "ms_per_step": ms_per_step,
            "peak_memory_gib": peak_memory_gib, "mfu": 0.3, "first_step_s": 9.0, "final_loss": 10.4}


# what the data-loader regime reports: tokens/s it can deliver, and no peak memory
LOADER = {"model": "data loader alone (benchmark corpus, 4 workers)", "batches": 200, "tokens_per_s": 5_000_000,
          "fetch wait with the host busy 50 ms between fetches, ms": {"median": 0.1, "p90": 0.2, "max": 3.0,
                                                                       "fetches over 20 ms": 0}}


def test_the_default_run_writes_its_report_with_like_for_like_ratios(tmp_path, monkeypatch, capsys):
    measurements = {
        "bf16-weights/fabric-lin": step(30_000, 12.0), "bf16-weights/fla": step(20_000, 16.0),
        "bf16-weights/transformer": step(25_000, 20.0),
        "real-loop/fabric-lin": step(28_000, 14.0), "real-loop/transformer": step(24_000, 21.0),
        "data-loader/fabric-lin": LOADER,
    }
    monkeypatch.setattr(train_throughput, "run_isolated", lambda regime, key, args: measurements[f"{regime}/{key}"])
    out = tmp_path / "train.json"
    monkeypatch.setattr(sys, "argv", ["benchmarks/train_throughput.py", "--out", str(out)])
    train_throughput.main()
    report = json.loads(out.read_text())
    assert report["results"] == measurements  # the defaults: three models, both regimes and the data loader
    assert report["ratios"] == {
        "bf16-weights/fabric-lin tokens/s vs fla (a)": 1.5, "bf16-weights/fabric-lin peak memory vs fla (a)": 0.75,
        "bf16-weights/transformer tokens/s vs fla (a)": 1.25, "bf16-weights/transformer peak memory vs fla (a)": 1.25,
    }


def test_each_ratio_sets_a_measurement_against_one_of_its_own_regime():
    results = {
        "bf16-weights/fabric-lin": step(30_000, 12.0, 1000.0),
        "bf16-weights/fabric-lin-tuned": step(32_000, 12.0, 800.0),
        "bf16-weights/fabric-lin-compiled": step(34_000, 11.2),
        "bf16-weights/fabric-lin-fp8": step(40_800, 8.8),
        "bf16-weights/fla": step(20_000, 16.0),
        "bf16-weights/gdn": step(18_000, 20.0),
        "bf16-weights/fla-gdn": {"model": "flash-linear-attention GatedDeltaNetForCausalLM 340M", "skipped": "out of memory"},
        "real-loop/fabric-lin": step(28_000, 14.0, 1100.0),
        "real-loop/fabric-lin-static": step(29_000, 14.0, 1000.0),
        "real-loop/fabric-lin-fp8": step(35_000, 10.5),
        "data-loader/fabric-lin": LOADER,
    }
    assert train_throughput.like_for_like_ratios(results) == {
        # regime (a) against fla's GLA in regime (a); GDN's peer was not measured
        "bf16-weights/fabric-lin tokens/s vs fla (a)": 1.5, "bf16-weights/fabric-lin peak memory vs fla (a)": 0.75,
        "bf16-weights/fabric-lin-tuned tokens/s vs fla (a)": 1.6, "bf16-weights/fabric-lin-tuned peak memory vs fla (a)": 0.75,
        "bf16-weights/fabric-lin-compiled tokens/s vs fla (a)": 1.7,
        "bf16-weights/fabric-lin-compiled peak memory vs fla (a)": 0.7,
        "bf16-weights/fabric-lin-fp8 tokens/s vs fla (a)": 2.04, "bf16-weights/fabric-lin-fp8 peak memory vs fla (a)": 0.55,
        # step times and FP8 within a regime
        "shipped launch table vs searched (a), ms/step": 1.25,
        "dynamic shapes vs specialised (b), ms/step": 1.1,
        "FP8 tensorwise vs bf16 (a, compiled), tokens/s": 1.2, "FP8 tensorwise vs bf16 (a, compiled), peak memory": 0.786,
        "FP8 tensorwise vs bf16 (b), tokens/s": 1.25, "FP8 tensorwise vs bf16 (b), peak memory": 0.75,
    }
