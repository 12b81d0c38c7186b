"""fabric_lin/cli.py: the `fabric-lin` command line. Its parsing (data module classes, keys of nested classes, the
option groups as files), its errors in one line with a hint and exit code 2 (bad values, abbreviated or unknown
flags, keys a config file may not hold, a data module's own check), bugs told from anticipated failures, errors
printed by rank 0 alone, a lost peer process in one line with exit code 75, and `--help` in whole sentences."""
import os

import pytest
import torch

from fabric_lin.args import TrainArgs
from fabric_lin.config import Config
from fabric_lin.lr_schedule import learning_rate
from helpers import CONFIG_HUB, cli_error, parse_error


def test_cli_accepts_data_module_subclass_and_rejects_unknown_keys(capsys):
    """`--data TokenChunks --data.data_path X` is parsed into the data module; a wrong key is named."""
    from jsonargparse import ArgumentParser

    from fabric_lin.data import DataModule, TokenChunks
    from fabric_lin.pretrain import setup  # noqa: F401  (enables data module subclasses)

    parser = ArgumentParser()
    parser.add_argument("--data", type=DataModule)
    cfg = parser.parse_args(["--data", "TokenChunks", "--data.data_path", "/some/dir", "--data.num_workers", "0"])
    data = parser.instantiate(cfg).data
    assert isinstance(data, TokenChunks) and str(data.data_path) == "/some/dir" and data.num_workers == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--data", "TokenChunks", "--data.no_such_key", "1"])
    assert "no_such_key" in capsys.readouterr().err


def test_cli_lists_the_valid_keys_of_a_nested_class(tmp_path, capsys):
    """An unknown key inside model_config: or a data module is named with the closest key and the keys the class
    accepts."""
    from fabric_lin.cli import main as cli_main

    config = tmp_path / "run.yaml"
    config.write_text("model_config:\n  hiden_size: 128\n")
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert ("fabric_lin.config.Config has no option 'hiden_size' (did you mean hidden_size?); valid options are: name, "
            "block_type, vocab_size, hidden_size,") in err
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--model_name", "gla-debug", "--data", "SampleCorpus", "--data.sede", "3"])
    assert ("fabric_lin.data.SampleCorpus has no option 'sede' (did you mean seed?); valid options are: seed, "
            "num_workers,") in capsys.readouterr().err


def test_a_bad_value_is_one_line_and_a_hint_not_the_usage(tmp_path, capsys):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--train.max_steps", "abc"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        "fabric-lin pretrain: error: train.max_steps: got abc, expected int or null\n"
        "(fabric-lin pretrain --help lists the options)\n"
    )
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--model_name", "gla-debug", "--precision", "bf16"])
    assert capsys.readouterr().err.startswith(
        "fabric-lin pretrain: error: precision: got bf16, expected one of 'bf16-mixed', 'bf16-true', '16-mixed', '32-true' or null\n"
    )


def test_a_bad_value_from_a_config_file_names_the_file(tmp_path, capsys):
    """With two --config files, a --model_config file, one that a config file names or an option group's file, the
    one line named the key and the value but not the file they came from. A value given on the command line names
    none."""
    run, more, model, train = (tmp_path / name for name in ("run.yaml", "more.yaml", "model.yaml", "train.yaml"))
    run.write_text("model_name: gla-debug\ntrain:\n  max_steps: 2\n")
    more.write_text("train:\n  max_steps: many\n")
    model.write_text("hidden_size: big\nnum_layers: 2\n")
    train.write_text("max_steps: many\n")
    (tmp_path / "names_model.yaml").write_text(f"model_config: {model}\n")
    out = ["--out_dir", str(tmp_path / "out")]
    max_steps = "fabric-lin pretrain: error: train.max_steps: got many, expected int or null"
    hidden_size = "fabric-lin pretrain: error: model_config.hidden_size: got big, expected int or null"
    assert parse_error(["pretrain", "--config", str(run), "--config", str(more), *out], capsys) == f"{max_steps} (in {more})"
    assert parse_error(["pretrain", "--model_config", str(model), *out], capsys) == f"{hidden_size} (in {model})"
    assert parse_error(["pretrain", "--config", str(tmp_path / "names_model.yaml"), *out],
                       capsys) == f"{hidden_size} (in {model})"
    assert parse_error(["pretrain", "--model_name", "gla-debug", "--train", str(train), *out],
                       capsys) == f"{max_steps} (in {train})"
    assert parse_error(["pretrain", "--config", str(run), "--train.max_steps", "many", *out], capsys) == max_steps


