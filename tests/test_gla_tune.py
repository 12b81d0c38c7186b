"""The opt-in launch search (fabric_lin/ops/gla/tune.py): it returns the fastest setting that agrees with
the starting one, rejects one whose results differ, changes no module state, and reuses a cached result for a
new batch size or sequence length. Runs the kernels in Triton's interpreter on the CPU (fp32, tiny shape);
the timings are scripted so that the choice is known in advance."""
import dataclasses
import json

import pytest
import torch

from fabric_lin.ops.gla import chunk, tune
from fabric_lin.ops.gla.launch import SHIPPED, GLALaunch

SHAPE = dict(B=1, T=70, H=1, K=16, V=16, dtype=torch.float32)
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU search is timed for real by benchmarks/)")


def scripted_bench(times, seen):
    """A bench that reports times[(dv warps, dq/dk warps)] of the launch it is given (it still runs fn once)."""
    def bench(fn, leaves):
        fn()
        return times[seen[-1]]
    return bench


@pytest.fixture
def launches_run(monkeypatch):
    """The (dv warps, dq/dk warps) of every launch the search runs, in order."""
    seen = []
    real = chunk.chunk_gla_triton

    def recording(*args, launch=None, **kwargs):
        seen.append((launch.dv.warps, launch.dqk.warps))
        return real(*args, launch=launch, **kwargs)

    monkeypatch.setattr(chunk, "chunk_gla_triton", recording)
    return seen


@cpu_only
def test_search_keeps_fastest_correct_setting_and_rejects_a_wrong_one(monkeypatch, launches_run):
    monkeypatch.setattr(tune, "SEARCH_SPACE", [{"dv.warps": (4, 8)}, {"dqk.warps": (8, 4)}])
    start = tune.with_settings(SHIPPED, {"dv.warps": 4, "dqk.warps": 8})
    recording = chunk.chunk_gla_triton

    def dv_warps_8_is_broken(*args, launch=None, **kwargs):  # a setting that miscompiles: its output is off by 10%
        o, ht = recording(*args, launch=launch, **kwargs)
        return (o * 1.1, ht) if launch.dv.warps == 8 else (o, ht)

    monkeypatch.setattr(chunk, "chunk_gla_triton", dv_warps_8_is_broken)
    # dv warps 8 would be the fastest, but it is wrong; dq/dk warps 4 is faster and right
    bench = scripted_bench({(4, 8): 3.0, (8, 8): 1.0, (4, 4): 2.0, (8, 4): 0.5}, launches_run)
    result = tune.tune_launch(**SHAPE, device="cpu", start=start, bench=bench, log=lambda s: None)
    assert isinstance(result["launch"], GLALaunch)
    assert result["launch"] == tune.with_settings(start, {"dqk.warps": 4})
    assert result["start_fwd_bwd_ms"] == 3.0 and result["fwd_bwd_ms"] == 2.0
    rejected = [t for t in result["tried"] if "rejected" in t]
    assert rejected and all(t["changes"]["dv.warps"] == 8 for t in rejected)
    assert "relative RMS error" in rejected[0]["rejected"]
    assert SHIPPED == GLALaunch()  # the search left the shipped settings as they were


@cpu_only
def test_cached_result_is_reused_for_another_batch_and_length(monkeypatch, tmp_path, launches_run):
    monkeypatch.setattr(tune, "SEARCH_SPACE", [{"dqk.warps": (8, 4)}])
    cache = tmp_path / "compile_cache" / "gla_launch.json"
    dv = SHIPPED.dv.warps
    bench = scripted_bench({(dv, 8): 2.0, (dv, 4): 1.0}, launches_run)
    first = tune.tuned_launch(**SHAPE, cache_file=cache, device="cpu", bench=bench, log=lambda s: None)
    assert first.dqk.warps == 4
    stored = json.loads(cache.read_text())
    key = tune.launch_key(1, 16, 16, torch.float32, torch.device("cpu"))
    assert list(stored) == [key] and stored[key] == dataclasses.asdict(first)

    monkeypatch.setattr(tune, "tune_launch", lambda *a, **k: pytest.fail("searched again for a cached key"))
    again = tune.tuned_launch(B=4, T=500, H=1, K=16, V=16, dtype=torch.float32, cache_file=cache, device="cpu", log=lambda s: None)
    assert again == first
    # another head shape is another key: it would search
    with pytest.raises(pytest.fail.Exception, match="searched again"):
        tune.tuned_launch(B=1, T=70, H=2, K=16, V=16, dtype=torch.float32, cache_file=cache, device="cpu")


def test_bad_cache_file_is_named(tmp_path):
    cache = tmp_path / "gla_launch.json"
    cache.write_text("{not json")
    with pytest.raises(ValueError, match="gla_launch.json: not a JSON launch cache"):
        tune.tuned_launch(**SHAPE, cache_file=cache, device="cpu")
    key = tune.launch_key(1, 16, 16, torch.float32, torch.device("cpu"))
    cache.write_text(json.dumps({key: {"no_such_setting": 1}}))
    with pytest.raises(ValueError, match="unknown keys \\['no_such_setting'\\]"):
        tune.tuned_launch(**SHAPE, cache_file=cache, device="cpu")
    cache.write_text(json.dumps({key: {"dqk": {"warps": 4, "tiles": 2}}}))
    with pytest.raises(ValueError, match="dqk has unknown keys \\['tiles'\\]"):
        tune.tuned_launch(**SHAPE, cache_file=cache, device="cpu")


def test_launch_settings_are_immutable_values():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SHIPPED.dqk.warps = 2
    changed = tune.with_settings(SHIPPED, {"dqk.warps": 16, "state.BV": 64, "dqk_single_warps": 8})
    assert (changed.dqk.warps, changed.state.BV, changed.dqk_single_warps) == (16, 64, 8)
    assert (SHIPPED.dqk.warps, SHIPPED.state.BV, SHIPPED.dqk_single_warps) == (8, 128, 4)
    assert GLALaunch.from_dict(json.loads(changed.as_json)) == changed  # the form the ops take it in
    with pytest.raises(ValueError, match="unknown GLALaunch setting 'dqk.tiles'"):
        tune.with_settings(SHIPPED, {"dqk.tiles": 2})
