"""fabric_lin/cli.py with configuration files: a key a file may not hold (named with the closest one, its group's keys
and the file that gives it, or as another command's file), a group given no mapping, a file that is empty, no mapping
or not YAML, a key given twice, a class key given a number, a missing model_config file, an import path that is no
data module, a misspelt key of the data mapping, `~`, `$VARIABLE` and the empty word in paths, the optimizer as LitGPT gives it, an
unknown nested
model_config key."""
import pytest
import torch

from helpers import cli_error, parse_error


@pytest.mark.parametrize("content,key,closest,listed", [
    ("model_name: gla-debug\ntrain:\n  max_step: 3\n", "train.max_step", "train.max_steps",
     "the keys of train are: save_interval, log_interval, global_batch_size, micro_batch_size, lr_warmup_steps, "
     "max_tokens, max_steps, max_seq_length, max_norm, min_lr, lr_schedule, wsd_decay_fraction, keep_last_n, "
     "max_nonfinite_steps"),
    ("model_name: gla-debug\ntrian:\n  max_steps: 3\n", "trian.max_steps", "train.max_steps", "the keys are: model_name, "),
    ("model_name: gla-debug\nbogus_key: 1\n", "bogus_key", None, "the keys are: model_name, model_config, out_dir, "),
    ("model_name: gla-debug\ndta:\n  class_path: fabric_lin.data.SampleCorpus\n  init_args:\n    num_workers: 0\n",
     "dta.init_args.num_workers", "data.init_args.num_workers", "the keys are: model_name, "),
])
def test_a_config_files_unknown_key_is_named_with_the_closest_and_the_keys_of_its_group(tmp_path, capsys, content, key,
                                                                                      closest, listed):
    config = tmp_path / "run.yaml"
    config.write_text(content)
    err = parse_error(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: Subcommand 'pretrain' does not accept option '{key}'"
                          + (f" (did you mean {closest}?)" if closest else ";"))
    assert listed in err
    assert err.endswith(f" (in {config})"), err
    assert not (tmp_path / "out").exists()


def test_an_unknown_key_names_the_file_that_gives_it(tmp_path, capsys, monkeypatch):
    """jsonargparse checks the keys once it has merged every file's, and its message named no file: a --config file's
    key, a group's file (`--optimizer opt.yaml`), a file that a config file gives in a group's place (read from that
    file's directory), a --config given before the subcommand (its keys under the subcommand's name, or outside it). A
    key given on the command line (inline YAML) names none."""
    from fabric_lin.cli import main as cli_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    files = {"run.yaml": "model_name: gla-debug\ntrian:\n  max_steps: 3\n", "opt.yaml": "lr: 1.0e-3\nbogus: 2\n",
             "sub/run.yaml": "model_name: gla-debug\noptimizer: opt.yaml\n", "sub/opt.yaml": "bogus: 2\n",
             "global.yaml": "pretrain:\n  trian:\n    max_steps: 3\n", "outside.yaml": "train:\n  max_steps: 3\n"}
    for name, content in files.items():
        (tmp_path / name).write_text(content)
    for argv, holder in [
        (["pretrain", "--config", "run.yaml"], "run.yaml"),
        (["pretrain", "--model_name", "gla-debug", "--optimizer", "opt.yaml"], "opt.yaml"),
        (["pretrain", "--model_name=gla-debug", f"--optimizer={tmp_path / 'opt.yaml'}"], str(tmp_path / "opt.yaml")),
        (["pretrain", "--config", "sub/run.yaml"], "sub/opt.yaml"),
        (["--config", "global.yaml", "pretrain", "--model_name", "gla-debug"], "global.yaml"),
        (["--config", "outside.yaml", "pretrain", "--model_name", "gla-debug"], "outside.yaml"),
        (["pretrain", "--config", "{model_name: gla-debug, trian: {max_steps: 3}}"], None),
        (["pretrain", "--model_name", "gla-debug", "--optimizer", "{lr: 1.0e-3, bogus: 2}"], None),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit):
            cli_main(argv)
        err = capsys.readouterr().err.splitlines()[0]
        assert "does not accept option 'trian.max_steps'" in err or "'optimizer.bogus'" in err or "'train.max_steps'" in err, err
        assert err.endswith(f" (in {holder})") if holder else "(in " not in err, (argv, err)


