"""fabric_lin/pretrain.py: the loop's setup -> main, in this process. The errors given before any work (each naming
the value, nothing written), a used out_dir refused or overwritten, hyperparameters.yaml as the next run's config, a
training checkpoint or model directory to start from, and the CPU processes asked for.
Elsewhere: the option groups (test_args.py), the command line (test_cli.py), its data (test_pretrain_data.py), what
a resume may change (test_run_identity.py), the model and its optimizer groups (test_model_setup.py), end to end as a subprocess (test_pretrain_resume.py,
test_pretrain_sharded.py, test_pretrain_gdn.py)."""
import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fabric_lin.args import CompileArgs, EvalArgs, OptimizerArgs, ParallelismArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.errors import UserError
from fabric_lin.model import GPT
from helpers import cli_error, free_port, metrics_records, parse_run_config, setup_pretrain


# ---- errors before any training step: each names the offending value


def test_error_unknown_model_name_suggests_close_names(tmp_path):
    with pytest.raises(ValueError, match=r"Unknown model name 'gla-340m'.*Did you mean 'gla-340M'"):
        setup_pretrain(tmp_path, model_name="gla-340m")


def test_error_batch_not_divisible(tmp_path):
    with pytest.raises(ValueError, match=r"global_batch_size=6 .*micro_batch_size \(4\) x devices \(1\)"):
        setup_pretrain(tmp_path, train=TrainArgs(global_batch_size=6, micro_batch_size=4, max_steps=1))
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("train,eval,message", [
    (dict(save_interval=0), {}, r"train.save_interval must be at least 1 \(or null: only the final checkpoint\), got 0"),
    (dict(log_interval=0), {}, r"train.log_interval must be at least 1, got 0"),
    (dict(keep_last_n=0), {}, r"train.keep_last_n must be at least 1 \(or null to keep all\), got 0"),
    (dict(lr_schedule="wsd", wsd_decay_fraction=1.5), {}, r"train.wsd_decay_fraction must be in \(0, 1\], got 1.5"),
    # a setting of the wsd schedule given to a cosine one, which would train as if it were not there
    (dict(wsd_decay_fraction=0.2), {}, r"^train.wsd_decay_fraction 0.2 sets where lr_schedule 'wsd' decays, and this run's "
                                       r"lr_schedule is 'cosine', which it leaves unchanged: give --train.lr_schedule wsd, or "
                                       r"leave train.wsd_decay_fraction at 0.1$"),
    (dict(lr_schedule="linear"), {}, r"train.lr_schedule must be 'cosine' or 'wsd', got 'linear'"),
    ({}, dict(interval=0), r"eval.interval must be at least 1 \(optimizer steps between validations\), got 0"),
])
def test_error_train_and_eval_values_are_named(tmp_path, train, eval, message):
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, **train)
    with pytest.raises(ValueError, match=message):
        setup_pretrain(tmp_path, train=train, eval=EvalArgs(**eval))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("train,optimizer,message", [
    (dict(max_norm=-1.0), {}, r"train.max_norm must be a number > 0 \(or null: no clipping\), got -1.0"),  # would flip the gradient
    (dict(min_lr=-1e-5), {}, r"train.min_lr must be a finite number >= 0, got -1e-05"),
    ({}, dict(lr=-1.0), r"optimizer.lr must be a finite number >= 0, got -1.0"),
    ({}, dict(weight_decay=-0.1), r"optimizer.weight_decay must be a finite number >= 0, got -0.1"),
    ({}, dict(betas=(0.9, 1.5)), r"optimizer.betas must be two numbers in \[0, 1\), got \[0.9, 1.5\]"),
    ({}, dict(eps=0.0), r"optimizer.eps must be a finite number > 0 .*, got 0.0"),
    # a lower peak than the recipe's end: the "decay" would rise to min_lr
    (dict(min_lr=4e-5), dict(lr=1e-5), r"train.min_lr \(4e-05\) is above optimizer.lr \(1e-05\): .* \(the recipes use 10% "
                                       r"of it: 1e-06\)"),
])
def test_error_optimizer_and_schedule_values_are_named(tmp_path, train, optimizer, message):
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, **train)
    with pytest.raises(ValueError, match=message):
        setup_pretrain(tmp_path, train=train, optimizer=OptimizerArgs(**optimizer))
    assert not (tmp_path / "out").exists()


def test_error_eval_max_iters_not_positive(tmp_path):
    with pytest.raises(ValueError, match=r"eval.max_iters must be at least 1 \(validation batches of train.global_batch_size sequences\), got 0"):
        setup_pretrain(tmp_path, eval=EvalArgs(max_iters=0))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("final_validation", [False, True])
def test_eval_interval_validates_the_last_step_it_divides_once(tmp_path, final_validation):
    """eval.interval 2 over 4 steps: validations after steps 2 and 4, whether or not eval.final_validation asks for one
    after the last step (without it, step 4 went unvalidated); with it, step 4 is validated once, not twice."""
    setup_pretrain(tmp_path, train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=4, max_seq_length=32),
                   eval=EvalArgs(interval=2, max_iters=1, final_validation=final_validation))
    assert [r["step"] for r in metrics_records(tmp_path / "out") if "val_loss" in r] == [2, 4]


