"""fabric_lin/args.py: the option groups (train, eval, optimizer, parallelism, compile): their defaults, the sizes
they refuse by name, the batch arithmetic (gradient accumulation, steps from a token budget), compile.mode auto's
choice, and the groups' keys from the command line and YAML."""
import math

import pytest

from fabric_lin.args import CompileArgs, EvalArgs, OptimizerArgs, ParallelismArgs, TrainArgs


@pytest.mark.parametrize("key,value", [("micro_batch_size", 0), ("global_batch_size", -4), ("max_seq_length", 0),
                                       ("max_nonfinite_steps", 0), ("lr_warmup_steps", -1)])
def test_bad_train_sizes_are_named(key, value):
    train = TrainArgs(global_batch_size=8, micro_batch_size=2, max_steps=3)
    setattr(train, key, value)
    with pytest.raises(ValueError, match=rf"train\.{key} must be at least \d, got {value}"):
        train.gradient_accumulation_iters(devices=1, num_nodes=1)


def test_gradient_accumulation_arithmetic():
    # flame's 340M recipe: 32 sequences per GPU x 8 GPUs = 256 sequences of 2048 = 524,288 tokens
    train = TrainArgs(global_batch_size=256, micro_batch_size=8, max_tokens=10_737_418_240, max_seq_length=2048)
    assert train.gradient_accumulation_iters(devices=8, num_nodes=1) == 4
    assert train.gradient_accumulation_iters(devices=8, num_nodes=4) == 1
    assert train.total_steps() == 20480
    with pytest.raises(ValueError, match=r"global_batch_size=256 .* train.micro_batch_size \(8\) x devices \(6\)"):
        train.gradient_accumulation_iters(devices=6, num_nodes=1)


@pytest.mark.parametrize("global_batch,micro_batch,devices,num_nodes,fix", [
    # 6 sequences on 2 processes: 3 each, in micro batches of 3 (or 1)
    (6, 4, 2, 1, "give a train.global_batch_size that is a multiple of 8 (the nearest: 8), or a train.micro_batch_size "
                 "that divides the 3 sequences of each process (e.g. 3)"),
    (6, 4, 1, 1, "give a train.global_batch_size that is a multiple of 4 (the nearest: 4 or 8), or a "
                 "train.micro_batch_size that divides the 6 sequences of each process (e.g. 3)"),
    # a micro batch larger than the global batch
    (8, 16, 1, 1, "give a train.global_batch_size that is a multiple of 16 (the nearest: 16), or a train.micro_batch_size "
                  "that divides the 8 sequences of each process (e.g. 8)"),
    # 256 sequences do not share out over 6 processes: no micro batch helps
    (256, 8, 6, 1, "give a train.global_batch_size that is a multiple of 48 (the nearest: 240 or 288), or a number of "
                   "devices x num_nodes that divides it (the nearest: 4 or 8), with a train.micro_batch_size that "
                   "divides each process's share"),
    # 7 sequences over 2 processes: over 1 or 7, each process's 7 or 1 then in micro batches that divide them
    (7, 4, 2, 1, "give a train.global_batch_size that is a multiple of 8 (the nearest: 8), or a number of devices x "
                 "num_nodes that divides it (the nearest: 1 or 7), with a train.micro_batch_size that divides each "
                 "process's share"),
])
def test_a_global_batch_that_does_not_share_out_names_the_values_that_do(global_batch, micro_batch, devices, num_nodes, fix):
    """The refusal said what the global batch must be a multiple of, not which values would do: the nearest multiples,
    and the micro batch (at most the one given, which fits in memory) that accumulates to the global batch given, checked
    here by the arithmetic they are refused by."""
    train = TrainArgs(global_batch_size=global_batch, micro_batch_size=micro_batch, max_steps=1)
    with pytest.raises(ValueError) as info:
        train.gradient_accumulation_iters(devices, num_nodes)
    assert str(info.value) == (
        f"train.global_batch_size={global_batch} must be a positive multiple of train.micro_batch_size ({micro_batch}) x "
        f"devices ({devices}) x num_nodes ({num_nodes}) = {micro_batch * devices * num_nodes}: {fix}")
    for value in [int(v) for v in fix.split("(the nearest: ")[1].split(")")[0].split(" or ")]:
        assert TrainArgs(global_batch_size=value, micro_batch_size=micro_batch, max_steps=1).gradient_accumulation_iters(
            devices, num_nodes) >= 1
    if "divides it (the nearest: " in fix:  # each process count named shares the global batch out whole
        counts = fix.split("divides it (the nearest: ")[1].split(")")[0].split(" or ")
        assert all(global_batch % int(n) == 0 for n in counts) and len(counts) == 2
    if "(e.g. " in fix:
        micro = int(fix.split("(e.g. ")[1].rstrip(")"))
        assert micro <= micro_batch and TrainArgs(global_batch_size=global_batch, micro_batch_size=micro, max_steps=1
                                                  ).gradient_accumulation_iters(devices, num_nodes) >= 1