@pytest.mark.parametrize("flags,message", [
    (["--resume_changes", "train.max_steps"], "resume_changes: got train.max_steps, expected list or null; in brackets, "
                                              "quoted for the shell: --resume_changes '[train.max_steps]'"),
    (["--data", "TextFiles", "--data.train_weights", "1,2"],
     "data.train_weights: got 1,2, expected list or null; in brackets, quoted for the shell: --data.train_weights '[1,2]'"),
    (["--data", "TextFiles", "--data.train_weights", "1 2"],  # YAML reads '[1 2]' as a list of the one string '1 2'
     "data.train_weights: got 1 2, expected list or null; in brackets, quoted for the shell: --data.train_weights '[1, 2]'"),
    (["--optimizer.betas", "0.9"], "optimizer.betas: got 0.9, expected tuple; in brackets, quoted for the shell: "
                                   "--optimizer.betas '[a, b]'"),
])
def test_a_list_given_without_brackets_is_shown_as_it_is_written(capsys, flags, message):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--model_name", "gla-debug", *flags])
    assert capsys.readouterr().err.splitlines()[0] == f"fabric-lin pretrain: error: {message}"
    # as the message writes it, the command line takes it (the next error is a later one's)
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--model_name", "nope", "--resume_changes", "[train.max_steps]"])
    assert "Unknown model name 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["evaluate", "ckpt", "--seq_len", "[256,", "512]"],
     "seq_len: got [256,, expected int or list or null; the shell cut the list at its spaces: quote it whole, "
     "--seq_len '[256, ...]'"),
    (["pretrain", "--resume_changes", "[data,", "train.max_steps]"],
     "resume_changes: got [data,, expected list or null; the shell cut the list at its spaces: quote it whole, "
     "--resume_changes '[data, ...]'"),
    (["pretrain", "--data", "TextFiles", "--data.train_dir", "[data/a/train,", "data/b/train]"],
     "unexpected argument data/b/train]: the end of a list that the shell cut at its spaces; quote the whole list, "
     "e.g. '[a, b]'"),
])
def test_a_list_the_shell_cut_at_its_spaces_is_said_to_be_quoted(capsys, argv, message):
    """`--seq_len [256, 512]` unquoted reaches the command as two words: the first was refused as `got [256,`, or taken
    for a path and the second called an argument the command does not take, neither saying what to do."""
    assert parse_error(argv, capsys) == f"fabric-lin {argv[0]}: error: {message}"


@pytest.mark.parametrize("flags", [["--train.max_step", "10"], ["--train.max_step=10"], ["--eval.max_iter", "2"]])
def test_an_abbreviated_flag_is_refused(tmp_path, capsys, flags):
    from fabric_lin.cli import main as cli_main

    # a micro batch of 0, refused before any work: were the flag taken for --train.max_steps, the test would not train
    # for minutes before it fails
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), *flags,
                  "--train.micro_batch_size", "0"])
    assert info.value.code == 2
    option = flags[0].split("=")[0]
    assert capsys.readouterr().err.startswith(
        f"fabric-lin pretrain: error: unknown option {option} (did you mean {option}s?); options are not abbreviated\n"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags,message", [
    (["--compile_cache", "false"], "unknown option --compile_cache (did you mean --compile.cache?)"),
    (["--compile_mode=default"], "unknown option --compile_mode (did you mean --compile.mode?)"),
    (["--fsdp_unit", "model"], "unknown option --fsdp_unit (did you mean --parallelism.fsdp_unit?)"),
    (["--learning_rate", "1e-3"], "unknown option --learning_rate"),
    (["--train.max_step", "3"], "unknown option --train.max_step (did you mean --train.max_steps?); options are not abbreviated"),
    # Lightning's and LitGPT's name for it, which no spelling of fabric-lin's resembles
    (["--strategy", "fsdp"], "unknown option --strategy (did you mean --parallelism.data_parallel fsdp or ddp?)"),
    (["--strategy=ddp"], "unknown option --strategy (did you mean --parallelism.data_parallel fsdp or ddp?)"),
    (["--fsdp", "true"], "unknown option --fsdp (did you mean --parallelism.data_parallel fsdp?)"),
    # LitGPT's form of an optimizer's keys, and a key's name given without its group (or in another group)
    (["--optimizer.init_args.lr", "1e-3"], "unknown option --optimizer.init_args.lr (did you mean --optimizer.lr?)"),
    (["--lr", "1e-3"], "unknown option --lr (did you mean --optimizer.lr?)"),
    (["--train.weight_decay", "0.1"], "unknown option --train.weight_decay (did you mean --optimizer.weight_decay?)"),
    (["--activation_checkpointing", "true"],
     "unknown option --activation_checkpointing (did you mean --parallelism.activation_checkpointing?)"),
])
def test_unknown_command_line_keys_are_named_with_the_closest_one(tmp_path, capsys, flags, message):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"fabric-lin pretrain: error: {message}\n(fabric-lin pretrain --help lists the options)\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,message", [
    # a second path where the command takes one (the output directory is an option)
    (["convert_to_hf", "model", "out"], "unexpected argument out: this command takes 1: model_dir; the rest are options "
                                        "(--name value): did you mean --output_dir out?"),
    (["generate", "model", "Hello"], "unexpected argument Hello: this command takes 1: checkpoint_dir; the rest are options "
                                     "(--name value): did you mean --prompt Hello?"),
    (["generate", "model", "The", "capital"], "unexpected argument The capital: this command takes 1: checkpoint_dir; the "
                                              "rest are options (--name value): did you mean --prompt 'The capital'?"),
    # an unquoted prompt after --prompt: the shell cut it at its spaces (was "did you mean --prompt_file capital?")
    (["generate", "model", "--prompt", "The", "capital", "of"], "unexpected argument capital of: this command takes 1: "
                                                                "checkpoint_dir; the rest are options (--name value): did "
                                                                "you mean --prompt 'The capital of'?"),
    (["generate", "model", "--stop=end", "of", "--top_k", "5"], "unexpected argument of: this command takes 1: "
                                                                "checkpoint_dir; the rest are options (--name value): did "
                                                                "you mean --stop 'end of'?"),
    # LitGPT's `litgpt pretrain <model>`, `litgpt convert_... <dir>`: a command that takes no argument
    (["pretrain", "gla-debug"], "unexpected argument gla-debug: this command takes none; the rest are options (--name value): "
                                "did you mean --model_name gla-debug?"),
    (["convert_from_llama", "checkpoints/mistral"], "unexpected argument checkpoints/mistral: this command takes none; the "
                                                    "rest are options (--name value): did you mean --checkpoint_dir "
                                                    "checkpoints/mistral?"),
    (["prepare_text", "data/raw"], "unexpected argument data/raw: this command takes none; the rest are options "
                                   "(--name value): did you mean --input_dir data/raw?"),
    (["train_tokenizer", "data/raw"], "unexpected argument data/raw: this command takes none; the rest are options "
                                      "(--name value): did you mean --input_dir data/raw?"),
    (["pretrain", "config_hub/debug.yaml"], "unexpected argument config_hub/debug.yaml: this command takes none; the rest "
                                            "are options (--name value): did you mean --config config_hub/debug.yaml?"),
    # the options given already are not guessed again: the first of the others
    (["prepare_text", "--input_dir", "data/raw", "data/out"], "unexpected argument data/out: this command takes none; the "
                                                             "rest are options (--name value): did you mean --output_dir "
                                                             "data/out?"),
    (["convert_from_llama", "--checkpoint_dir", "llama", "out/gla"], "unexpected argument out/gla: this command takes "
                                                                     "none; the rest are options (--name value)"),
    # no option of the command takes such a word first: nothing guessed
    (["pretrain", "out/pretrain/debug"], "unexpected argument out/pretrain/debug: this command takes none; the rest are "
                                         "options (--name value)"),
    (["evaluate", "model", "results"], "unexpected argument results: this command takes 1: checkpoint_dir; the rest are "
                                       "options (--name value)"),
])
def test_a_stray_word_is_named_with_what_the_command_takes(capsys, argv, message):
    from fabric_lin.cli import main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err == f"fabric-lin {argv[0]}: error: {message}\n(fabric-lin {argv[0]} --help lists the options)\n"


