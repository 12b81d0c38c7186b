"""Weights beside the config of another model (a model_config.yaml of another family, depth or width than its
lit_model.pth): generate, evaluate, convert_to_hf and pretrain --initial_checkpoint_dir say in one line what the weights
are, what the config says and what to do, where they listed every tensor that differs over some 20 lines."""
import shutil
from dataclasses import replace

import pytest
import torch

from fabric_lin.config import Config
from fabric_lin.convert.model_dir import check_state_dict, load_model_dir_weights
from fabric_lin.model import GPT
from fabric_lin.run_start import load_initial_weights
from fabric_lin.weights import Outline, config_outline, meta_model, weights_outline
from helpers import cli_error, make_model_dir, small_config

GLA = "a GLA model (2 layers, width 128; its layers hold attn.gk_proj.0.weight)"


@pytest.fixture(scope="module")
def gla_dir(tmp_path_factory):
    """A model directory of small_config (GLA, 2 layers, width 128, a tokenizer of 64 pieces)."""
    directory = tmp_path_factory.mktemp("weights") / "gla"
    make_model_dir(directory, small_config())
    return directory


def beside(gla_dir, tmp_path, config: Config):
    """A copy of `gla_dir` whose model_config.yaml is `config`'s."""
    directory = tmp_path / "model"
    shutil.copytree(gla_dir, directory)
    config.save(directory / "model_config.yaml")
    return directory


@pytest.mark.parametrize("name", ["gla-debug", "gdn-debug", "deltanet-debug", "transformer-debug"])
def test_the_outline_of_weights_is_that_of_their_config(name):
    """Family, layers and width read off the tensors are those of the Config that built them; a hybrid's attention
    layers do not hide its family."""
    config = Config.from_name(name, num_layers=3)
    assert weights_outline(meta_model(config).state_dict()).same_model(config_outline(config))
    assert config_outline(config) == Outline(config.block_type, 3, 128)
    if name != "transformer-debug":
        hybrid = replace(config, attn_layers=[0, 2], attn_num_heads=2, attn_num_kv_heads=2)
        assert weights_outline(meta_model(hybrid).state_dict()).family == config.block_type


@pytest.mark.parametrize("command", ["generate", "evaluate", "convert_to_hf"])
def test_a_config_of_another_family_beside_the_weights_is_one_line(gla_dir, tmp_path, capsys, command):
    model = beside(gla_dir, tmp_path, Config.from_name("gdn-debug", vocab_size=64, num_layers=2))
    argv = [command, str(model)] + (["--output_dir", str(tmp_path / "hf")] if command == "convert_to_hf" else [])
    assert cli_error(argv, capsys) == (
        f"fabric-lin {command}: error: {model / 'lit_model.pth'} holds {GLA} and {model / 'model_config.yaml'} "
        f"describes gdn-debug, a Gated DeltaNet model (2 layers, width 128): they were not written together; put back "
        f"the model_config.yaml written with these weights\n")
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("overrides,says", [
    (dict(num_layers=4), "a GLA model (4 layers, width 128)"),
    (dict(hidden_size=256), "a GLA model (2 layers, width 256)"),
    # the same family, depth and width, other head widths: the first tensor of another shape is named
    (dict(expand_k=1.0), "a GLA model (2 layers, width 128), whose layers.0.attn.q_proj.weight is (128, 128) where "
                         "the weights' is (64, 128)"),
])
def test_a_config_of_another_size_is_one_line(gla_dir, tmp_path, overrides, says):
    model = beside(gla_dir, tmp_path, Config.from_name("gla-debug", **{"vocab_size": 64, "num_layers": 2, **overrides}))

    with pytest.raises(ValueError) as info:
        load_model_dir_weights(model, Config.from_checkpoint(model))
    assert str(info.value) == (
        f"{model / 'lit_model.pth'} holds {GLA} and {model / 'model_config.yaml'} describes gla-debug, {says}: they "
        f"were not written together; put back the model_config.yaml written with these weights")


def test_a_few_tensors_that_differ_are_still_listed(gla_dir):
    """Weights of the model's size with a tensor renamed or recast: each difference on a line of its own."""
    state = dict(torch.load(gla_dir / "lit_model.pth"))
    state["norm.weight"] = state["norm.weight"].long()
    state["layers.0.attn.extra"] = state.pop("layers.0.attn.g_norm.weight")
    with pytest.raises(ValueError) as info:
        check_state_dict(state, GPT(small_config()), source="file.pth")
    assert str(info.value).splitlines() == ["file.pth does not match the model:",
                                            "  missing (1): layers.0.attn.g_norm.weight",
                                            "  unexpected (1): layers.0.attn.extra",
                                            "  norm.weight: dtype torch.int64, expected torch.float32"]


def test_initial_weights_of_another_model_are_one_line(gla_dir, tmp_path):
    """pretrain --initial_checkpoint_dir: weights of another model than this run's, with the flag of the directory's
    model where the weights are its; and where its model_config.yaml is not theirs either, the file to put back."""
    run = Config.from_name("gdn-debug", vocab_size=64, num_layers=2)
    with pytest.raises(ValueError) as info:
        load_initial_weights(gla_dir, replace(small_config(), num_layers=4), log=lambda line: None)
    assert str(info.value) == (
        f"--initial_checkpoint_dir {gla_dir / 'lit_model.pth'} holds {GLA} and this run builds gla-debug, a GLA model "
        f"(4 layers, width 128): they are the model of its model_config.yaml: start this run with --model_config "
        f"{gla_dir / 'model_config.yaml'}")
    model = beside(gla_dir, tmp_path, run)
    with pytest.raises(ValueError) as info:
        load_initial_weights(model, run, log=lambda line: None)
    assert str(info.value) == (
        f"--initial_checkpoint_dir {model / 'lit_model.pth'} holds {GLA} and this run builds gdn-debug, a Gated "
        f"DeltaNet model (2 layers, width 128): nor are they the model of its model_config.yaml, gdn-debug: put back "
        f"the model_config.yaml written with these weights, then start this run with the model it names")