def test_a_config_file_of_another_command_is_named_as_such(tmp_path, capsys):
    """A run's hyperparameters.yaml given to evaluate as --config (where evaluate takes the checkpoint directory and
    reads that file itself), and evaluate's --print_config given to pretrain: each was refused for its first key alone,
    with the keys of the command, as a file with a typo is."""
    import yaml

    from fabric_lin.cli import main as cli_main

    hparams = tmp_path / "final" / "hyperparameters.yaml"
    hparams.parent.mkdir()
    hparams.write_text(yaml.safe_dump({"model_name": "gla-debug", "out_dir": str(tmp_path), "train": {"max_steps": 3}}))
    err = parse_error(["evaluate", "--config", str(hparams)], capsys)
    assert err.endswith(f"; --config {hparams} holds the options of fabric-lin pretrain: evaluate reads a training "
                        f"checkpoint's own hyperparameters.yaml, given the checkpoint directory"), err
    with pytest.raises(SystemExit):
        cli_main(["evaluate", str(tmp_path / "final"), "--print_config"])
    (tmp_path / "evaluate.yaml").write_text(capsys.readouterr().out)
    err = parse_error(["pretrain", "--config", str(tmp_path / "evaluate.yaml")], capsys)
    assert err.endswith(f"; --config {tmp_path / 'evaluate.yaml'} holds the options of fabric-lin evaluate"), err


@pytest.mark.parametrize("value,shown", [("", "null"), (" 5", "5"), (" [1, 2]", "[1, 2]")])
def test_an_option_group_given_no_mapping_in_a_config_file_is_one_line(tmp_path, capsys, value, shown):
    """`train:` with its keys all commented out (a null), or a value that is no mapping: jsonargparse took it and
    failed building the group (a TypeError's traceback)."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model_name: gla-debug\ntrain:{value}\neval:\n  interval: 5\n")
    err = parse_error(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")], capsys)
    assert err.startswith(f"fabric-lin pretrain: error: train: got {shown}, expected a mapping of its keys "
                          "(save_interval, log_interval, global_batch_size, ")
    assert ("leave the key out" in err) == (shown == "null")


@pytest.mark.parametrize("content,message", [
    ("", "{path} holds nothing: expected YAML keys and their values, as in config_hub/debug.yaml"),
    ("- model_name\n- gla-debug\n", "{path} holds a list: expected YAML keys and their values, as in config_hub/debug.yaml"),
    ("model_name: gla-debug\ntrain:\n\tmax_steps: 3\n", "{path} cannot be read as YAML: found character '\\t' that cannot "
                                                         "start any token at line 3, column 1; correct the file, or write it again"),
])
def test_a_config_file_that_is_empty_or_no_mapping_or_not_yaml_is_named(tmp_path, capsys, content, message):
    """jsonargparse's own messages named no file: "Unexpected config:", and a YAML error "in <unicode string>"."""
    config = tmp_path / "run.yaml"
    config.write_text(content)
    err = cli_error(["pretrain", f"--config={config}", "--out_dir", str(tmp_path / "out")], capsys)
    assert err == "fabric-lin pretrain: error: " + ("--config " if "holds" in message else "") + message.format(path=config) + "\n"


@pytest.mark.parametrize("option", ["--config", "--model_config"])
def test_a_key_given_twice_in_a_yaml_file_is_named_with_both_lines(tmp_path, capsys, option):
    """PyYAML keeps the last of two equal keys without a word: an edit of a recipe's first `max_steps:` (or of the
    num_layers of `pretrain list NAME`'s output) was silently overridden by the other one."""
    if option == "--config":
        content = "model_name: gla-debug\ntrain:\n  max_steps: 3\n  log_interval: 1\n  max_steps: 150\n"
        key, first, second = "max_steps", 3, 5
        argv = ["pretrain", "--config", str(tmp_path / "run.yaml")]
    else:
        content = "name: gla-debug\nnum_layers: 1\nhidden_size: 128\nnum_layers: 4\n"
        key, first, second = "num_layers", 2, 4
        argv = ["pretrain", "--model_config", str(tmp_path / "run.yaml"), "--data", "SampleCorpus"]
    (tmp_path / "run.yaml").write_text(content)
    # 16-mixed, which the CPU refuses at start-up, ends at once a run that the duplicate does not stop
    err = cli_error([*argv, "--out_dir", str(tmp_path / "out"), "--precision", "16-mixed"], capsys)
    assert err == (f"fabric-lin pretrain: error: {tmp_path / 'run.yaml'} cannot be read as YAML: a second {key!r} key "
                   f"(the first is at line {first}; keep one) at line {second}, column 3; correct the file, or write it again\n"
                   ).replace("column 3", "column 3" if option == "--config" else "column 1")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key,value,expected", [
    ("data", "5", "a data module (SampleCorpus, LongDocuments, TokenChunks, SlimPajamaStarcoder, TextFiles or an import path)"),
    ("model_config", "5", "a mapping of fabric_lin.config.Config's fields (hidden_size, num_layers, ...)"),
])
def test_a_class_key_given_a_number_says_what_it_takes(tmp_path, capsys, key, value, expected):
    """In a config file jsonargparse words the refusal otherwise than on the command line ("Not a valid subclass"),
    and the one-line error said only "expected null"."""
    config = tmp_path / "run.yaml"
    config.write_text(f"{key}: {value}\n" + ("model_name: gla-debug\n" if key == "data" else ""))
    for argv, where in ((["--config", str(config)], f" (in {config})"), ([f"--{key}", value], "")):
        err = parse_error(["pretrain", *argv, "--out_dir", str(tmp_path / "out")], capsys)
        assert err == f"fabric-lin pretrain: error: {key}: got {value}, expected {expected} or null{where}"