def test_a_file_given_for_the_prompt_is_named_with_prompt_file(tmp_path, monkeypatch, capsys):
    """`fabric-lin generate MODEL prompt.txt`: the word names a file, whose text --prompt_file reads; it was named with
    no option at all (a path is no prompt)."""
    from fabric_lin.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompt.txt").write_text("The capital of France\n")
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "model", "prompt.txt"])
    assert info.value.code == 2
    assert capsys.readouterr().err == ("fabric-lin generate: error: unexpected argument prompt.txt: this command takes 1: "
                                       "checkpoint_dir; the rest are options (--name value): did you mean --prompt_file "
                                       "prompt.txt?\n(fabric-lin generate --help lists the options)\n")


@pytest.mark.parametrize("argv,message", [
    (["convert_from_llama"], "--checkpoint_dir is required: the Hugging Face Llama or Mistral directory to convert"),
    (["convert_from_llama", "--checkpoint_dir", "llama"], "--output_dir is required: where to write the model directory"),
    (["convert_pretrained_checkpoint", "ckpt"], "--output_dir is required: where to write the model directory"),
    (["convert_to_hf", "model"], "--output_dir is required: where to write the fla-format export"),
    (["convert_from_hf", "hf"], "--output_dir is required: where to write the model directory"),
])
def test_a_missing_required_option_is_named_once_with_what_it_takes(capsys, argv, message):
    """The converters' own check: its message began with the command's name, which the CLI puts before every error
    (`fabric-lin convert_to_hf: error: convert_to_hf: --output_dir is required`)."""
    assert cli_error(argv, capsys) == f"fabric-lin {argv[0]}: error: {message}\n"


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`fabric-lin pretrain list | head -1`: the reader closes the pipe before the names are written. The command ends as
    a program ended by SIGPIPE does (exit 141, nothing on stderr), where it printed BrokenPipeError's traceback."""
    import signal
    import subprocess
    import sys

    from helpers import REPO

    command = subprocess.Popen([sys.executable, "-m", "fabric_lin.cli", "pretrain", "list"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    command.stdout.close()  # the reader gone before the command writes
    assert (command.wait(timeout=60), command.stderr.read().decode()) == (128 + signal.SIGPIPE, "")
    command.stderr.close()


def test_unknown_config_file_keys_are_named(tmp_path, capsys):
    from fabric_lin.cli import main as cli_main

    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\ncompile_cache: true\n")
    with pytest.raises(SystemExit):
        cli_main(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")])
    assert capsys.readouterr().err.startswith("fabric-lin pretrain: error: Subcommand 'pretrain' does not accept option 'compile_cache'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["true", "false"])
def test_compile_given_a_boolean_names_compile_enabled(tmp_path, capsys, value):
    """`--compile true` (a flag of flame's and of earlier fabric-lin) is the group given a word: the error named the
    group's keys, not the one that switches compilation."""
    err = parse_error(["pretrain", "--model_name", "gla-debug", "--compile", value], capsys)
    assert err == (f"fabric-lin pretrain: error: compile: got {value}, expected a mapping of its keys (enabled, cache, "
                   f"dynamic, mode, kernel_autotune, precompile), or the path of a YAML file of them (did you mean --compile.enabled "
                   f"{value}?)")


def test_a_compile_group_file_is_not_taken_for_the_old_compile_flag(tmp_path, capsys):
    """`--compile FILE` (a YAML file of the group) and `--compile '{...}'` are the new form: parsed, then
    refused here for another reason (max_steps 0), which shows that parsing went through."""
    group = tmp_path / "compile.yaml"
    group.write_text("enabled: false\ncache: false\n")
    for value in (str(group), '{"enabled": false}'):
        err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"),
                         "--compile", value, "--train.max_steps", "0"], capsys)
        assert err == "fabric-lin pretrain: error: train.max_steps must be positive, got 0\n"


@pytest.mark.parametrize("command,flags,message", [
    ("pretrain", ["--data.train_dir", "data/train"],
     "data: --data.train_dir is an option of TextFiles: give --data TextFiles before it"),
    # the module given after its option: jsonargparse reads the flags in order
    ("pretrain", ["--data.val_dir", "data/val", "--data", "TextFiles"],
     "data: --data.val_dir is an option of TextFiles: give --data TextFiles before it"),
    ("evaluate", ["--data.data_path", "data"],
     "data: --data.data_path is an option of TokenChunks and SlimPajamaStarcoder: give --data with one of them before it"),
    ("evaluate", ["--data.valdir", "data/val"],
     "data: fabric_lin.data.DataModule has no option 'valdir'; valid options are: seed, num_workers"),
])
def test_a_data_module_s_option_before_the_module_names_the_modules_that_take_it(capsys, command, flags, message):
    """`--data.val_dir DIR` without --data, or before it: jsonargparse read the option for the base class, and the error
    listed the base class's options (seed, num_workers), where the module that takes it is the way on."""
    positional = ["checkpoint"] if command == "evaluate" else ["--model_name", "gla-debug"]
    assert parse_error([command, *positional, *flags], capsys) == f"fabric-lin {command}: error: {message}"


@pytest.mark.parametrize("content,message", [
    ("data:\n  train_dir: data/train\n",
     "data: train_dir is an option of TextFiles: in a config file, give it under data's init_args, beside "
     "class_path: TextFiles"),
    ("data:\n  data_path: data\n",
     "data: data_path is an option of TokenChunks and SlimPajamaStarcoder: in a config file, give it under data's "
     "init_args, beside the class_path of one of them"),
])
def test_a_data_module_s_option_in_a_config_file_without_the_module_says_where_it_goes(tmp_path, capsys, content,
                                                                                    message):
    """`data: {train_dir: ...}` in a config file was answered as the command line's `--data.train_dir` is: "give
    --data TextFiles before it", which a config file has no place for."""
    (tmp_path / "run.yaml").write_text("model_name: gla-debug\n" + content)
    err = parse_error(["pretrain", "--config", str(tmp_path / "run.yaml"), "--out_dir", str(tmp_path / "out")], capsys)
    assert err == f"fabric-lin pretrain: error: {message} (in {tmp_path / 'run.yaml'})"


def test_error_data_options_without_a_data_module(tmp_path, capsys):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"),
                     "--train.max_steps", "1", "--data.num_workers", "2"], capsys)
    assert err.startswith("fabric-lin pretrain: error: --data.* options need a data module: give --data SampleCorpus")


