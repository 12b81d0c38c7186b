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