def test_a_model_config_file_that_is_not_there_is_named(tmp_path, capsys):
    """It was refused as "got model.yaml, expected a mapping of Config's fields"; a model directory given for its
    model_config.yaml is pointed to it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model_config.yaml").write_text("name: gla-debug\n")
    for given, message in ((tmp_path / "model.yaml", "does not exist"),
                           (tmp_path / "model", f"is a directory: give its model_config.yaml, {tmp_path / 'model' / 'model_config.yaml'}")):
        err = cli_error(["pretrain", "--model_config", str(given), "--data", "SampleCorpus", "--out_dir", str(tmp_path / "out")], capsys)
        assert err.startswith(f"fabric-lin pretrain: error: --model_config {given} {message}"), err


@pytest.mark.parametrize("given,shown,hint", [
    (["--data", "fabric_lin.data.SampleCorpos"], "fabric_lin.data.SampleCorpos", " (did you mean SampleCorpus?)"),
    (["--data", "fabric_lin.SampleCorpus"], "fabric_lin.SampleCorpus", " (did you mean SampleCorpus?)"),
    (["--data", "torch.nn.Linear"], "torch.nn.Linear", ""),
    ("data:\n  class_path: fabric_lin.data.TextFile\n  init_args:\n    val_dir: val\n", "fabric_lin.data.TextFile",
     " (did you mean TextFiles?)"),
])
def test_an_import_path_that_is_no_data_module_says_what_data_takes(tmp_path, capsys, given, shown, hint):
    """An import path to no class, or to a class that is no data module, was refused as "expected null"; a config
    file's class_path was shown as the whole mapping."""
    where = ""
    if isinstance(given, str):
        (tmp_path / "run.yaml").write_text(given)
        given, where = ["--config", str(tmp_path / "run.yaml")], f" (in {tmp_path / 'run.yaml'})"
    err = parse_error(["pretrain", "--model_name", "gla-debug", *given, "--out_dir", str(tmp_path / "out")], capsys)
    assert err == (f"fabric-lin pretrain: error: data: got {shown}, expected a data module (SampleCorpus, LongDocuments, "
                   f"TokenChunks, SlimPajamaStarcoder, TextFiles or an import path) or null{hint}{where}")


@pytest.mark.parametrize("misspelt,meant", [("init_arg", "init_args"), ("class_pth", "class_path")])
def test_a_misspelt_key_of_the_data_mapping_is_named_with_the_one_meant(tmp_path, capsys, misspelt, meant):
    """`data: {class_path: ..., init_arg: ...}` was refused as "fabric_lin.data.DataModule has no option
    'init_arg.num_workers'; valid options are: seed, num_workers", and `class_pth` as the whole mapping given."""
    keys = {"class_path": "fabric_lin.data.SampleCorpus", "init_args": "\n    num_workers: 0"}
    (tmp_path / "run.yaml").write_text("model_name: gla-debug\ndata:\n" + "".join(
        f"  {misspelt if key == meant else key}: {value}\n" for key, value in keys.items()))
    err = parse_error(["pretrain", "--config", str(tmp_path / "run.yaml"), "--out_dir", str(tmp_path / "out")], capsys)
    assert err == (f"fabric-lin pretrain: error: data: got the key {misspelt} (did you mean {meant}?), expected "
                   f"class_path (the data module) and init_args (its options) (in {tmp_path / 'run.yaml'})")