def test_a_data_modules_own_check_is_one_line_though_jsonargparse_wraps_it(tmp_path, capsys):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--data", "SlimPajamaStarcoder", "--data.weights", "[1, -1]"], capsys)
    assert err.startswith("fabric-lin pretrain: error: data.weights must be two positive numbers, the shares of SlimPajama and "
                          "Starcoder (default [0.693584, 0.306416]); got [1.0, -1.0]")


def test_error_negative_num_workers_is_one_line(tmp_path, capsys):
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--data", "SampleCorpus", "--data.num_workers", "-1"], capsys)
    assert err.startswith("fabric-lin pretrain: error: data.num_workers must be 0 (load in the training process) or a "
                          "positive number of DataLoader worker processes per rank, got -1")
    assert not (tmp_path / "out").exists()


def test_an_unexpected_error_keeps_its_traceback_and_the_debug_flag_shows_every_one(tmp_path, capsys, monkeypatch):
    from fabric_lin import pretrain
    from fabric_lin.cli import main as cli_main

    argv = ["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
            "--train.global_batch_size", "2", "--train.micro_batch_size", "2", "--data", "TokenChunks",
            "--data.data_path", str(tmp_path / "nothing")]
    assert cli_error(argv, capsys).startswith("fabric-lin pretrain: error: Prepared data directory")
    monkeypatch.setenv("FABRIC_LIN_DEBUG", "1")  # the exception itself, with its traceback
    with pytest.raises(FileNotFoundError, match="Prepared data directory"):
        cli_main(argv)
    monkeypatch.delenv("FABRIC_LIN_DEBUG")

    def bug(*args, **kwargs):
        return {}["no such key"]

    monkeypatch.setattr(pretrain, "check_out_dir", bug)
    with pytest.raises(KeyError):  # not an anticipated failure: not turned into one line
        cli_main(argv)


