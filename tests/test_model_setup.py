"""fabric_lin/model_setup.py: the model built empty then initialised, to the same weights as an eager build; which
parameters take no weight decay (also under DDP); the CPU's compile note; the GLA kernel search on rank 0."""
import os

import lightning_fabric as L
import torch

from fabric_lin.args import CompileArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.model import GPT
from fabric_lin.model_setup import build_model, no_decay_parameter_names
from fabric_lin.weights import canonical_name
from helpers import free_port


def test_empty_init_then_reset_equals_eager_build():
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    config = Config.from_name("gla-debug", num_layers=2)
    model, no_decay = build_model(fabric, config, seed=123)
    torch.manual_seed(123)
    eager = GPT(config)
    got = model.state_dict()
    for key, value in eager.state_dict().items():
        assert torch.equal(got[key], value), key
    assert "layers.0.attn_norm.weight" in no_decay and "layers.0.attn.gk_proj.1.bias" in no_decay
    assert "layers.0.attn.q_proj.weight" not in no_decay and "embeddings.weight" not in no_decay


def test_compiling_on_the_cpu_says_that_the_first_step_is_minutes_away(capsys):
    """compile.enabled true on the CPU: Inductor builds C++ code for the Blocks before the first step (about 4 CPU-minutes
    for gla-debug, measured), which the run began without a word beyond "compiling each Block"."""
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    build_model(fabric, Config.from_name("gla-debug", num_layers=1), seed=0, compile=CompileArgs(enabled=True, mode="default"))
    assert ("compiling each Block (mode default); on the CPU Inductor first builds C++ code for it: minutes before the "
            "first step (compile.enabled null or false runs eagerly, the CPU's default)") in capsys.readouterr().out


def test_no_decay_names_are_the_models_vectors():
    model = GPT(Config.from_name("gla-debug", num_layers=1))
    names = no_decay_parameter_names(model)
    assert names == {n for n, p in model.named_parameters() if p.ndim == 1}


def test_no_decay_names_found_in_a_ddp_wrapped_model():
    """Fabric's DDP (a 1-process gloo group here) names parameters `_forward_module.module.<name>`: the
    norm weights and biases must still be found, or weight decay reaches them under DDP."""
    from lightning_fabric.strategies import DDPStrategy

    # what Fabric sets in os.environ (WORLD_SIZE, LOCAL_RANK, ...) conftest.environment_kept undoes after the test
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=DDPStrategy(process_group_backend="gloo"))
        fabric.launch()
        model, no_decay = build_model(fabric, Config.from_name("gla-debug", num_layers=1), seed=0)
        names = [n for n, _ in model.named_parameters()]
        assert any(n.startswith("_forward_module.module.") for n in names)  # DDP's wrapping
        assert {canonical_name(n) for n in names if canonical_name(n) in no_decay} == no_decay
        assert len(no_decay) == sum(p.ndim == 1 for p in model.parameters()) > 0
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class RankFabric:
    """What tune_gla_kernels asks of Fabric: the rank, a broadcast from rank 0, and print."""

    def __init__(self, rank, from_rank0=None):
        self.global_rank, self.from_rank0, self.sent = rank, from_rank0, None

    def broadcast(self, obj, src=0):
        assert src == 0
        if self.global_rank == 0:
            self.sent = obj
            return obj
        return self.from_rank0

    def print(self, *args):
        pass


def test_kernel_autotune_searches_on_rank_0_and_every_rank_builds_with_its_result(monkeypatch, tmp_path):
    import dataclasses

    from fabric_lin.ops.gla import tune
    from fabric_lin.ops.gla.launch import SHIPPED
    from fabric_lin.model_setup import tune_gla_kernels

    config = Config.from_name("gla-debug")
    train = TrainArgs(micro_batch_size=4, global_batch_size=4, max_seq_length=256)
    searched = dataclasses.replace(SHIPPED, dqk_single_warps=8)
    assert searched != SHIPPED
    calls = []

    def fake_tuned_launch(B, T, H, K, V, dtype, cache_file=None, log=print):
        calls.append((B, T, H, K, V, dtype, cache_file))
        return searched

    monkeypatch.setattr(tune, "tuned_launch", fake_tuned_launch)
    rank0 = RankFabric(0)
    assert tune_gla_kernels(rank0, config, train, "bf16-mixed", tmp_path) is searched
    assert calls == [(4, 256, config.num_heads, config.head_k_dim, config.head_v_dim, torch.bfloat16,
                      tmp_path / "compile_cache" / "gla_launch.json")]
    assert rank0.sent is searched
    assert tune_gla_kernels(RankFabric(1, from_rank0=rank0.sent), config, train, "bf16-mixed", tmp_path) is searched
    assert len(calls) == 1  # rank 1 did not search
    # every GLA layer of the model is built with the settings
    model, _ = build_model(L.Fabric(accelerator="cpu", devices=1), config, seed=0, gla_launch=searched)
    assert [block.attn.launch for block in model.module.layers] == [searched] * config.num_layers