def test_a_path_that_begins_with_a_tilde_is_in_the_home_directory(tmp_path, capsys, monkeypatch):
    """As a shell reads ~: `--out_dir=~/runs/a` (a shell expands no ~ after `=`) and a config file's paths went to a
    directory named ~ under the current one, while the run's loggers wrote into the home directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "runs").write_text("")  # a file where the run's directory would go: the run stops there
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir=~/runs/a", "--train.max_steps", "1"], capsys)
    assert err == f"fabric-lin pretrain: error: --out_dir {tmp_path / 'home' / 'runs' / 'a'}: {tmp_path / 'home' / 'runs'} is a file, expected a directory or nothing there\n"
    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\nout_dir: ~/out\ntrain:\n  max_steps: 1\n"
                      "data:\n  class_path: TokenChunks\n  init_args:\n    data_path: ~/data/train\n")
    err = cli_error(["pretrain", "--config", str(config)], capsys)
    assert f"Prepared data directory '{tmp_path / 'home' / 'data' / 'train'}' does not exist" in err
    assert cli_error(["generate", "~/model"], capsys).startswith(
        f"fabric-lin generate: error: {tmp_path / 'home' / 'model'} is not a directory: expected a training checkpoint")
    assert not (tmp_path / "~").exists()


def test_a_path_that_names_an_environment_variable_is_refused_naming_key_and_file(tmp_path, capsys, monkeypatch):
    """`out_dir: $SCRATCH/runs/a` in a config file (or quoted on the command line) is expanded by no shell: the run
    wrote its checkpoints into a directory named $SCRATCH under the current one. A data module's path too; the file
    is named where the value came from one."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\nout_dir: $SCRATCH/runs/a\ntrain:\n  max_steps: 1\n"
                      "data:\n  class_path: TokenChunks\n  init_args:\n    data_path: ${DATA}/train\n")
    said = ("names the environment variable {}, which a config file's (or a quoted) value does not expand: the path would "
            "be a directory named {} under the current one; write the path out, or give it on the command line, where "
            "the shell expands it")
    assert cli_error(["pretrain", "--config", str(config)], capsys) == (
        f"fabric-lin pretrain: error: out_dir: $SCRATCH/runs/a {said.format('$SCRATCH', '$SCRATCH')} (in {config})\n")
    err = cli_error(["pretrain", "--config", str(config), "--out_dir", str(tmp_path / "out")], capsys)
    assert err == (f"fabric-lin pretrain: error: data.data_path: ${{DATA}}/train {said.format('${DATA}', '${DATA}')} "
                   f"(in {config})\n")
    err = cli_error(["pretrain", "--config", str(config), "--out_dir", "$OUT/a"], capsys)  # the command line's, quoted
    assert err == f"fabric-lin pretrain: error: out_dir: $OUT/a {said.format('$OUT', '$OUT')}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]