def test_a_lost_peer_is_one_line_with_its_own_exit_code_and_the_debug_flag_shows_the_traceback(tmp_path, capsys, monkeypatch):
    """gloo's error for a peer gone while the run starts (here from main, after the launch): one line naming this rank,
    what the run was doing, that no checkpoint is complete and how to start again; exit code 75, not 2."""
    from fabric_lin import pretrain
    from fabric_lin.cli import PEER_LOST_EXIT_CODE, main as cli_main
    from fabric_lin.errors import PeerLost

    gone = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:10895"

    def peer_gone(*args, **kwargs):
        raise RuntimeError(gone)

    monkeypatch.setattr(pretrain, "main", peer_gone)
    out = tmp_path / "out"
    argv = ["pretrain", "--model_name", "gla-debug", "--out_dir", str(out), "--train.max_steps", "1", "--logger_name", "csv",
            "--overwrite", "true"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == PEER_LOST_EXIT_CODE != 2
    assert capsys.readouterr().err == (
        "fabric-lin pretrain: error on rank 0: a peer process of the run ended or became unreachable during the start-up "
        f"(gloo: Connection closed by peer); no checkpoint in {out} is complete: to start again, run the same command "
        "with --resume auto instead of --overwrite true\n")
    monkeypatch.setenv("FABRIC_LIN_DEBUG", "1")
    with pytest.raises(PeerLost) as lost:
        cli_main(argv)
    assert str(lost.value.__cause__) == gone
    # out_dir's checkpoints are an earlier run's, which --overwrite true had not deleted yet: resuming would continue it
    (out / "step-00000004").mkdir(parents=True)
    with pytest.raises(PeerLost) as lost:
        cli_main(argv)
    assert lost.value.advice == (f"the checkpoints in {out} are still the earlier run's, which --overwrite true deletes "
                                 "once the start-up has passed its checks: to start afresh, run the same command")


def test_anticipated_failures_are_told_from_bugs():
    import errno

    from fabric_lin.cli import expected_failure

    def raised(f):
        try:
            f()
        except Exception as e:
            return e

    assert expected_failure(raised(lambda: Config.from_name("gla-340m")))  # a UserError, where the mistake is found
    assert expected_failure(raised(lambda: TrainArgs(max_steps=0).total_steps()))
    assert not expected_failure(raised(lambda: int("x")))  # raised outside fabric_lin
    assert not expected_failure(ValueError("a ValueError that is no UserError"))
    assert not expected_failure(raised(lambda: torch.zeros(2).view(3)))
    assert not expected_failure(raised(lambda: learning_rate(0, None, 0, 0, 1, "cosine", 0.1)))  # a TypeError inside fabric_lin
    assert expected_failure(OSError(errno.ENOSPC, "No space left on device", "/data/out/step-00000100/lit_model.pth"))


def test_errors_are_printed_by_rank_0_only(monkeypatch, capsys):
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin.cli import report

    report("fabric-lin pretrain", "error: once")
    monkeypatch.setattr(rank_zero_only, "rank", 3)
    report("fabric-lin pretrain", "error: from rank 3")
    assert capsys.readouterr().err == "fabric-lin pretrain: error: once\n"


def test_help_describes_every_command_in_whole_sentences(capsys):
    """`fabric-lin --help` lists each command with its docstring's first paragraph, which jsonargparse cuts
    at the first line break: each first line is a whole sentence."""
    from fabric_lin.cli import COMMANDS, main as cli_main

    with pytest.raises(SystemExit) as info:
        cli_main(["--help"])
    assert info.value.code == 0
    listing = capsys.readouterr().out.split("Available subcommands:")[1]
    descriptions, name = {}, None
    for line in listing.splitlines():
        words = line.split(None, 1)
        if words and words[0] in COMMANDS and line.startswith("    ") and not line.startswith("     "):
            name = words[0]
            descriptions[name] = words[1] if len(words) > 1 else ""
        elif name and line.strip():
            descriptions[name] += " " + line.strip()
    assert sorted(descriptions) == sorted(COMMANDS)
    for name, description in descriptions.items():
        assert description.strip().endswith("."), (name, description)


def test_an_output_directory_that_a_file_is_in_the_way_of_is_one_line(tmp_path, capsys):
    """An output path that is a file, or below one, is named with the file before any work (prepare_text read it as a
    directory, evaluate and the converters made it: tracebacks of NotADirectoryError and FileExistsError)."""
    from helpers import make_model_dir, small_config

    make_model_dir(tmp_path / "model", small_config())
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("a document")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    prepare_text = ["prepare_text", "--input_dir", str(tmp_path / "raw"), "--tokenizer_path", str(tmp_path / "model")]
    for command, option, path in ((prepare_text, "--output_dir", a_file), (prepare_text, "--output_dir", a_file / "out"),
                                  (["evaluate", str(tmp_path / "model")], "--out_dir", a_file / "out"),
                                  (["convert_to_hf", str(tmp_path / "model")], "--output_dir", a_file / "out"),
                                  (["pretrain", "--model_name", "gla-debug", "--train.max_steps", "1"], "--out_dir", a_file)):
        err = cli_error([*command, option, str(path)], capsys)
        assert err.endswith(f": error: {option} {path}: {a_file} is a file, expected a directory or nothing there\n"), err


def test_a_lightning_flag_is_pointed_to_fabric_lin_s_only_where_the_command_has_it(capsys):
    """evaluate runs on one device and has no --parallelism.data_parallel to point --strategy to."""
    assert parse_error(["evaluate", "ckpt", "--strategy", "fsdp"], capsys) == (
        "fabric-lin evaluate: error: unknown option --strategy")


@pytest.mark.parametrize("command,name", [("generate", "checkpoint_dir"), ("convert_to_hf", "model_dir")])
def test_a_positional_argument_given_by_name_says_how_it_is_given(tmp_path, capsys, command, name):
    """convert_from_llama takes --checkpoint_dir DIR, generate, evaluate and the other converters the directory alone:
    `generate --checkpoint_dir DIR` was an "unknown option" and no more."""
    assert parse_error([command, f"--{name}", str(tmp_path)], capsys) == (
        f"fabric-lin {command}: error: unknown option --{name}: {name} is this command's argument, given without a "
        f"name: fabric-lin {command} {name.upper()} [options]")


def test_list_with_a_name_writes_that_models_config_for_model_config(tmp_path, capsys):
    # `pretrain list NAME > model.yaml`, one field edited, read back as --model_config reads a file: that model's every
    # field but the edited one (a model_config given field by field would start from Config's defaults instead)
    import yaml

    from fabric_lin.cli import main as cli_main

    capsys.readouterr()
    cli_main(["pretrain", "list", "gdn-debug"])
    written = yaml.safe_load(capsys.readouterr().out)
    assert written == Config.from_name("gdn-debug").to_dict()
    written["vocab_size"] = 512
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(written))
    assert Config.from_file(tmp_path / "model.yaml") == Config.from_name("gdn-debug", vocab_size=512)
    assert "Unknown model name 'gdn-dbg'. Did you mean 'gdn-debug'" in cli_error(["pretrain", "list", "gdn-dbg"], capsys)
    assert "list takes one model name at the most" in cli_error(["pretrain", "list", "gla-debug", "gdn-debug"], capsys)
    from fabric_lin.config import name_to_config

    cli_main(["pretrain", "list"])  # without a name: every model's name, one a line
    names = capsys.readouterr().out.splitlines()
    assert names == list(name_to_config) and {"gla-debug", "gdn-debug"} <= set(names)