def test_a_run_says_that_its_steps_are_optimizer_steps_and_what_one_holds(tmp_path, capsys):
    """Global batch 4 of micro batches of 2 on one process: 2 micro-batches accumulated per optimizer step, each step
    4 x 32 = 128 tokens; steps 1 to 3, the warmup and the schedule said in the same unit as every step count."""
    setup_pretrain(tmp_path, train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=3, max_seq_length=32,
                                             lr_warmup_steps=1, min_lr=1e-5), eval=EvalArgs(final_validation=False))
    assert ("Training optimizer steps 1 to 3, each of 4 sequences x 32 tokens = 128 tokens (gradient accumulation 2: "
            "2 micro-batches of 2 sequences x 1 process); learning rate: 1 warmup step, then cosine to 1.00e-05. Every "
            "count of steps here and in the logs is of optimizer steps\n") in capsys.readouterr().out


def test_a_finished_run_names_its_model_and_the_commands_that_read_it(tmp_path, capsys, monkeypatch):
    """The end of a run names final/ and the commands to take it on; generate reads final/ as it is, and the command
    that makes a model directory, run as printed, gives convert_to_hf what it reads."""
    import shlex

    from fabric_lin.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    setup_pretrain(tmp_path, out_dir=Path("out"), eval=EvalArgs(final_validation=False))
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == ("The model: out/final. Evaluate it with fabric-lin evaluate out/final, sample from it with fabric-lin "
                    "generate out/final; for convert_to_hf and --initial_checkpoint_dir, make a model directory of it: "
                    "fabric-lin convert_pretrained_checkpoint out/final --output_dir checkpoints/gla-debug")
    cli_main(["generate", "out/final", "--max_new_tokens", "2"])
    cli_main(shlex.split(last.split(": fabric-lin ")[-1]))
    cli_main(["convert_to_hf", "checkpoints/gla-debug", "--output_dir", "hf/gla-debug"])


def test_error_cuda_graphs_need_one_gpu(tmp_path, monkeypatch):
    graphs = CompileArgs(mode="reduce-overhead")
    with pytest.raises(ValueError, match=r"compile.mode 'reduce-overhead' \(CUDA graphs\) needs one CUDA GPU and "
                       r"compile.enabled true; got cuda=False, compile.enabled=False, devices=1, num_nodes=1: leave "
                       r"compile.mode at auto \(CUDA graphs where they can run, else default\)$"):
        setup_pretrain(tmp_path, compile=graphs)
    with pytest.raises(ValueError, match=r"compile.mode must be 'auto', 'default' or 'reduce-overhead', got 'max-autotune'"):
        setup_pretrain(tmp_path, compile=CompileArgs(mode="max-autotune"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # refused before any GPU work
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"needs one CUDA GPU and compile.enabled true; got cuda=True, compile.enabled=True, devices=2"):
        setup_pretrain(tmp_path, compile=graphs, devices=2,
               train=TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=1, max_seq_length=32))
    with pytest.raises(ValueError, match=r"needs one CUDA GPU and compile.enabled true; got cuda=True, compile.enabled=False, devices=1"):
        setup_pretrain(tmp_path, compile=CompileArgs(enabled=False, mode="reduce-overhead"))
    with pytest.raises(ValueError, match="cannot be used with reset_state_at_doc_boundaries: leave compile.mode at auto"):
        setup_pretrain(tmp_path, compile=graphs, reset_state_at_doc_boundaries=True)
    assert not (tmp_path / "out").exists()


def test_error_more_devices_than_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"--devices 8: this machine has 2 CUDA GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\); "
                       r"give --devices 2 or fewer"):
        setup_pretrain(tmp_path, devices=8)
    assert not (tmp_path / "out").exists()


def test_error_more_cpu_processes_than_cores(tmp_path, capsys, monkeypatch):
    from fabric_lin.cpu_cores import usable_cpu_cores

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cores = usable_cpu_cores()
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--devices", str(cores + 6), "--train.global_batch_size", str(4 * (cores + 6))], capsys)
    assert err == (f"fabric-lin pretrain: error: --devices {cores + 6}: without a CUDA GPU each device is a CPU process, and "
                   f"this machine gives this run {cores} CPU core(s); give --devices {cores} or fewer\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("option, value, expected", [
    ("--devices", "0", "a positive number of devices per node, or auto"),
    ("--num_nodes", "0", "a positive number of nodes"),
    ("--seed", "-5", "a seed from 0 to 4294967295 (it seeds NumPy's generator too)"),  # was Lightning's traceback
    ("--seed", "4294967296", "a seed from 0 to 4294967295 (it seeds NumPy's generator too)"),
])
def test_error_no_devices_or_nodes_or_a_seed_out_of_range_names_the_option(tmp_path, capsys, option, value, expected):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     option, value], capsys)
    assert err == f"fabric-lin pretrain: error: {option} {value}: expected {expected}\n"
    assert not (tmp_path / "out").exists()


def test_a_warmup_as_long_as_the_run_is_said(tmp_path, capsys):
    """TrainArgs' default warmup (2000 steps) kept for a one-step run: it trains at 1/2000 of optimizer.lr."""
    setup_pretrain(tmp_path, optimizer=OptimizerArgs(lr=4e-4))
    assert ("Note: train.lr_warmup_steps (2000) is not below the run's 1 steps: the learning rate rises for the whole run, "
            "to 2.00e-07 at its last step (optimizer.lr 0.0004), and never decays to train.min_lr") in capsys.readouterr().out
    assert [r["lr"] for r in metrics_records(tmp_path / "out") if "lr" in r] == [pytest.approx(4e-4 / 2000)]