def test_an_empty_path_on_the_command_line_is_refused_not_taken_for_the_current_directory(tmp_path, capsys,
                                                                                         monkeypatch):
    """`--output_dir "$OUT"` with OUT unset gives the empty word, which Path() takes for the current directory: a
    converter with --overwrite true wrote a model's files there (after removing one it found). An option's or a
    positional argument's; a path written "." is the user's own choice and goes on to the command's own checks."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    said = "an empty path (an unset shell variable, as in \"$OUT\"?) would be the current directory; give the path, or . " \
           "for the current directory\n"
    model = tmp_path / "model"
    model.mkdir()
    assert cli_error(["convert_to_hf", str(model), "--output_dir", "", "--overwrite", "true"], capsys) == (
        f"fabric-lin convert_to_hf: error: output_dir: {said}")
    assert cli_error(["convert_to_hf", str(model), "--output_dir=", "--overwrite", "true"], capsys) == (
        f"fabric-lin convert_to_hf: error: output_dir: {said}")
    assert cli_error(["generate", ""], capsys) == f"fabric-lin generate: error: checkpoint_dir: {said}"
    # the empty word after an option given as --name=value is the positional argument, not that option's value
    assert cli_error(["generate", "--max_new_tokens=5", ""], capsys) == (
        f"fabric-lin generate: error: checkpoint_dir: {said}")
    assert cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", ""], capsys) == (
        f"fabric-lin pretrain: error: out_dir: {said}")
    assert "empty path" not in cli_error(["generate", "."], capsys)
    # an empty value of an option that is no path is no empty positional argument
    assert "empty path" not in cli_error(["generate", ".", "--prompt", ""], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "notes.txt"]


def test_the_optimizer_given_as_litgpt_gives_it_says_what_it_takes(tmp_path, capsys):
    """LitGPT's `optimizer: {class_path: torch.optim.AdamW, init_args: ...}` was told to call set_parsing_settings, and
    `--optimizer AdamW` "Unable to load config 'AdamW'"."""
    config = tmp_path / "run.yaml"
    config.write_text("model_name: gla-debug\noptimizer:\n  class_path: torch.optim.AdamW\n  init_args:\n    lr: 4.0e-4\n")
    assert parse_error(["pretrain", "--config", str(config)], capsys) == (
        "fabric-lin pretrain: error: optimizer: class_path torch.optim.AdamW is not taken: give the keys of optimizer "
        f"(lr, weight_decay, betas, eps) themselves, without class_path and init_args (in {config})")
    assert parse_error(["pretrain", "--model_name", "gla-debug", "--optimizer", "AdamW"], capsys) == (
        "fabric-lin pretrain: error: optimizer: got AdamW, expected a mapping of its keys (lr, weight_decay, betas, eps), "
        "or the path of a YAML file of them")


def test_an_unknown_nested_mapping_in_model_config_is_named(tmp_path, capsys):
    """An fla config.json given as --model_config (flame's configs are fla's) holds a mapping that Config does not take
    (`fabric_lin: {name: ...}` in an export's): the error printed the whole file and said "expected null"."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 128, "fabric_lin": {"name": "gla-debug"}}))
    assert parse_error(["pretrain", "--model_config", str(config)], capsys).startswith(
        "fabric-lin pretrain: error: model_config: fabric_lin.config.Config has no option 'fabric_lin.name'; valid options "
        "are: name, block_type, vocab_size, hidden_size,")


@pytest.mark.parametrize("value,shown", [("inf", "inf"), ("nan", "nan"), ("-inf", "-inf"), (".inf", "inf")])
def test_a_config_files_temperature_that_is_no_finite_number_is_refused_as_on_the_command_line(tmp_path, capsys, value,
                                                                                               shown):
    """jsonargparse refused a file's `temperature: inf` (or nan) as "got inf, expected float", where the command line's
    --temperature inf is told what generate takes; a YAML float (`.inf`) reached generate, which named --temperature."""
    model = str(tmp_path / "model")
    expected = f"temperature {shown}: expected a finite number >= 0 (0: greedy)"
    assert cli_error(["generate", model, f"--temperature={shown}"], capsys) == f"fabric-lin generate: error: --{expected}\n"
    config, before = tmp_path / "g.yaml", tmp_path / "global.yaml"
    config.write_text(f"temperature: {value}\n")
    before.write_text(f"generate:\n  temperature: {value}\n")
    assert cli_error(["generate", model, "--config", str(config)], capsys) == (
        f"fabric-lin generate: error: {expected} (in {config})\n")
    assert cli_error(["--config", str(before), "generate", model], capsys) == f"fabric-lin: error: {expected} (in {before})\n"
    assert cli_error(["generate", model, "--config", f"{{temperature: {value}}}"], capsys) == (
        f"fabric-lin generate: error: {expected}\n")


@pytest.mark.parametrize("content", ["temperature: abc", "top_p: abc", "top_p: false"])
def test_a_sampling_value_that_is_no_number_is_left_to_jsonargparse_which_names_it_as_given(tmp_path, capsys,
                                                                                           content):
    """generate's own check of temperature and top_p takes numbers alone: a word, or YAML's false (which float() reads
    as 0), is jsonargparse's to refuse, as the user wrote it, not a traceback of float() nor "top_p 0"."""
    model = str(tmp_path / "model")
    key, value = content.split(": ")
    got = "False" if value == "false" else value
    config = tmp_path / "g.yaml"
    config.write_text(content + "\n")
    assert parse_error(["generate", model, "--config", str(config)], capsys) == (
        f"fabric-lin generate: error: {key}: got {got}, expected float (in {config})")
    if value == "abc":
        assert parse_error(["generate", model, f"--{key}", value], capsys) == (
            f"fabric-lin generate: error: {key}: got {value}, expected float")
