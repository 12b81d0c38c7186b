"""Config files as a user coming from LitGPT or flame writes them: a key of LitGPT's spelling that fabric-lin has in
another group or not at all, and a key left empty (null) where its option takes a value."""
import pytest

from helpers import parse_error

TRAIN_KEYS = ("the keys of train are: save_interval, log_interval, global_batch_size, micro_batch_size, lr_warmup_steps, "
              "max_tokens, max_steps, max_seq_length, max_norm, min_lr, lr_schedule, wsd_decay_fraction, keep_last_n, "
              "max_nonfinite_steps")


@pytest.mark.parametrize("group,key,meant", [
    # no key of fabric-lin's is like these: none is suggested (the key itself was)
    ("train", "epochs", None),
    ("train", "tie_embeddings", None),
    ("eval", "max_new_tokens", None),
    # the name of a key of another group, and a close spelling in this one: both
    ("train", "lr", "optimizer.lr or train.min_lr"),
    ("train", "max_iters", "eval.max_iters or train.max_steps"),
    ("train", "devices", "devices"),
    # a misspelt group (flame's `training:`): the key meant among its keys, or none; no key that the group does not
    # have (train.seq_len, train.epochs)
    ("training", "seq_len", "train.max_seq_length"),
    ("trian", "epochs", None),
])
def test_a_config_files_key_is_never_said_to_be_meant_for_itself(tmp_path, capsys, group, key, meant):
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name: gla-debug\n{group}:\n  {key}: 1\n")
    err = parse_error(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: Subcommand 'pretrain' does not accept option '{group}.{key}'"
                          + (f" (did you mean {meant}?); " if meant else "; ")), err
    assert f"did you mean {group}.{key}?" not in err
    assert err.endswith(f" (in {config})")
    if group == "train":
        assert TRAIN_KEYS in err
    assert not (tmp_path / "out").exists()


def test_litgpts_init_args_beside_the_optimizers_own_keys_is_pointed_to_the_key(tmp_path, capsys):
    """config_hub/debug.yaml's optimizer with its lr moved under LitGPT's init_args, its other keys left in place."""
    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\noptimizer:\n  init_args:\n    lr: 1.0e-3\n  weight_decay: 0.01\n")
    err = parse_error(["pretrain", "--config", str(config)], capsys)
    assert err.startswith("fabric-lin pretrain: error: Subcommand 'pretrain' does not accept option "
                          "'optimizer.init_args.lr' (did you mean optimizer.lr?); the keys of optimizer are: lr, "
                          "weight_decay, betas, eps"), err


@pytest.mark.parametrize("command,content,message", [
    # a TypeError deep in the command, with its traceback, before
    ("pretrain", "model_name: gla-debug\nout_dir:\n",
     "out_dir: got null, expected a path: give a value, or leave the key out for its default (out/pretrain)"),
    ("pretrain", "model_name: gla-debug\nseed:\n",
     "seed: got null, expected int: give a value, or leave the key out for its default (42)"),
    ("pretrain", "model_name: gla-debug\noptimizer:\n  lr:\n  weight_decay: 0.01\n",
     "optimizer.lr: got null, expected float: give a value, or leave the key out for its default (0.0004)"),
    ("pretrain", "model_name: gla-debug\neval:\n  interval:\n",
     "eval.interval: got null, expected int: give a value, or leave the key out for its default (1000)"),
    ("train_tokenizer", "input_dir: corpus\noutput_dir: tok\nvocab_size:\n",
     "vocab_size: got null, expected int: give a value, or leave the key out for its default (32000)"),
    ("prepare_text", "input_dir: corpus\noutput_dir: out\ntokenizer_path: tok\nfast_dev_run:\n",
     "fast_dev_run: got null, expected true or false or int: give a value, or leave the key out for its default (false)"),
    # read as false or as no field before: no final validation, every document of the corpus a bad row
    ("pretrain", "model_name: gla-debug\neval:\n  final_validation:\n",
     "eval.final_validation: got null, expected true or false: give a value, or leave the key out for its default (true)"),
    ("prepare_text", "input_dir: corpus\noutput_dir: out\ntokenizer_path: tok\ntext_key:\n",
     "text_key: got null, expected str: give a value, or leave the key out for its default (text)"),
    # a choice of words, and a pair of numbers, as YAML writes them
    ("pretrain", "model_name: gla-debug\nlogger_name:\n",
     "logger_name: got null, expected 'tensorboard' or 'csv' or 'wandb': give a value, or leave the key out for its "
     "default (tensorboard)"),
    ("pretrain", "model_name: gla-debug\noptimizer:\n  betas:\n",
     "optimizer.betas: got null, expected a list: give a value, or leave the key out for its default ([0.9, 0.95])"),
])
def test_a_key_left_empty_where_its_option_takes_a_value_is_named_with_its_file(tmp_path, capsys, monkeypatch, command,
                                                                                content, message):
    """jsonargparse lets a config file's null through unchecked, as a key not set; the command then met it as the value."""
    from helpers import cli_error

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text(content)
    assert cli_error([command, "--config", str(config)], capsys) == (
        f"fabric-lin {command}: error: {message} (in {config})\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_a_key_that_takes_null_still_takes_it_from_a_file(tmp_path, capsys):
    """Keys whose null means something (tokenizer_dir: the data's own; compile.enabled: on with CUDA; train.max_tokens:
    the run counts steps) pass the check: the command meets the next mistake, here --devices 0 (setup's first check)."""
    from helpers import cli_error

    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\ntokenizer_dir:\ninitial_checkpoint_dir: null\ncompile:\n  enabled:\n"
                      "train:\n  max_steps: 3\n  max_tokens:\n  save_interval:\n")
    assert cli_error(["pretrain", "--config", str(config), "--devices", "0"], capsys) == (
        "fabric-lin pretrain: error: --devices 0: expected a positive number of devices per node, or auto\n")