@pytest.mark.parametrize("logger", ["csv", "tensorboard"])
def test_error_a_file_where_the_loggers_directory_goes(tmp_path, capsys, logger):
    """out_dir/logs a file (a stray copy, say): one line naming it before any work, not the logger's traceback."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "logs").write_text("not a directory")
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(out), "--train.max_steps", "1",
                     "--logger_name", logger], capsys)
    assert err == (f"fabric-lin pretrain: error: {out / 'logs'} is a file, where the {logger} logger writes its "
                   "directory: move or remove it\n")
    assert (out / "logs").read_text() == "not a directory" and sorted(p.name for p in out.iterdir()) == ["logs"]


def test_error_16_mixed_on_the_cpu(tmp_path, capsys, monkeypatch):
    """Fabric would train in bf16-mixed instead, while the checkpoints recorded 16-mixed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--precision", "16-mixed"], capsys)
    assert err == ("fabric-lin pretrain: error: --precision 16-mixed needs a CUDA GPU (the CPU has no fp16 autocast): give "
                   "--precision bf16-mixed or 32-true (exact, and the fastest on the CPU)\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("model_name, block_type", [("deltanet-debug", "deltanet"), ("transformer-debug", "transformer")])
def test_error_kernel_autotune_on_a_model_without_gla_layers(tmp_path, capsys, model_name, block_type):
    """The search is of the GLA kernels' launch settings: another family's run went on without it, unsaid."""
    err = cli_error(["pretrain", "--model_name", model_name, "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--compile.kernel_autotune", "true"], capsys)
    assert err == (f"fabric-lin pretrain: error: --compile.kernel_autotune searches the GLA kernels' launch settings; "
                   f"{model_name} is block_type '{block_type}', which has no GLA layers: leave it false\n")
    assert not (tmp_path / "out").exists()


def test_kernel_autotune_on_the_cpu_is_a_note_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    """The same recipe runs on GPUs and on the CPU, where the GLA layers run PyTorch ops and no kernel is searched:
    the run says so once, instead of leaving the search it was asked for silently undone."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    setup_pretrain(tmp_path, compile=CompileArgs(kernel_autotune=True))
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "compile.kernel_autotune" in line] == [
        "Note: compile.kernel_autotune does nothing on the CPU: it searches the launch settings of the GLA Triton kernels, "
        "and the CPU runs the GLA layers' PyTorch ops instead"]
    assert (tmp_path / "out" / "final").is_dir()


@pytest.mark.timeout(60)  # unchecked, the run waits for the other processes torchrun would have started
@pytest.mark.parametrize("flags", [[], ["--devices", "2"]])
def test_error_devices_other_than_torchrun_started(tmp_path, capsys, monkeypatch, flags):
    """Under torchrun, --devices and --num_nodes left at their defaults (or one of them) would make each of torchrun's
    processes a run of its own, or wait for ranks that never come."""
    from fabric_lin.errors import InvalidValue
    from fabric_lin.parallelism import check_torchrun_processes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # what torchrun --nnodes 2 --nproc-per-node 2 sets in the process of rank 0 (the one that prints errors)
    for name, value in dict(RANK=0, LOCAL_RANK=0, GROUP_RANK=0, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2,
                            MASTER_ADDR="localhost", MASTER_PORT=free_port()).items():
        monkeypatch.setenv(name, str(value))
    devices = flags[1] if flags else "1"
    with pytest.raises(InvalidValue):  # first: were the check missing, the command below would wait for ever
        check_torchrun_processes(int(devices), 1)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--train.global_batch_size", "4", "--train.micro_batch_size", "1", "--data", "TokenChunks",
                     "--data.data_path", str(tmp_path / "data"), *flags], capsys)
    assert err == (f"fabric-lin pretrain: error: torchrun started 4 processes, 2 on each of 2 node(s) (its --nproc-per-node "
                   f"and --nnodes), and this run has --devices {devices} --num_nodes 1: give --devices 2 --num_nodes 2\n")
    assert not (tmp_path / "out").exists()


def test_torchrun_processes_checked_only_under_torchrun(monkeypatch):
    # torchrun --nnodes 2 --nproc-per-node 2: only --devices 2 --num_nodes 2 is taken (4 processes on one node, or
    # 2 on one, are not what torchrun started); without all of torchrun's variables (a RANK set by something
    # else) there is nothing to check
    from fabric_lin.errors import InvalidValue
    from fabric_lin.parallelism import check_torchrun_processes

    torchrun = dict(RANK=0, LOCAL_RANK=0, GROUP_RANK=0, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)
    for name in torchrun:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    check_torchrun_processes(1, 1)
    for name, value in torchrun.items():
        monkeypatch.setenv(name, str(value))
    check_torchrun_processes(2, 2)
    for devices, num_nodes in ((4, 1), (2, 1), (1, 2)):
        expected = f"--devices {devices} --num_nodes {num_nodes}: give --devices 2 --num_nodes 2"
        with pytest.raises(InvalidValue, match=expected):
            check_torchrun_processes(devices, num_nodes)


LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                      "SLURM_NTASKS", "LSB_JOBID", "NODE_RANK")


def test_error_num_nodes_without_a_launcher(tmp_path, capsys, monkeypatch):
    """--num_nodes 2 typed on one machine, with nothing that starts the command on another node: Fabric started this
    node's processes, which waited for the other node's for ever. With a launcher's variables (torchrun's, SLURM's) or
    NODE_RANK (set by hand on each node, Fabric's own way, with MASTER_ADDR and MASTER_PORT), the other nodes are
    someone else's to start."""
    from fabric_lin.errors import InvalidValue
    from fabric_lin.parallelism import check_other_nodes_launched

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidValue):  # first: were the check missing, the command below would wait for ever
        check_other_nodes_launched(2)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--train.global_batch_size", "2", "--train.micro_batch_size", "1", "--devices", "1",
                     "--num_nodes", "2"], capsys)
    assert err.startswith("fabric-lin pretrain: error: --num_nodes 2: nothing starts this command on the other node(s)")
    assert "torchrun" in err and "srun" in err and "NODE_RANK" in err and "--num_nodes 1" in err
    assert not (tmp_path / "out").exists()
    check_other_nodes_launched(1)
    with monkeypatch.context() as launched:
        launched.setenv("SLURM_NTASKS", "16")
        check_other_nodes_launched(2)
    # by hand, each node needs node 0's address and port: else each would meet at a free port of its own, on its host
    with monkeypatch.context() as launched:
        launched.setenv("NODE_RANK", "1")
        launched.delenv("MASTER_ADDR", raising=False)
        launched.setenv("MASTER_PORT", "29500")
        with pytest.raises(InvalidValue, match="--num_nodes 2 with NODE_RANK set and MASTER_ADDR unset: set MASTER_ADDR"):
            check_other_nodes_launched(2)
        launched.setenv("MASTER_ADDR", "10.0.0.1")
        check_other_nodes_launched(2)