def test_a_model_on_the_command_line_replaces_the_config_files(tmp_path, capsys, monkeypatch):
    # README: `pretrain list NAME > model.yaml`, edited, is given as --model_config in place of --model_name; with a
    # recipe (`--config`, which names a model) the command line's model wins, as any option's value does, and a file's
    # model_config gives way to --model_name the same way. --model_config.* options change the fields they give of the
    # model named before them (the recipe's model_name or model_config, or --model_name), as --data.* options change a
    # file's data: not Config's defaults (another model, a 32,000-token vocabulary). A --config after the command
    # line's model still names its own, which is then one model too many. Both on the command line stay an error, in
    # either order.
    import yaml

    from fabric_lin import pretrain
    from fabric_lin.errors import InvalidValue

    chosen = []

    def record_and_stop(model_name, model_config):
        chosen.append((model_name, model_config))
        raise InvalidValue("stopped once the model was chosen")

    monkeypatch.setattr(pretrain, "resolve_model_config", record_and_stop)
    edited = Config.from_name("gla-debug", num_layers=2)
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(edited.to_dict()))
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"model_config": edited.to_dict(), "out_dir": str(tmp_path)}))
    (tmp_path / "gdn.yaml").write_text("model_name: gdn-debug\n")
    debug = ["--config", str(CONFIG_HUB / "debug.yaml")]
    for argv, expected in (
        ([*debug, "--model_config", str(tmp_path / "model.yaml")], (None, edited)),
        (["--config", str(tmp_path / "recipe.yaml"), "--model_name", "gdn-debug"], ("gdn-debug", None)),
        (debug, ("gla-debug", None)),
        ([*debug, "--model_config.num_layers", "2"], (None, Config.from_name("gla-debug", num_layers=2))),
        (["--model_name", "gdn-debug", "--model_config.num_layers", "2"],
         (None, Config.from_name("gdn-debug", num_layers=2))),
        (["--config", str(tmp_path / "recipe.yaml"), "--model_config.vocab_size", "512"],
         (None, Config.from_name("gla-debug", num_layers=2, vocab_size=512))),
        ([*debug, "--model_config", str(tmp_path / "model.yaml"), "--config", str(tmp_path / "gdn.yaml")],
         ("gdn-debug", edited)),
    ):
        assert "stopped once the model was chosen" in cli_error(["pretrain", *argv, "--out_dir", str(tmp_path / "out")],
                                                                 capsys)
        assert chosen.pop() == expected, argv
    monkeypatch.undo()
    both = ["--model_name", "gla-debug", "--model_config", str(tmp_path / "model.yaml")]
    for argv in (both, both[2:] + both[:2]):
        assert "give exactly one of --model_name and --model_config" in cli_error(["pretrain", *argv], capsys)


