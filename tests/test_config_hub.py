"""config_hub/: each run configuration parses as `fabric-lin pretrain --config` reads it, flame's recipes (batch,
optimizer, schedule) and the CPU debug recipes' defaults."""
import pytest

from fabric_lin.config import Config
from helpers import CONFIG_HUB, parse_run_config

RECIPES = {  # config file: the block type of its model
    "gla_340M": "gla", "transformer_340M": "transformer", "gla_1B": "gla", "gla_7B": "gla",
    "gdn_340M": "gdn", "gdn_1B": "gdn", "deltanet_340M": "deltanet", "deltanet_1B": "deltanet",
}
DEBUG_RECIPES = {"debug": "gla-debug", "debug_gdn": "gdn-debug", "debug_deltanet": "deltanet-debug"}


@pytest.mark.parametrize("name", RECIPES)
def test_config_hub_recipes(name):
    cfg = parse_run_config(CONFIG_HUB / f"{name}.yaml")
    train, opt = cfg.train, cfg.optimizer
    assert Config.from_name(cfg.model_name).block_type == RECIPES[name]
    # flame's batch: 256 sequences of 2048 tokens = 524,288 tokens per optimizer step, on 8 GPUs
    assert train.global_batch_size * train.max_seq_length == 524_288
    train.gradient_accumulation_iters(devices=8, num_nodes=1)  # divides exactly on one 8-GPU node
    assert tuple(opt.betas) == (0.9, 0.95) and opt.weight_decay == 0.01 and train.max_norm == 1.0
    assert train.min_lr == pytest.approx(0.1 * opt.lr)  # cosine to 10%
    if name.endswith("340M"):
        assert (train.total_steps(), train.lr_warmup_steps, opt.lr) == (20480, 1024, 3e-4)
        assert type(cfg.data).__name__ == "SlimPajamaStarcoder" and cfg.data.use_starcoder


@pytest.mark.parametrize("name", DEBUG_RECIPES)
def test_debug_recipes_run_on_cpu_defaults(name):
    cfg = parse_run_config(CONFIG_HUB / f"{name}.yaml")
    assert cfg.model_name == DEBUG_RECIPES[name] and type(cfg.data).__name__ == "SampleCorpus"
    assert cfg.precision == "32-true" and cfg.compile.enabled is False and cfg.devices == 1
    assert cfg.train.gradient_accumulation_iters(1, 1) == 2
