import pytest
import torch

from fabric_lin.config import Config, name_to_config
from fabric_lin.model import GPT


def count_parameters_on_meta(config: Config) -> int:
    with torch.device("meta"):
        model = GPT(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    return sum(p.numel() for p in model.parameters())


def test_gla_340M_parameter_count_matches_flash_linear_attention():
    # flame's gla_340M.json is untied; DESIGN.md gives both counts
    assert count_parameters_on_meta(Config.from_name("gla-340M")) == 374_475_776
    assert count_parameters_on_meta(Config.from_name("gla-340M", tie_embeddings=True)) == 341_707_776


def test_derived_widths_of_gla_340M():
    c = Config.from_name("gla-340M")
    assert (c.key_dim, c.value_dim, c.head_k_dim, c.head_v_dim, c.intermediate_size) == (512, 1024, 128, 256, 2816)


@pytest.mark.parametrize("name", ["gla-1.3B", "gla-7B", "transformer-340M"])
def test_other_parameter_counts(name, capsys):
    n = count_parameters_on_meta(Config.from_name(name))
    with capsys.disabled():
        print(f"\n{name}: {n:,} parameters")
    # Counted by hand (the figures in README's model table), per layer + embeddings + head + final norm:
    # gla-1.3B: attn q,k 2048x1024, v,g,o 2048x2048, gate 2048x16+16x1024+1024, head norm 512 = 16,827,904;
    #           MLP 3x2048x5632 = 34,603,008; norms 4,096 -> x24 + 2x32000x2048 + 2048
    # gla-7B:   attn q,g,o 4096x4096, k,v 4096x1024, gate 4096x16+16x1024+1024, head norm 128 = 58,803,328;
    #           MLP 3x4096x14336 = 176,160,768; norms 8,192 -> x32 + 2x32000x4096 + 4096
    # transformer-340M: attn 4x1024x1024, MLP 3x1024x2816, norms 2048 -> x24 + 2x32000x1024 + 1024
    expected = {
        "gla-1.3B": 24 * (16_827_904 + 34_603_008 + 4_096) + 2 * 32000 * 2048 + 2048,
        "gla-7B": 32 * (58_803_328 + 176_160_768 + 8_192) + 2 * 32000 * 4096 + 4096,
        "transformer-340M": 24 * (4 * 1024 * 1024 + 3 * 1024 * 2816 + 2048) + 2 * 32000 * 1024 + 1024,
    }
    assert n == expected[name]


def test_yaml_round_trip(tmp_path):
    c = Config.from_name("gla-7B", tie_embeddings=True)
    c.save(tmp_path / "model_config.yaml")
    assert Config.from_checkpoint(tmp_path) == c
    assert c.num_kv_heads == 8
    assert Config.from_checkpoint(tmp_path, vocab_size=512) == Config.from_name("gla-7B", tie_embeddings=True,
                                                                                vocab_size=512)


def test_a_hybrid_s_layers_in_any_order_are_the_same_model():
    # the order a user lists them in is no difference: a resume compares the configs
    assert Config.from_name("gla-debug", attn_layers=[3, 0], attn_num_heads=2).attn_layers == [0, 3]
    assert Config.from_name("gla-debug", attn_layers=[3, 0], attn_num_heads=2) == Config.from_name(
        "gla-debug", attn_layers=[0, 3], attn_num_heads=2)


def test_the_flag_that_builds_a_config():
    assert Config.from_name("gla-debug").flag("run/model_config.yaml") == "--model_name gla-debug"
    # a named model with a field changed is built from its file
    changed = Config.from_name("gla-debug", norm_eps=1e-5)
    assert changed.flag("run/model_config.yaml") == "--model_config run/model_config.yaml"


def test_a_model_config_file_that_is_missing_empty_or_not_a_mapping_is_named(tmp_path):
    from fabric_lin.errors import MissingFile, UserError

    with pytest.raises(MissingFile, match=rf"{tmp_path / 'model_config.yaml'} does not exist: expected a model_config.yaml"):
        Config.from_checkpoint(tmp_path)
    for text, held in (("", r"nothing \(the file is empty\)"), ("- hidden_size\n", "a list")):
        (tmp_path / "model_config.yaml").write_text(text)
        with pytest.raises(UserError, match=rf"model_config.yaml holds {held}: expected a mapping of Config fields "
                                            rf"\(name, block_type, hidden_size, \.\.\.\)$"):
            Config.from_checkpoint(tmp_path)


def test_unknown_name_suggests_close_ones():
    with pytest.raises(ValueError, match="gla-340M"):
        Config.from_name("gla-340m")


def test_unknown_yaml_key_is_named(tmp_path):
    (tmp_path / "model_config.yaml").write_text("name: x\nhiden_size: 3\n")
    with pytest.raises(ValueError, match="hiden_size"):
        Config.from_checkpoint(tmp_path)


def test_all_named_configs_build():
    for name in name_to_config:
        assert count_parameters_on_meta(Config.from_name(name)) > 0