def test_error_data_parallel_choice(tmp_path):
    with pytest.raises(ValueError, match=r"parallelism.data_parallel must be 'fsdp' or 'ddp', got 'zero3'"):
        setup_pretrain(tmp_path, parallelism=ParallelismArgs(data_parallel="zero3"))
    with pytest.raises(ValueError, match=r"parallelism.fsdp_unit must be 'block' or 'model', got 'layer'"):
        setup_pretrain(tmp_path, parallelism=ParallelismArgs(fsdp_unit="layer"))
    assert not (tmp_path / "out").exists()


def test_error_out_dir_under_a_file(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(UserError) as info:
        setup_pretrain(tmp_path, out_dir=blocker / "out")
    assert str(info.value) == f"--out_dir {blocker / 'out'}: {blocker} is a file, expected a directory or nothing there"
    assert blocker.read_text() == "not a directory"


def test_error_out_dir_full(tmp_path, monkeypatch):
    import collections
    import shutil

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(UserError, match=rf"out_dir {tmp_path / 'out'} has 0.00 GB free, but one checkpoint of gla-debug takes 0.03 GB"):
        setup_pretrain(tmp_path)


# ---- where a run starts from: a checkpoint to resume, a model directory, an out_dir that holds an earlier run


def test_error_resume_path_without_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"--resume {tmp_path / 'nothing'} does not exist: expected a training "
                                                "checkpoint"):
        setup_pretrain(tmp_path, resume=tmp_path / "nothing")


def test_error_resume_from_a_model_directory_points_to_initial_checkpoint_dir(tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    torch.save(GPT(Config.from_name("gla-debug")).state_dict(), model_dir / "lit_model.pth")  # weights alone
    with pytest.raises(ValueError, match=rf"not a training checkpoint .*use --initial_checkpoint_dir {model_dir}"):
        setup_pretrain(tmp_path, resume=model_dir, eval=EvalArgs(final_validation=False))


def test_initial_checkpoint_dir_given_a_training_checkpoint_or_its_run_names_the_ways_on(tmp_path):
    """A run's checkpoint as --initial_checkpoint_dir names --resume and the conversion; the run's out_dir names the
    conversion of its checkpoint; both before any work (it was a message about lit_model.pth once the data was read)."""
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with pytest.raises(ValueError, match=rf"^--initial_checkpoint_dir {final} is a training checkpoint, and it reads a model "
                       rf"directory: to go on with that run, --resume {final}; to start a new run from its weights, "
                       rf"fabric-lin convert_pretrained_checkpoint {final} --output_dir <DIR>, then"):
        setup_pretrain(tmp_path, out_dir=tmp_path / "new", initial_checkpoint_dir=final)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'out'} is a training run's directory \(it holds final\): "
                       rf"--initial_checkpoint_dir reads a model directory; .* convert_pretrained_checkpoint {final} "):
        setup_pretrain(tmp_path, out_dir=tmp_path / "new", initial_checkpoint_dir=tmp_path / "out")
    assert not (tmp_path / "new").exists()


def test_resume_from_a_damaged_directory_refuses_in_one_line(tmp_path, capsys):
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with open(final / "lit_model.pth", "r+b") as f:
        f.truncate(4096)
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "again"), "--resume", str(final),
                     "--train.max_steps", "1", "--train.global_batch_size", "2", "--train.micro_batch_size", "2"], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: --resume {final}: the checkpoint is damaged: lit_model.pth has 4,096 "
                          f"bytes, ")
    assert "(truncated). It is not loaded" in err and final.is_dir()


