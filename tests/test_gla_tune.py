"""The opt-in launch search (fabric_lin/ops/gla/tune.py): it keeps the fastest setting that agrees with
the table in place, rejects one whose results differ, and reuses a cached result for a new batch size or
sequence length. Runs the kernels in Triton's interpreter on the CPU (fp32, tiny shape); the timings
are scripted so that the choice is known in advance."""
import json

import pytest
import torch

from fabric_lin.ops.gla import chunk
from fabric_lin.ops.gla import tune

SHAPE = dict(B=1, T=70, H=1, K=16, V=16, dtype=torch.float32)


@pytest.fixture(autouse=True)
def restore_launch_table():
    saved = dict(chunk.LAUNCH)
    yield
    chunk.LAUNCH.clear()
    chunk.LAUNCH.update(saved)


def scripted_bench(times):
    """A bench that reports times[(dv_warps, dqk_warps)] for the setting in place (it still runs fn once)."""
    def bench(fn, leaves):
        fn()
        return times[(chunk.LAUNCH["dv_warps"], chunk.LAUNCH["dqk_warps"])]
    return bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (the GPU search is timed for real by benchmarks/)")
def test_search_keeps_fastest_correct_setting_and_rejects_a_wrong_one(monkeypatch):
    monkeypatch.setattr(tune, "SEARCH_SPACE", [{"dv_warps": (4, 8)}, {"dqk_warps": (8, 4)}])
    chunk.LAUNCH.update(dv_warps=4, dqk_warps=8)
    real = chunk.chunk_gla_triton

    def dv_warps_8_is_broken(*args, **kwargs):  # a setting that miscompiles: its output is off by 10%
        o, ht = real(*args, **kwargs)
        return (o * 1.1, ht) if chunk.LAUNCH["dv_warps"] == 8 else (o, ht)

    monkeypatch.setattr(chunk, "chunk_gla_triton", dv_warps_8_is_broken)
    # dv_warps=8 would be the fastest, but it is wrong; dqk_warps=4 is faster and right
    bench = scripted_bench({(4, 8): 3.0, (8, 8): 1.0, (4, 4): 2.0, (8, 4): 0.5})
    result = tune.tune_launch(**SHAPE, device="cpu", bench=bench, log=lambda s: None)
    assert result["launch"]["dv_warps"] == 4 and result["launch"]["dqk_warps"] == 4
    assert chunk.LAUNCH["dqk_warps"] == 4  # installed
    assert result["shipped_fwd_bwd_ms"] == 3.0 and result["fwd_bwd_ms"] == 2.0
    rejected = [t for t in result["tried"] if "rejected" in t]
    assert rejected and all(t["setting"]["dv_warps"] == 8 for t in rejected)
    assert "relative RMS error" in rejected[0]["rejected"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test")
def test_cached_result_is_reused_for_another_batch_and_length(monkeypatch, tmp_path):
    monkeypatch.setattr(tune, "SEARCH_SPACE", [{"dqk_warps": (8, 4)}])
    chunk.LAUNCH.update(dqk_warps=8)
    cache = tmp_path / "compile_cache" / "gla_launch.json"
    bench = scripted_bench({(chunk.LAUNCH["dv_warps"], 8): 2.0, (chunk.LAUNCH["dv_warps"], 4): 1.0})
    first = tune.tuned_launch(**SHAPE, cache_file=cache, device="cpu", bench=bench, log=lambda s: None)
    assert first["dqk_warps"] == 4
    stored = json.loads(cache.read_text())
    assert list(stored) == [tune.launch_key(1, 16, 16, torch.float32, torch.device("cpu"))]

    chunk.LAUNCH.update(dqk_warps=8)
    monkeypatch.setattr(tune, "tune_launch", lambda *a, **k: pytest.fail("searched again for a cached key"))
    again = tune.tuned_launch(B=4, T=500, H=1, K=16, V=16, dtype=torch.float32, cache_file=cache, device="cpu", log=lambda s: None)
    assert again["dqk_warps"] == 4 and chunk.LAUNCH["dqk_warps"] == 4
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
    with pytest.raises(ValueError, match="unknown launch keys \\['no_such_setting'\\]"):
        tune.tuned_launch(**SHAPE, cache_file=cache, device="cpu")


class FakeFabric:
    """The two things tune_gla_kernels asks of Fabric: the rank, and a broadcast from rank 0."""

    def __init__(self, rank, rank0_settings=None):
        self.global_rank, self.rank0_settings, self.sent = rank, rank0_settings, None

    def broadcast(self, obj, src=0):
        assert src == 0
        if self.global_rank == 0:
            self.sent = obj
            return obj
        return self.rank0_settings

    def print(self, *args):
        pass


def test_pretrain_search_runs_on_rank_0_and_every_rank_installs_its_result(monkeypatch, tmp_path):
    from fabric_lin.args import TrainArgs
    from fabric_lin.config import Config
    from fabric_lin.pretrain import tune_gla_kernels

    config = Config.from_name("gla-debug")
    train = TrainArgs(micro_batch_size=4, global_batch_size=4, max_seq_length=256)
    calls = []

    def fake_tuned_launch(B, T, H, K, V, dtype, cache_file=None, log=print):
        calls.append((B, T, H, K, V, dtype, cache_file))
        return dict(chunk.LAUNCH, dqk_warps=4)

    monkeypatch.setattr(tune, "tuned_launch", fake_tuned_launch)
    chunk.LAUNCH.update(dqk_warps=8)
    rank0 = FakeFabric(0)
    tune_gla_kernels(rank0, config, train, "bf16-mixed", tmp_path)
    assert calls == [(4, 256, config.num_heads, config.head_k_dim, config.head_v_dim, torch.bfloat16,
                      tmp_path / "compile_cache" / "gla_launch.json")]
    assert chunk.LAUNCH["dqk_warps"] == 4 and rank0.sent["dqk_warps"] == 4

    chunk.LAUNCH.update(dqk_warps=8)
    tune_gla_kernels(FakeFabric(1, rank0_settings=rank0.sent), config, train, "bf16-mixed", tmp_path)
    assert len(calls) == 1  # rank 1 did not search
    assert chunk.LAUNCH["dqk_warps"] == 4