def test_a_model_config_or_config_given_inline_longer_than_a_file_name_is_read(capsys):
    """`--model_config '<a model's whole config as JSON>'` (and a --config of inline YAML) longer than a file name may
    be: the check of the files given ended in "OSError: File name too long" and its traceback."""
    import json

    import yaml

    from fabric_lin.cli import main as cli_main

    whole = json.dumps(Config.from_name("gla-debug").to_dict())
    inline_recipe = (CONFIG_HUB / "debug.yaml").read_text()
    assert len(whole) > 255 and len(inline_recipe) > 255
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--config", inline_recipe, "--model_config", whole, "--model_config.num_layers", "2",
                  "--print_config"])
    assert info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model_name"] is None and printed["out_dir"] == "out/pretrain/debug"
    assert printed["model_config"] == Config.from_name("gla-debug", num_layers=2).to_dict()


def test_a_model_config_named_after_a_model_but_unlike_it_is_noted(capsys):
    from fabric_lin.config import resolve_model_config

    capsys.readouterr()
    assert resolve_model_config(None, Config.from_name("gla-debug")) == Config.from_name("gla-debug")
    assert capsys.readouterr().out == ""  # the named model itself: nothing to say
    given_field_by_field = Config(name="gla-debug", vocab_size=512)
    assert resolve_model_config(None, given_field_by_field) is given_field_by_field
    note = capsys.readouterr().out
    assert "differs from that model in vocab_size 512 (gla-debug: 4096); hidden_size 1024 (gla-debug: 128)" in note
    assert "pretrain list gla-debug > model.yaml" in note and note.count("\n") == 1
    # a named model changed field by field, none of its changes at Config's defaults: the changes asked for
    changed = Config.from_name("gla-debug", hidden_size=256)
    assert resolve_model_config(None, changed) is changed
    assert capsys.readouterr().out == ""
    for name, config in (("gla-debug", given_field_by_field), (None, None)):
        with pytest.raises(ValueError, match="give exactly one of --model_name and --model_config"):
            resolve_model_config(name, config)


def test_help_describes_every_option(capsys):
    """Each option in each command's --help says what it does, not only its type and default (the optimizer's four
    options once showed `(type: float, default: 0.0004)` and nothing else)."""
    import re

    from fabric_lin.cli import COMMANDS, main as cli_main

    undescribed = []
    for command in COMMANDS:
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            cli_main([command, "--help"])
        assert info.value.code == 0
        options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
        # an option's entry: its invocation, then (on its line after two spaces, or on the lines below) its description
        for entry in re.split(r"\n(?=  -)", options):
            first_line, *more = entry.splitlines()
            invocation, _, rest = first_line.strip().partition("  ")
            description = " ".join([rest, *more]).split()
            if not description or description[0].startswith("(type:"):
                undescribed.append(f"{command} {invocation}")
    assert not undescribed, undescribed


@pytest.mark.parametrize("value,enabled", [("", False), ("0", False), ("false", False), ("False", False), ("1", True),
                                           ("true", True)])
def test_the_debug_flag_is_off_for_0_and_false(monkeypatch, value, enabled):
    from fabric_lin.cli import debug_enabled

    monkeypatch.setenv("FABRIC_LIN_DEBUG", value)
    assert debug_enabled() is enabled


@pytest.mark.parametrize("env,rank", [
    ({}, 0),
    ({"LOCAL_RANK": "1"}, 1),
    ({"SLURM_PROCID": "5", "LOCAL_RANK": "1"}, 5),
    # the global rank first: a process of a second node has LOCAL_RANK 0 and is no rank 0
    ({"RANK": "4", "SLURM_PROCID": "5", "LOCAL_RANK": "0"}, 4),
    ({"RANK": "", "LOCAL_RANK": "2"}, 2),
])
def test_before_fabric_launches_the_rank_is_the_launchers(monkeypatch, env, rank):
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin.errors import process_rank

    monkeypatch.setattr(rank_zero_only, "rank", None, raising=False)
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert process_rank() == rank