def test_max_tokens_and_max_steps_exclusive():
    with pytest.raises(ValueError, match="exactly one of train.max_tokens"):
        TrainArgs(max_tokens=10, max_steps=10).total_steps()
    with pytest.raises(ValueError, match="max_tokens=100 is less than one optimizer step"):
        TrainArgs(max_tokens=100, global_batch_size=2, max_seq_length=64).total_steps()


def test_a_token_budget_over_a_config_that_counts_steps_is_told_how_to_unset_them(tmp_path, capsys):
    """config_hub's YAMLs set max_steps: a flag that gives max_tokens does not unset it, and the error gives the flags that
    do, which the command line takes (the next error is the budget's own)."""
    from helpers import CONFIG_HUB, cli_error

    command = ["pretrain", "--config", str(CONFIG_HUB / "debug.yaml"), "--out_dir", str(tmp_path / "out")]
    err = cli_error([*command, "--train.max_tokens", "1000"], capsys)
    assert err == ("fabric-lin pretrain: error: give exactly one of train.max_tokens (1000) and train.max_steps (150): "
                   "set the other to null: --train.max_steps null to train 1000 tokens, or --train.max_tokens null to "
                   "train 150 steps\n")
    err = cli_error([*command, "--train.max_steps", "null", "--train.max_tokens", "1000"], capsys)
    assert "train.max_tokens=1000 is less than one optimizer step" in err
    # the other way round: a recipe's token budget, and a few steps given to try it (the error named only the flags
    # that keep the budget and drop the steps given)
    recipe = ["pretrain", "--config", str(CONFIG_HUB / "gla_340M.yaml"), "--out_dir", str(tmp_path / "out")]
    err = cli_error([*recipe, "--train.max_steps", "2"], capsys)
    assert err == ("fabric-lin pretrain: error: give exactly one of train.max_tokens (10737418240) and train.max_steps "
                   "(2): set the other to null: --train.max_steps null to train 10737418240 tokens, or "
                   "--train.max_tokens null to train 2 steps\n")
    err = cli_error([*recipe, "--train.max_steps", "2", "--train.max_tokens", "null", "--train.max_seq_length", "0"], capsys)
    assert "train.max_seq_length must be at least 1" in err  # taken: the next error is a later check's
    with pytest.raises(ValueError, match=r"give one of train.max_steps and train.max_tokens: where the run ends \(both are null\)"):
        TrainArgs().total_steps()


def test_eval_args_defaults_are_litgpt_like():
    e = EvalArgs()
    assert (e.interval, e.max_iters, e.initial_validation, e.final_validation) == (1000, 8, False, True)
    assert math.isclose(TrainArgs().max_norm, 1.0)


@pytest.mark.parametrize("cuda,enabled,devices,num_nodes,reset,mode", [
    (True, None, 1, 1, False, "reduce-overhead"),  # one GPU, compile on by default with CUDA
    (True, True, 2, 1, False, "default"),
    (True, True, 1, 2, False, "default"),
    (True, False, 1, 1, False, "default"),
    (False, True, 1, 1, False, "default"),
    (False, None, 1, 1, False, "default"),  # compile off by default on the CPU
    (True, True, 1, 1, True, "default"),
])
def test_compile_mode_auto_picks_cuda_graphs_only_where_they_can_run(cuda, enabled, devices, num_nodes, reset, mode):
    resolved = CompileArgs(enabled=enabled, mode="auto").resolve(cuda, devices, num_nodes, reset)
    assert resolved.mode == mode and resolved.enabled is (cuda if enabled is None else enabled)
    assert resolved.cuda_graphs is (mode == "reduce-overhead")
    # an explicit mode is kept where it can run
    assert CompileArgs(enabled=enabled, mode="default").resolve(cuda, devices, num_nodes, reset).mode == "default"