def test_an_out_dir_that_is_a_model_or_data_is_refused_naming_the_flag_it_may_have_been_meant_for(tmp_path):
    """--out_dir given a model directory, a training checkpoint or a prepared data directory (a path typed for another
    flag): the run wrote final/, logs/ and metrics.jsonl into it, mixing a run with the model or the data."""
    from fabric_lin.convert.model_dir import save_model_dir
    from helpers import write_prepared

    config = Config.from_name("gla-debug")
    (tmp_path / "model").mkdir()
    save_model_dir(GPT(config).state_dict(), config, tmp_path / "model")
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "step.json").write_text('{"step_count": 1}')
    write_prepared(tmp_path / "data", torch.arange(3000) % 100, None)
    cases = {
        tmp_path / "model": "a model directory: a run writes its checkpoints, logs and metrics.jsonl into its out_dir; give "
                            "it a directory of its own (to start from this model's weights: --initial_checkpoint_dir "
                            f"{tmp_path / 'model'})",
        tmp_path / "run" / "final": "a training checkpoint: a run writes its checkpoints, logs and metrics.jsonl into its "
                                    "out_dir; give it a directory of its own (to continue this checkpoint's run: --out_dir "
                                    f"{tmp_path / 'run'} --resume auto)",
        tmp_path / "data": "a prepared data directory: a run writes its checkpoints, logs and metrics.jsonl into its out_dir; "
                           "give it a directory of its own (to train on this data: --data TextFiles --data.train_dir "
                           f"{tmp_path / 'data'})",
    }
    for out_dir, message in cases.items():
        before = sorted(p.name for p in out_dir.iterdir())
        with pytest.raises(FileExistsError) as info:
            setup_pretrain(tmp_path, out_dir=out_dir, overwrite=True)
        assert str(info.value) == f"--out_dir {out_dir} is {message}"
        assert sorted(p.name for p in out_dir.iterdir()) == before
    # a directory inside one of them: the run's checkpoints went with the checkpoint when its run pruned or replaced
    # it, and with the data when it was prepared again
    inside = {
        tmp_path / "run" / "final" / "sub": f"{tmp_path / 'run' / 'final'}, a training checkpoint, whose files are the "
                                             "ones its manifest lists and go with it when its run prunes or replaces it",
        tmp_path / "data" / "runs" / "a": f"{tmp_path / 'data'}, a prepared data directory, whose files go with it when "
                                          "it is prepared again",
    }
    for out_dir, message in inside.items():
        with pytest.raises(FileExistsError) as info:
            setup_pretrain(tmp_path, out_dir=out_dir)
        assert str(info.value) == f"--out_dir {out_dir} is inside {message}: give a directory outside it"
        assert not out_dir.exists()
    assert not (tmp_path / "data" / "runs").exists()


def test_initial_checkpoint_dir_is_checked_against_the_model(tmp_path, capsys):
    from fabric_lin.convert.model_dir import save_model_dir

    state = GPT(Config.from_name("gla-debug")).state_dict()
    state["layers.1.attn.k_proj.weight"] = (state["layers.1.attn.k_proj.weight"] * 1000).to(torch.int32)
    (tmp_path / "model").mkdir()
    save_model_dir(state, Config.from_name("gla-debug", norm_eps=1e-5), tmp_path / "model")
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.k_proj\.weight: dtype torch\.int32, expected torch\.float32"):
        setup_pretrain(tmp_path, initial_checkpoint_dir=tmp_path / "model", eval=EvalArgs(final_validation=False))
    # the model_config.yaml there differs in a field that keeps the shapes: reported before the weights
    out = capsys.readouterr().out
    assert "its model_config.yaml differs from this run's model in " in out and " norm_eps (1e-05 there, 1e-06 here)" in out


def test_initial_weights_of_another_model_name_the_flag_of_their_own(tmp_path):
    """A model directory's weights given to a run of another model (two layers where they have four): one line names
    both, then the flag that builds the directory's model: --model_name where its model_config.yaml is a named model,
    else --model_config of that file."""
    from fabric_lin.convert.model_dir import save_model_dir

    for saved, flag in ((Config.from_name("gla-debug"), "--model_name gla-debug"),
                        (Config.from_name("gla-debug", norm_eps=1e-5), f"--model_config {tmp_path / 'model' / 'model_config.yaml'}")):
        (tmp_path / "model").mkdir()
        save_model_dir(GPT(saved).state_dict(), saved, tmp_path / "model")
        with pytest.raises(ValueError) as info:
            setup_pretrain(tmp_path, model_name=None, model_config=Config.from_name("gla-debug", num_layers=2),
                           initial_checkpoint_dir=tmp_path / "model")
        assert str(info.value) == (
            f"--initial_checkpoint_dir {tmp_path / 'model' / 'lit_model.pth'} holds a GLA model (4 layers, width 128; its "
            f"layers hold attn.gk_proj.0.weight) and this run builds gla-debug, a GLA model (2 layers, width 128): they "
            f"are the model of its model_config.yaml: start this run with {flag}")
        shutil.rmtree(tmp_path / "model")
    assert not (tmp_path / "out").exists()


def test_initial_weights_of_another_family_are_refused_in_one_line(tmp_path, capsys):
    """A GLA model directory given to a run of Gated DeltaNet: one line naming both families and the flag that builds
    the directory's model, before any weights are read, where a warning listed the fields that differ and the error
    then listed some 80 tensors over several lines."""
    from fabric_lin.convert.model_dir import save_model_dir

    saved = Config.from_name("gla-debug")
    (tmp_path / "model").mkdir()
    save_model_dir(GPT(saved).state_dict(), saved, tmp_path / "model")
    capsys.readouterr()
    with pytest.raises(ValueError) as info:
        setup_pretrain(tmp_path, model_name="gdn-debug", initial_checkpoint_dir=tmp_path / "model")
    assert str(info.value) == (
        f"--initial_checkpoint_dir {tmp_path / 'model'} holds a gla model (gla-debug, its model_config.yaml) and this run "
        "builds a gdn one (gdn-debug): the weights of one family are not those of the other's layers; start this run "
        "with --model_name gla-debug")
    assert "Warning" not in capsys.readouterr().out and not (tmp_path / "out" / "final").exists()