@pytest.mark.parametrize("local_rank, printed", [("0", True), ("1", False)])
def test_an_error_of_another_node_before_the_launch_is_printed_by_its_first_process(monkeypatch, capsys, tmp_path,
                                                                                     local_rank, printed):
    """Rank 2 of a run of two nodes of two processes (torchrun's variables) finds the --resume directory missing on its
    node before the process group starts (where no error reaches rank 0): its node's first process says so naming its
    rank, where it said nothing; the node's other processes, which meet the same error, stay silent."""
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin.cli import main as cli_main

    monkeypatch.setattr(rank_zero_only, "rank", None, raising=False)  # before Fabric sets it: the launcher's rank
    env = dict(RANK="2", LOCAL_RANK=local_rank, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1",
               TORCHELASTIC_RUN_ID="node-1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    missing = tmp_path / "step-00000100"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--train.max_steps", "1", "--devices", "2", "--num_nodes", "2",
                  "--out_dir", str(tmp_path / "out"), "--resume", str(missing)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    expected = (f"fabric-lin pretrain: error on rank 2: --resume {missing} does not exist: expected a training checkpoint "
                f"(a run's step-XXXXXXXX/ or final/)\n")
    assert err == (expected if printed else ""), err


def test_a_rank_whose_launching_rank_is_gone_names_itself_as_the_cli_names_a_rank(monkeypatch, capsys, tmp_path):
    """The watch of the start-up ends a rank whose launching rank is gone from a thread of its own, printing the one
    line of a lost peer itself: the rank it names is the one the CLI's lines name (Fabric's global rank, once set)."""
    import os

    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin.errors import PEER_LOST_EXIT_CODE, PeerLost
    from fabric_lin.pretrain import exit_at_once

    monkeypatch.setattr(rank_zero_only, "rank", 3, raising=False)  # node 1's second process of a run of 2 x 2
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("NODE_RANK", raising=False)

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit) as info:
        exit_at_once(PeerLost("the start-up", "process 1, the rank that started this one, ended"), out_dir=tmp_path,
                     resume=False, overwrite=False)
    assert info.value.code == PEER_LOST_EXIT_CODE
    assert capsys.readouterr().err.startswith("fabric-lin pretrain: error on rank 3: a peer process of the run ended")


def test_only_file_system_errors_that_name_their_file_are_anticipated():
    """No space or no permission at a path is the user's to fix; the same error without its path (a socket, a pipe),
    or a file that fabric-lin did not check for and so did not explain, is a bug and keeps its traceback."""
    import errno

    from fabric_lin.cli import expected_failure

    assert expected_failure(PermissionError(errno.EACCES, "Permission denied", "/data/out"))
    assert not expected_failure(OSError(errno.ENOSPC, "No space left on device"))
    assert not expected_failure(FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/out/index.json"))
    assert not expected_failure(IsADirectoryError(errno.EISDIR, "Is a directory", "/data/out"))


def test_a_missing_model_config_file_named_yml_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = cli_error(["pretrain", "--model_config", "model.yml", "--out_dir", str(tmp_path / "out")], capsys)
    assert err.startswith("fabric-lin pretrain: error: --model_config model.yml does not exist: expected a YAML file"), \
        err


def test_generate_list_prints_the_model_names(capsys):
    from fabric_lin.cli import main as cli_main
    from fabric_lin.config import name_to_config

    capsys.readouterr()
    cli_main(["generate", "list"])
    assert capsys.readouterr().out.splitlines() == list(name_to_config)


def test_a_bug_met_while_handling_a_users_mistake_keeps_its_traceback(monkeypatch, capsys):
    """Only an error raised from a user error (`raise ... from`, as jsonargparse wraps a data module's check) is that
    mistake; a bug in the code that handles one (its __context__) is a bug, not the mistake it met."""
    from fabric_lin import cli
    from fabric_lin.errors import InvalidValue

    def command():
        try:
            raise InvalidValue("a mistake of the user's")
        except InvalidValue:
            return {}["a bug in its handling"]

    monkeypatch.setattr(cli, "run", lambda argv: command())
    with pytest.raises(KeyError, match="a bug in its handling"):
        cli.main(["pretrain"])


def test_ctrl_c_is_one_line_with_exit_code_130_and_the_debug_flag_shows_its_traceback(monkeypatch, capsys):
    from fabric_lin import cli

    def interrupted(argv):
        raise KeyboardInterrupt(reason)

    monkeypatch.setattr(cli, "run", interrupted)
    capsys.readouterr()
    # a Ctrl-C, a SIGTERM (143: what a scheduler expects of a job it stopped), pretrain's second Ctrl-C, which says
    # what to do, a SIGTERM while pretrain prepares data (pretrain's own stops otherwise), and generate's Ctrl-C, which
    # writes nothing
    for command, reason, said, code in (
            ("evaluate", "", "interrupted: nothing half-written is left; run the same command again", 130),
            ("prepare_text", "SIGTERM",
             "stopped by SIGTERM: nothing half-written is left; run the same command again", 143),
            ("pretrain", "a second Ctrl-C: stopped at once", "interrupted (a second Ctrl-C: stopped at once)", 130),
            ("pretrain", "SIGTERM",
             "interrupted (SIGTERM): nothing half-written is left; run the same command again", 130),
            ("generate", "", "interrupted", 130), ("generate", "SIGTERM", "stopped by SIGTERM", 143)):
        with pytest.raises(SystemExit) as info:
            cli.main([command])
        assert info.value.code == code and capsys.readouterr().err == f"fabric-lin {command}: {said}\n"
    reason = ""
    monkeypatch.setenv("FABRIC_LIN_DEBUG", "1")
    with pytest.raises(KeyboardInterrupt):
        cli.main(["evaluate"])