def test_new_group_keys_parse_from_the_command_line_and_yaml(tmp_path):
    from jsonargparse import ArgumentParser

    from fabric_lin.pretrain import setup

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(setup)
    parser.add_argument("--config", action="config")
    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\ncompile:\n  cache: false\n  mode: default\nparallelism:\n  fsdp_unit: model\n")
    cfg = parser.instantiate(parser.parse_args([
        "--config", str(config), "--compile.enabled", "true", "--parallelism.activation_checkpointing", "true",
    ]))
    assert cfg.compile == CompileArgs(enabled=True, cache=False, dynamic=True, mode="default", kernel_autotune=False)
    assert cfg.parallelism == ParallelismArgs(data_parallel="fsdp", fsdp_unit="model", activation_checkpointing=True)


@pytest.mark.parametrize("fields", [dict(lr_schedule="wsd", wsd_decay_fraction=1.0), dict(min_lr=0.0),
                                    dict(max_norm=None), dict(max_norm=1e-3), dict(save_interval=None, keep_last_n=None)])
def test_train_values_at_the_edge_of_their_range_are_taken(fields):
    """A WSD schedule that decays over the whole run, a schedule that ends at 0, no clipping (or very tight): each a
    value the range in the option's description includes."""
    TrainArgs(**fields).validate()


@pytest.mark.parametrize("fields,message", [
    # no decay at all: the run would end at the peak learning rate, never reaching train.min_lr
    (dict(lr_schedule="wsd", wsd_decay_fraction=0.0), r"train.wsd_decay_fraction must be in \(0, 1\], got 0.0"),
    # clipping to a norm of 0 scales every gradient to nothing: no step would change the weights
    (dict(max_norm=0.0), r"train.max_norm must be a number > 0 \(or null: no clipping\), got 0.0"),
    (dict(max_norm=math.inf), r"train.max_norm must be a number > 0 \(or null: no clipping\), got inf"),
    (dict(min_lr=math.inf), r"train.min_lr must be a finite number >= 0, got inf"),
])
def test_train_values_just_outside_their_range_are_named(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        TrainArgs(**fields).validate()


def test_optimizer_values_at_the_edge_of_their_range_are_taken():
    OptimizerArgs(lr=0.0, weight_decay=0.0, betas=(0.0, 0.0)).validate(min_lr=0.0)  # a run that does not move
    OptimizerArgs(lr=1e-3).validate(min_lr=1e-3)  # a constant learning rate: the schedule's end at its peak


@pytest.mark.parametrize("fields,message", [
    (dict(lr=math.inf), r"optimizer.lr must be a finite number >= 0, got inf"),
    (dict(weight_decay=math.inf), r"optimizer.weight_decay must be a finite number >= 0, got inf"),
    # AdamW refuses a beta of 1 (its bias correction would divide by 0) with a traceback of its own
    (dict(betas=(1.0, 0.95)), r"optimizer.betas must be two numbers in \[0, 1\), got \[1.0, 0.95\]"),
    (dict(betas=(0.9, 0.95, 0.99)), r"optimizer.betas must be two numbers in \[0, 1\), got \[0.9, 0.95, 0.99\]"),
    (dict(eps=math.inf), r"optimizer.eps must be a finite number > 0 .*, got inf"),
])
def test_optimizer_values_just_outside_their_range_are_named(fields, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        OptimizerArgs(**fields).validate(min_lr=0.0)


def test_a_learning_rate_of_0_is_not_answered_with_a_min_lr_of_0():
    """optimizer.lr 0 (a slip for 3e-4, say) under the default train.min_lr was told to give a min_lr of "10% of it: 0",
    which trains a run in which no step changes the weights."""
    with pytest.raises(ValueError, match=r"^optimizer.lr 0 changes no weight at any step, and train.min_lr \(4e-05\) is "
                                         r"above it: give a positive optimizer.lr \(config_hub's 340M recipes: 3e-4\); "
                                         r"train.min_lr 0 too runs the steps without changing the weights$"):
        OptimizerArgs(lr=0.0).validate(min_lr=4e-5)