def test_a_fresh_run_into_a_used_out_dir_refuses_and_names_the_ways_on(tmp_path, capsys):
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    out = tmp_path / "out"
    (out / "step-00000005").mkdir()  # an earlier run's step beyond this run's max_steps
    first = (out / "final" / "lit_model.pth").read_bytes()
    with pytest.raises(FileExistsError, match=rf"out_dir {out} holds the checkpoints of an earlier run \(final, step-00000005\); "
                       r"a new run would put its own beside them. Continue that run with --resume auto, write this one to "
                       r"another --out_dir, or start afresh with --overwrite true \(deletes those checkpoints\)"):
        setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    assert (out / "final" / "lit_model.pth").read_bytes() == first  # untouched
    # the same from the command line: one line
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(out), "--train.max_steps", "1"], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: out_dir {out} holds the checkpoints of an earlier run")
    # an earlier run of another model (its newest checkpoint with a model_config.yaml says which): continuing it is no
    # way on for this run, whose resume would be refused
    with pytest.raises(FileExistsError) as info:
        setup_pretrain(tmp_path, model_name="gdn-debug", eval=EvalArgs(final_validation=False))
    assert str(info.value) == (
        f"out_dir {out} holds the checkpoints of an earlier run of gla-debug (final, step-00000005), and this run trains "
        f"gdn-debug, which cannot continue it: write this one to another --out_dir, or start afresh with --overwrite true "
        f"(deletes those checkpoints)")
    # contradictions are refused before any work
    with pytest.raises(ValueError, match="--overwrite true deletes the checkpoints .* that --resume auto would continue from"):
        setup_pretrain(tmp_path, overwrite=True, resume="auto")
    with pytest.raises(ValueError, match="--overwrite true would delete the checkpoint --resume .*final names"):
        setup_pretrain(tmp_path, overwrite=True, resume=out / "final")
    # a mistyped --resume path is named as such, not taken for a fresh run into the used out_dir
    with pytest.raises(FileNotFoundError, match=rf"--resume {out / 'fnal'} does not exist: expected a training checkpoint "
                       rf"\(a run's step-XXXXXXXX/ or final/\); {out} holds step-00000005, final"):
        setup_pretrain(tmp_path, resume=out / "fnal")
    # so is the run's out_dir given one level too high, where its checkpoints are
    with pytest.raises(ValueError, match=rf"--resume {out} is a run's out_dir, not one of its checkpoints \(step-00000005, "
                       rf"final\): to continue from its newest, give --out_dir {out} --resume auto; or name one, "
                       rf"e.g. --resume {out / 'step-00000005'}"):
        setup_pretrain(tmp_path, resume=out)
    # --overwrite true: the earlier run's checkpoints and metrics are gone, only this run's are there
    (out / "metrics.jsonl").write_text('{"step": 99, "loss": 1.0, "attempt": 2}\n')
    (out / "metrics.superseded.jsonl").write_text('{"step": 98, "loss": 1.5, "attempt": 1}\n')  # it was resumed
    (out / ".tmp-metrics.jsonl").write_text('{"step": 97, "loss": 2.0, "attempt": 1}\n')  # killed in a rewrite
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32, save_interval=1)
    setup_pretrain(tmp_path, overwrite=True, train=train, eval=EvalArgs(final_validation=False))
    assert (f"--overwrite true: deleted the earlier run's checkpoints and metrics in {out}: final, step-00000005, "
            "metrics.jsonl, metrics.superseded.jsonl, .tmp-metrics.jsonl") in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step-", "final", "."))) == ["final", "step-00000001"]
    assert not (out / "metrics.superseded.jsonl").exists()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in records} == {1, 2} and {r["attempt"] for r in records} == {1}  # a history of its own
    # the checkpoints record no overwrite: `--config <their hyperparameters.yaml> --resume auto` is not refused
    assert "overwrite" not in (out / "final" / "hyperparameters.yaml").read_text()


def test_overwrite_keeps_the_earlier_run_when_the_start_up_refuses_the_command(tmp_path):
    """--overwrite true with a mistake that the start-up finds (a tokenizer directory without its tokenizer.model, a
    --resume checkpoint of another run that this command differs from) is refused, and the earlier run in out_dir is
    left as it was: the command that deletes it is one that goes on to train."""
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    setup_pretrain(tmp_path, out_dir=tmp_path / "other", eval=EvalArgs(final_validation=False),
                   train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32))
    out = tmp_path / "out"
    kept = {path: path.read_bytes() for path in (out / "final" / "lit_model.pth", out / "metrics.jsonl")}
    (tmp_path / "no_tokenizer").mkdir()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.model does not exist"):
        setup_pretrain(tmp_path, overwrite=True, tokenizer_dir=tmp_path / "no_tokenizer")
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in train\.max_steps: 2 in the checkpoint, 1 here"):
        setup_pretrain(tmp_path, overwrite=True, resume=tmp_path / "other" / "final")
    assert {path: path.read_bytes() for path in kept} == kept


