"""config_hub/: each run configuration parses as `fabric-lin pretrain --config` reads it, flame's recipes (batch,
optimizer, schedule) and the CPU debug recipes' defaults."""
import pytest

from fabric_lin.config import Config
from helpers import CONFIG_HUB, parse_run_config


@pytest.mark.parametrize("name", ["gla_340M", "transformer_340M", "gla_1B", "gla_7B"])
def test_config_hub_recipes(name):
    cfg = parse_run_config(CONFIG_HUB / f"{name}.yaml")
    train, opt = cfg.train, cfg.optimizer
    # flame's batch: 256 sequences of 2048 tokens = 524,288 tokens per optimizer step, on 8 GPUs
    assert train.global_batch_size * train.max_seq_length == 524_288
    train.gradient_accumulation_iters(devices=8, num_nodes=1)  # divides exactly on one 8-GPU node
    assert tuple(opt.betas) == (0.9, 0.95) and opt.weight_decay == 0.01 and train.max_norm == 1.0
    assert train.min_lr == pytest.approx(0.1 * opt.lr)  # cosine to 10%
    Config.from_name(cfg.model_name)
    if name.endswith("340M"):
        assert (train.total_steps(), train.lr_warmup_steps, opt.lr) == (20480, 1024, 3e-4)
        assert type(cfg.data).__name__ == "SlimPajamaStarcoder" and cfg.data.use_starcoder


def test_config_hub_debug_runs_on_cpu_defaults():
    cfg = parse_run_config(CONFIG_HUB / "debug.yaml")
    assert cfg.model_name == "gla-debug" and type(cfg.data).__name__ == "SampleCorpus"
    assert cfg.precision == "32-true" and cfg.compile.enabled is False and cfg.devices == 1
    assert cfg.train.gradient_accumulation_iters(1, 1) == 2


@pytest.mark.parametrize("name", ["gdn_340M", "gdn_1B"])
def test_gdn_recipes_are_flames_340M_recipe(name):
    cfg = parse_run_config(CONFIG_HUB / f"{name}.yaml")
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
    cfg = parse_run_config(CONFIG_HUB / "debug_gdn.yaml")
    assert cfg.model_name == "gdn-debug" and type(cfg.data).__name__ == "SampleCorpus"
    assert cfg.precision == "32-true" and cfg.compile.enabled is False and cfg.devices == 1