def test_resume_auto_refuses_to_start_again_where_the_runs_checkpoints_went_missing(tmp_path):
    """metrics.jsonl records each checkpoint saved: --resume auto in an out_dir whose checkpoints were moved away does
    not take it for a run that never saved one (which starts from step 0), and names them."""
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    out = tmp_path / "out"
    assert [r["checkpoint"] for r in metrics_records(out) if "checkpoint" in r] == ["final"]
    moved = (out / "final").rename(tmp_path / "final")
    with pytest.raises(FileNotFoundError, match=rf"--resume auto: out_dir {out} holds no checkpoint, but its metrics.jsonl "
                       r"records the ones the run saved there \(final\): they were moved or deleted. Put them back, or "
                       r"resume from one with --resume <dir>; to start again from step 0 here: --resume false --overwrite true"):
        setup_pretrain(tmp_path, resume="auto")
    assert not (out / "final").exists()
    # a run stopped before its first checkpoint recorded none: --resume auto starts it again
    moved.rename(tmp_path / "elsewhere")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 8.3, "attempt": 1}\n')
    setup_pretrain(tmp_path, resume="auto", eval=EvalArgs(final_validation=False))
    assert (out / "final").is_dir()


def test_a_finished_run_continued_to_a_later_end_keeps_its_earlier_end(tmp_path, capsys):
    """A finished run continued with a larger max_steps writes its new final/ over the old one: the old one, the model
    at the end of the first schedule (often no step-* holds it), stays as the step-* checkpoint of its step. The
    learning rate, decayed to min_lr, jumps to the longer cosine's value at that step, and the resume says so."""
    from fabric_lin.pretrain import learning_rate_jump

    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, save_interval=None,
                      lr_warmup_steps=0, min_lr=4e-5)
    setup_pretrain(tmp_path, train=train, eval=EvalArgs(final_validation=False), optimizer=OptimizerArgs(lr=4e-4))
    out = tmp_path / "out"
    first_end = {p.name: p.read_bytes() for p in (out / "final").iterdir()}
    (out / "evaluate" / "final").mkdir(parents=True)  # `fabric-lin evaluate out/final` wrote its results
    (out / "evaluate" / "final" / "evaluate.json").write_text('{"step": 1}\n')
    state = {"step_count": 1, "tokens_seen": 64, "schedule_tokens_per_step": 64}
    assert learning_rate_jump(out / "final", train, 4e-4, state) is None  # the same settings: the same curve
    # at the end of its schedule a resume trains no step: no learning rate to tell of, though min_lr changed
    assert learning_rate_jump(out / "final", replace(train, min_lr=0.0), 4e-4, state) is None
    setup_pretrain(tmp_path, train=replace(train, max_steps=2), eval=EvalArgs(final_validation=False), resume="auto",
                   resume_changes=["train.max_steps"], optimizer=OptimizerArgs(lr=4e-4))
    printed = capsys.readouterr().out
    assert f"Kept the earlier end of the run, {out / 'final'} at step 1, as {out / 'step-00000001'}" in printed
    # step 2 of a 2-step cosine without warmup is half-way down: 4e-5 + (4e-4 - 4e-5) / 2; the 1-step run ended at min_lr
    assert ("Note: step 2 trains at learning rate 2.20e-04, where the checkpoint's settings give 4.00e-05: the schedule "
            "is a function of the tokens trained, so the learning rate jumps here (no new warmup)") in printed
    assert [r["lr"] for r in metrics_records(out) if r.get("step") == 2 and "lr" in r] == [pytest.approx(2.2e-4)]
    assert {p.name: p.read_bytes() for p in (out / "step-00000001").iterdir()} == first_end
    assert json.loads((out / "final" / "step.json").read_text())["step_count"] == 2
    # the results of the earlier end go with it, and the new final/ has none yet
    assert (out / "evaluate" / "step-00000001" / "evaluate.json").read_text() == '{"step": 1}\n'
    assert not (out / "evaluate" / "final").exists()
    # run again to the same end (from an earlier checkpoint), final/ is replaced: the step holds nothing new
    (out / "evaluate" / "final").mkdir()
    (out / "evaluate" / "final" / "evaluate.json").write_text('{"step": 2}\n')
    setup_pretrain(tmp_path, train=replace(train, max_steps=2), eval=EvalArgs(final_validation=False),
                   resume=out / "step-00000001", resume_changes=["train.max_steps"])
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step-", "final"))) == ["final", "step-00000001"]
    # the replaced final's results went
    assert sorted(p.name for p in (out / "evaluate").iterdir()) == ["step-00000001"]


def test_a_resume_from_an_earlier_checkpoint_sets_the_later_ones_aside(tmp_path, capsys, monkeypatch):
    """Back to step 1 of a finished 4-step run (before a loss spike, say), and preempted after a step: the replaced
    attempt's later checkpoints (step-2, step-3, final at step 4) would be the newest for the next --resume auto, which
    would go on from the abandoned attempt. They are kept aside, out of its way; --overwrite true deletes them."""
    import signal

    from fabric_lin.checkpoint import checkpoint_dirs, delete_checkpoints, earlier_run_checkpoints
    from fabric_lin.metrics import MetricsWriter

    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=4, max_seq_length=32, save_interval=1)
    setup_pretrain(tmp_path, train=train, eval=EvalArgs(final_validation=False))
    out = tmp_path / "out"
    replaced = {p.name: (p / "lit_model.pth").read_bytes() for p in checkpoint_dirs(out) if p.name != "step-00000001"}
    assert sorted(replaced) == ["final", "step-00000002", "step-00000003"]
    first_step = MetricsWriter.log_first_step

    def preempted_after_the_first_step(self, step):  # a scheduler's SIGTERM: the run saves where it stops
        first_step(self, step)
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(MetricsWriter, "log_first_step", preempted_after_the_first_step)
    capsys.readouterr()
    setup_pretrain(tmp_path, train=train, eval=EvalArgs(final_validation=False), optimizer=OptimizerArgs(lr=1e-4),
                   resume=out / "step-00000001")
    printed = capsys.readouterr().out
    assert ("Resuming from an earlier checkpoint: the later ones are set aside, out of --resume auto's way: "
            ".superseded-final, .superseded-step-00000003, .superseded-step-00000002") in printed
    assert {name: (out / f".superseded-{name}" / "lit_model.pth").read_bytes() for name in replaced} == replaced
    # what --resume auto tries first is where this attempt stopped, and no checkpoint of the replaced attempt is left
    assert f"checkpoint saved in {checkpoint_dirs(out)[0]}" in printed
    assert all((p / "lit_model.pth").read_bytes() != replaced.get(p.name) for p in checkpoint_dirs(out))
    assert ".superseded-final" in earlier_run_checkpoints(out)  # a fresh run into this out_dir is refused
    delete_checkpoints(out)
    assert not [p for p in out.iterdir() if p.name.startswith((".superseded-", "step-", "final"))]


def test_hyperparameters_yaml_is_a_config_for_the_next_run(tmp_path):
    """The hyperparameters.yaml in a checkpoint records this run's resolved arguments, and `--config` reads
    it back: the same groups, and a run continued from it."""
    from fabric_lin.cli import main as cli_main

    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=32, lr_warmup_steps=1)
    setup_pretrain(tmp_path, train=train, eval=EvalArgs(final_validation=False),
           parallelism=ParallelismArgs(fsdp_unit="model"), compile=CompileArgs(dynamic=False, mode="default"))
    hparams = tmp_path / "out" / "final" / "hyperparameters.yaml"
    cfg = parse_run_config(hparams)
    assert cfg.model_name == "gla-debug" and cfg.devices == 1 and cfg.precision == "32-true"  # resolved
    assert cfg.train == train and cfg.eval == EvalArgs(final_validation=False)
    assert cfg.parallelism == ParallelismArgs(fsdp_unit="model")
    assert cfg.compile == CompileArgs(enabled=False, dynamic=False, mode="default")  # enabled resolved for the CPU
    assert type(cfg.data).__name__ == "SampleCorpus" and tuple(cfg.data.weights) == (0.693584, 0.306416)
    cli_main(["pretrain", "--config", str(hparams), "--resume", "auto", "--train.max_steps", "2",
              "--resume_changes", "[train.max_steps]"])
    assert json.loads((tmp_path / "out" / "final" / "step.json").read_text())["step_count"] == 2


def test_the_hyperparameters_yaml_of_a_moved_run_names_both_places(tmp_path, capsys):
    """A run directory moved elsewhere: `--config <its checkpoint>/hyperparameters.yaml --resume auto` would go on in the
    out_dir the file records, the old place, and start again from step 0 there. Refused, unless --out_dir says where."""
    from fabric_lin.cli import main as cli_main

    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    moved = (tmp_path / "out").rename(tmp_path / "moved")
    hparams = moved / "final" / "hyperparameters.yaml"
    err = cli_error(["pretrain", "--config", str(hparams), "--resume", "auto"], capsys)
    assert err == (f"fabric-lin pretrain: error: --config {hparams}: it records out_dir {tmp_path / 'out'}, but its "
                   f"checkpoint now lies in {moved} (the run was moved or copied). Give --out_dir {moved} to go on where "
                   f"it lies (with --resume auto), or --out_dir {tmp_path / 'out'} to write to the recorded place\n")
    assert not (tmp_path / "out").exists()
    cli_main(["pretrain", "--config", str(hparams), "--resume", "auto", "--out_dir", str(moved)])
    assert "Nothing to train: the checkpoint is at step 1" in capsys.readouterr().out


def test_compile_caches_are_the_runs_while_it_lasts_and_the_callers_again_after(tmp_path, monkeypatch):
    """A run started from Python keeps Triton's and torch.compile's caches in out_dir/compile_cache while it lasts
    (where Fabric's processes inherit them) and leaves the caller's environment as it was, also when it fails."""
    import fabric_lin.pretrain as pretrain

    names = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/callers/triton")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seen = []

    def main(fabric, config, **kwargs):
        seen.append({name: os.environ.get(name) for name in names})
        if len(seen) == 2:
            raise RuntimeError("the run failed")

    monkeypatch.setattr(pretrain, "main", main)
    setup_pretrain(tmp_path)
    cache = (tmp_path / "out" / "compile_cache").absolute()
    assert seen == [{"TRITON_CACHE_DIR": str(cache / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}]
    assert os.environ["TRITON_CACHE_DIR"] == "/callers/triton" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    with pytest.raises(RuntimeError, match="the run failed"):
        setup_pretrain(tmp_path / "second")
    assert len(seen) == 2 and seen[1]["TRITON_CACHE_DIR"].startswith(str(tmp_path / "second"))
    assert os.environ["TRITON_CACHE_DIR"] == "/callers/triton" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    setup_pretrain(tmp_path / "third", compile=CompileArgs(cache=False))
    assert seen[2] == {"TRITON_CACHE_DIR": "/callers/triton", "TORCHINDUCTOR_CACHE_DIR": None}
