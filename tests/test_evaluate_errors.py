"""`fabric-lin evaluate`'s bad input is one line (exit code 2) and leaves no results: a directory that is no checkpoint,
a damaged or unfinished one, one still being written, deleted or replaced by a running pretrain while it is read, a
model directory without data, bad lengths, buckets and arguments, an out_dir inside the training checkpoint, the run's
data moved away or prepared again (named with the hyperparameters.yaml that names it), data of another tokenizer, a
tokenizer larger than the model's embeddings, logits that are not finite; Ctrl-C's and an error's line come below the
progress bar, last; an earlier evaluation in out_dir is kept unless --overwrite, told before any slow work, and a write
cut short leaves it as it was."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import TRAIN_LEN, train_evaluate_run
from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.evaluate import main as evaluate
from fabric_lin.model import GPT
from helpers import cli_error, write_prepared


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """conftest's train_evaluate_run, once for this module (a module-scoped fixture keeps the module's tests on one
    pytest-xdist worker: conftest's pytest_xdist_make_scheduler)."""
    return train_evaluate_run(tmp_path_factory.mktemp("evaluate"))


def test_errors_are_one_line(run, tmp_path, capsys, monkeypatch):
    final = run / "out" / "final"
    (tmp_path / "empty").mkdir()
    assert "empty is not a checkpoint: it holds none of lit_model.pth" in cli_error(["evaluate", str(tmp_path / "empty")], capsys)
    assert "pass one of them" in cli_error(["evaluate", str(run / "out")], capsys)

    damaged = tmp_path / "run" / "final"
    shutil.copytree(final, damaged)
    with open(damaged / "lit_model.pth", "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(b"\x00" if byte != b"\x00" else b"\x01")
    assert "the checkpoint is damaged: lit_model.pth's bytes changed since it was written" in cli_error(
        ["evaluate", str(damaged)], capsys)

    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint

    convert_pretrained_checkpoint(final, tmp_path / "model")
    assert "is a model directory, which names no validation data" in cli_error(["evaluate", str(tmp_path / "model")], capsys)
    err = cli_error(["evaluate", str(tmp_path / "model"), "--data", "TokenChunks", "--data.data_path", str(run / "train"),
                     "--data.num_workers", "0"], capsys)
    assert "TokenChunks gives no validation data" in err
    assert "--seq_len must be a positive number" in cli_error(["evaluate", str(final), "--seq_len", "[32, 0]"], capsys)
    assert "--bucket_edges must be a list of increasing positive positions" in cli_error(
        ["evaluate", str(final), "--bucket_edges", "[16, 8]"], capsys)
    assert "--bucket_size and --bucket_edges both set the buckets" in cli_error(
        ["evaluate", str(final), "--bucket_edges", "[8]", "--bucket_size", "4"], capsys)
    # Fabric runs bf16-mixed in its place, with a warning of its own, and evaluate.json said 16-mixed
    assert cli_error(["evaluate", str(final), "--precision", "16-mixed"], capsys) == (
        "fabric-lin evaluate: error: --precision 16-mixed needs a CUDA GPU (the CPU has no fp16 autocast): give "
        "--precision bf16-mixed or 32-true (exact, and the fastest on the CPU)\n")
    # blocks longer than the data's chunk files (1000 tokens): the fix names evaluate's option, not pretrain's
    err = cli_error(["evaluate", str(final), "--seq_len", "1000"], capsys)
    assert "--seq_len=1000 is too long" in err and "lower --seq_len or prepare" in err and "train.max_seq_length" not in err
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)
    assert "--tasks needs lm-evaluation-harness: pip install -e '.[eval]'" in cli_error(
        ["evaluate", str(final), "--tasks", "hellaswag"], capsys)
    assert not (tmp_path / "model" / "evaluate").exists()  # failed runs leave no output directory


def test_arguments_are_checked_and_the_lengths_and_tasks_listed_once(tmp_path):
    from fabric_lin.evaluate import check_arguments, run_data_module, task_list

    assert check_arguments([64, 32, 64], None, None, None, None, None, None) == [64, 32]
    for arguments, refused in (((True,) + (None,) * 6, "--seq_len must be a positive number"),
                               ((None, -1) + (None,) * 5, "--max_batches must be 0"),
                               ((None,) * 5 + (-1, None), "--num_fewshot must be 0 or more")):
        with pytest.raises(InvalidValue, match=refused):
            check_arguments(*arguments)
    assert task_list(" hellaswag , arc_easy") == task_list(["hellaswag", "arc_easy"]) == ["hellaswag", "arc_easy"]
    # a checkpoint's hyperparameters.yaml names a module: only fabric-lin's data modules are imported
    with pytest.raises(InvalidValue, match=r"data.class_path mypackage.Data is not one of fabric-lin's data modules"):
        run_data_module({"data": {"class_path": "mypackage.Data", "init_args": {}}}, tmp_path / "hyperparameters.yaml")


def test_out_dir_inside_the_training_checkpoint_is_one_line(run, tmp_path, capsys):
    """A training checkpoint's files are the ones its manifest lists: results written among them would go with it when
    the run prunes or replaces it, and a copy of the checkpoint would carry them."""
    final = run / "out" / "final"
    files_before = sorted(p.name for p in final.iterdir())
    for out_dir in (final, final / "evaluate", final / ".." / "final"):
        err = cli_error(["evaluate", str(final), "--max_batches", "1", "--out_dir", str(out_dir)], capsys)
        assert err == (f"fabric-lin evaluate: error: --out_dir {out_dir} is inside the training checkpoint {final}, whose "
                       f"files are the ones its manifest lists: give a directory outside it, or leave --out_dir out for "
                       f"{run / 'out' / 'evaluate' / 'final'}\n")
    assert sorted(p.name for p in final.iterdir()) == files_before


def test_a_file_of_a_checkpoint_sharded_weights_alone_and_out_dir_in_another_checkpoint_are_one_line(run, tmp_path,
                                                                                                   capsys):
    """A checkpoint's weights file given for the checkpoint: the directory that holds it named (evaluate said only that
    the file is no directory). A directory lit_model.pth, as sharded weights are, without step.json and manifest.json
    beside it: not a whole training checkpoint (evaluate and convert_pretrained_checkpoint called it a model directory
    already, which evaluate reads). An --out_dir inside a training checkpoint other than the one evaluated: refused as
    one inside the evaluated one is, nothing written there."""
    final = run / "out" / "final"
    err = cli_error(["evaluate", str(final / "lit_model.pth"), "--max_batches", "1"], capsys)
    assert err == (f"fabric-lin evaluate: error: {final / 'lit_model.pth'} is a file: give the directory that holds it, "
                   f"{final} (a training checkpoint)\n")
    weights_alone = tmp_path / "weights_alone"
    (weights_alone / "lit_model.pth").mkdir(parents=True)
    shutil.copy(final / "model_config.yaml", weights_alone)
    for command in ("evaluate", "convert_pretrained_checkpoint"):
        err = cli_error([command, str(weights_alone), "--out_dir" if command == "evaluate" else "--output_dir",
                         str(tmp_path / "out")], capsys)
        assert err == (f"fabric-lin {command}: error: {weights_alone / 'lit_model.pth'} is a directory, as a sharded "
                       f"training checkpoint's weights are, but {weights_alone} has no step.json or manifest.json beside "
                       f"it: not a whole training checkpoint (copied without them, or saved by a run that did not finish "
                       f"it); give the checkpoint directory as pretrain wrote it\n"), err
    other = tmp_path / "other"
    shutil.copytree(final, other)
    files_before = sorted(p.name for p in other.iterdir())
    err = cli_error(["evaluate", str(final), "--max_batches", "1", "--out_dir", str(other / "evaluate")], capsys)
    assert err == (f"fabric-lin evaluate: error: --out_dir {other / 'evaluate'} is inside the training checkpoint {other}, "
                   f"whose files are the ones its manifest lists: give a directory outside it\n")
    assert sorted(p.name for p in other.iterdir()) == files_before and not (tmp_path / "out").exists()


def test_an_unfinished_checkpoint_given_as_the_current_directory_is_one_line(run, tmp_path, capsys, monkeypatch):
    """`.` inside a `.tmp-` directory (a checkpoint still being written, its manifest already there) is as unfinished
    as the directory named by its path."""
    unfinished = tmp_path / ".tmp-step-00000004"
    shutil.copytree(run / "out" / "final", unfinished)
    monkeypatch.chdir(unfinished)
    err = cli_error(["evaluate", ".", "--max_batches", "1"], capsys)
    assert err == "fabric-lin evaluate: error: . is an unfinished checkpoint (a `.tmp-` directory is renamed when complete)\n"
    assert not (tmp_path / "evaluate").exists()


def test_a_checkpoint_still_being_written_is_one_line_saying_so(run, tmp_path, capsys):
    """`evaluate out/step-X` (or convert it) while the run writes `out/.tmp-step-X`: the checkpoint is being written,
    not missing; the ones complete beside it are named, and so they are for a final/ the run has not saved yet."""
    out = tmp_path / "out"
    shutil.copytree(run / "out" / "final", out / "step-00000002")
    shutil.copytree(run / "out" / "final", out / ".tmp-step-00000004")
    expected = (f"{out / 'step-00000004'} is not there yet: {out / '.tmp-step-00000004'} is being written (a running "
                f"pretrain saves a checkpoint there and renames it when complete; one killed while saving leaves it): "
                f"give it once the run has saved it, or one that is complete (step-00000002)\n")
    assert cli_error(["evaluate", str(out / "step-00000004")], capsys) == f"fabric-lin evaluate: error: {expected}"
    assert cli_error(["convert_pretrained_checkpoint", str(out / "step-00000004"), "--output_dir", str(tmp_path / "m")],
                     capsys) == f"fabric-lin convert_pretrained_checkpoint: error: {expected}"
    # final/ of a run still training: the run's checkpoints so far are named
    assert cli_error(["evaluate", str(out / "final"), "--max_batches", "1"], capsys) == (
        f"fabric-lin evaluate: error: {out / 'final'} does not exist (a run saves final/ when it ends): the run in {out} "
        f"has saved step-00000002: give one of them\n")


@pytest.mark.parametrize("when", ["verifying", "loading", "replaced"])
def test_a_checkpoint_deleted_or_replaced_while_it_is_read_is_one_line(run, tmp_path, capsys, monkeypatch, when):
    """A running pretrain deletes its oldest step-* checkpoint past train.keep_last_n (renamed to `.tmp-deleted-*`,
    then removed) while evaluate verifies or loads it, or replaces it by another (a step saved again): one line that
    says so, not a damaged checkpoint, a missing model_config.yaml or torch's FileNotFoundError."""
    import fabric_lin.checkpoint_kinds as kinds

    checkpoint = tmp_path / "out" / "step-00000002"
    shutil.copytree(run / "out" / "final", checkpoint)

    def pretrain_meanwhile():
        if when == "replaced":  # another save of the step: the same files but for the manifest's record of them
            manifest = json.loads((checkpoint / "manifest.json").read_text())
            (checkpoint / "manifest.json").write_text(json.dumps({**manifest, "written": "again"}))
        else:
            shutil.move(checkpoint, tmp_path / "out" / ".tmp-deleted-step-00000002")
            shutil.rmtree(tmp_path / "out" / ".tmp-deleted-step-00000002")

    patched = "verify_checkpoint" if when == "verifying" else "load_model_weights"
    original = getattr(kinds, patched)
    monkeypatch.setattr(kinds, patched, lambda path, *args, **kwargs: (pretrain_meanwhile(),
                                                                       original(path, *args, **kwargs))[1])
    assert cli_error(["evaluate", str(checkpoint), "--max_batches", "1"], capsys) == (
        f"fabric-lin evaluate: error: {checkpoint} was deleted or replaced while it was read: a running pretrain deletes "
        f"its oldest step-* checkpoints past train.keep_last_n, and replaces a checkpoint it saves again; evaluate it "
        f"again where it is still there, or a checkpoint that the run keeps\n")
    assert not (tmp_path / "out" / "evaluate").exists()


def error_after_progress(argv, capsys, exit_code: int = 2) -> str:
    """`fabric-lin <argv>` in this process, failing once its progress bar has started: the bar is closed (its line
    ended) before the one line of the failure, which is the last. Returns that line."""
    from fabric_lin.cli import main as cli_main

    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == exit_code
    err = capsys.readouterr().err
    bar, _, line = err.rpartition("\n" + argv[0].join(["fabric-lin ", ":"]))
    assert bar.startswith("\rseq_len") and "\n" not in bar and "Traceback" not in err, err
    return f"fabric-lin {argv[0]}:{line}"


def interrupt_batch(monkeypatch, number: int, said: str = "") -> None:
    """A KeyboardInterrupt (`said`: "" for Ctrl-C, "SIGTERM" as the command's handler raises it) as evaluate computes the
    loss of its batch `number`, counted from 1 over every length."""
    import fabric_lin.evaluate

    batches = []
    original = fabric_lin.evaluate.token_losses

    def interrupted(*args):
        batches.append(args)
        if len(batches) == number:
            raise KeyboardInterrupt(said)
        return original(*args)

    monkeypatch.setattr(fabric_lin.evaluate, "token_losses", interrupted)


def test_ctrl_c_while_a_length_is_read_is_the_last_line_below_the_progress_bar(run, tmp_path, capsys, monkeypatch):
    """The bar left open was drawn again when it was collected: the interruption's line began on the bar's line, and the
    bar came again after it. With no batch evaluated, the line says that nothing was written."""
    interrupt_batch(monkeypatch, 1)
    line = error_after_progress(["evaluate", str(run / "out" / "final"), "--out_dir", str(tmp_path / "evaluation")],
                                capsys, exit_code=130)
    assert line == ("fabric-lin evaluate: interrupted: no batch of the validation data had been evaluated, so nothing was "
                    "written; run the same command again\n")
    assert not (tmp_path / "evaluation").exists()


@pytest.mark.parametrize("said, line, exit_code", [("", "interrupted", 130), ("SIGTERM", "stopped by SIGTERM", 143)])
def test_ctrl_c_during_the_data_keeps_what_was_measured_marked_partial(run, tmp_path, capsys, monkeypatch, said, line,
                                                                       exit_code):
    """Ctrl-C (or SIGTERM) as the second of three lengths is read, 2 of its batches done: evaluate.json holds the first
    length whole and the second over the batches read, each equal to an evaluation of those batches alone
    (--max_batches), marked partial first thing in the file, the length and the tasks not reached named; the last line
    says where it is. It wrote nothing: the minutes of the first length were lost."""
    import fabric_lin.evaluate
    from fabric_lin.cli import main as cli_main

    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test does not look at it
        monkeypatch.setitem(sys.modules, module, None)
    final, out = run / "out" / "final", tmp_path / "out"
    monkeypatch.setattr(fabric_lin.evaluate, "find_tasks", lambda *args: "tasks")  # the tasks are not reached
    monkeypatch.setattr(fabric_lin.evaluate, "load_tasks", lambda manager, *args: manager)
    interrupt_batch(monkeypatch, 3 + 3, said)  # the first length's 3 batches, the second's 2, then the third of those
    argv = ["evaluate", str(final), "--seq_len", "[16, 32, 64]", "--max_batches", "3", "--tasks", "hellaswag",
            "--out_dir", str(out)]
    how = "SIGTERM" if said else "Ctrl-C"
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    err = capsys.readouterr().err
    assert info.value.code == exit_code and "Traceback" not in err, err
    assert err.rpartition("\r")[2].splitlines()[-1] + "\n" == (
        f"fabric-lin evaluate: {line}: what had been measured is in {out / 'evaluate.json'}, marked "
        f"partial (seq_len 16 whole, seq_len 32 over its first 2 of 3 batches): evaluate again with --overwrite true "
        f"for the whole evaluation\n")
    monkeypatch.undo()
    results = json.loads((out / "evaluate.json").read_text())
    assert next(iter(results)) == "partial"
    assert results["partial"] == (f"the evaluation was interrupted ({how}) as it read seq_len 32: seq_len 16 is whole; "
                                  f"seq_len 32 holds its first 2 of 3 batches; seq_len 64 and the tasks were not "
                                  f"evaluated")
    assert results["not_evaluated"] == {"seq_len": [64], "tasks": ["hellaswag"]}
    for kept, (length, batches) in zip(results["lengths"], [(16, 3), (32, 2)], strict=True):
        alone = evaluate(final, seq_len=length, max_batches=batches, out_dir=tmp_path / f"alone-{length}")["lengths"][0]
        assert {key: kept[key] for key in ("loss", "data_fingerprint", "tokens", "batches", "by_position")} == {
            key: alone[key] for key in ("loss", "data_fingerprint", "tokens", "batches", "by_position")}
    assert "partial" not in results["lengths"][0]
    assert results["lengths"][1]["partial"] == f"interrupted ({how}) after 2 of 3 batches"
    assert cli_error(["evaluate", str(final), "--max_batches", "1", "--out_dir", str(out)], capsys) == (
        f"fabric-lin evaluate: error: {out / 'evaluate.json'} holds the partial results of an earlier evaluation (it was "
        f"interrupted as it read the validation data): write this one to another --out_dir, or replace them with "
        f"--overwrite true\n")
def test_a_model_whose_logits_are_not_finite_is_one_line_and_writes_nothing(run, tmp_path, capsys):
    """Weights holding a NaN (or a precision whose range the activations overflow): the loss is NaN, which evaluate.json
    held as `NaN` (no JSON: jq and JavaScript refuse the file) beside a plot of nothing, and the line said only
    `loss nan`."""
    import torch

    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint

    model = tmp_path / "model"
    convert_pretrained_checkpoint(run / "out" / "final", model)
    state = torch.load(model / "lit_model.pth")
    state["layers.0.attn_norm.weight"][0] = float("nan")
    torch.save(state, model / "lit_model.pth")
    err = error_after_progress(["evaluate", str(model), "--data", "TokenChunks", "--data.val_path", str(run / "val"),
                                "--data.num_workers", "0"], capsys)
    assert err == (f"fabric-lin evaluate: error: seq_len {TRAIN_LEN}: the loss of its first batch is nan: the model's "
                   f"logits are not finite (its weights hold NaN or inf, or its activations overflow the --precision it "
                   f"runs in: float16's range ends at 65504, bf16's and 32-true's go past 1e38); no results are written\n")
    assert not (model / "evaluate").exists()


def test_a_loss_that_turns_not_finite_after_the_first_batch_is_refused_at_the_end():
    import lightning_fabric as L
    import torch

    from fabric_lin.evaluate import evaluate_length

    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", num_layers=1, vocab_size=64)).eval()
    fabric = L.Fabric(accelerator="cpu", devices=1)
    blocks = torch.randint(0, 64, (2, 9))
    batches = [blocks, blocks.clone()]

    class Loader:
        def __iter__(self):
            yield batches[0]
            with torch.no_grad():
                model.lm_head.weight[0, 0] = float("inf")
            yield batches[1]

        def __len__(self):
            return 2

    with pytest.raises(InvalidValue, match=r"^seq_len 8: the loss of its 2 batches is nan: the model's logits are not "):
        evaluate_length(fabric, model, Loader(), seq_len=8, batch_size=2, max_batches=None, starts=[0])


def test_an_empty_length_list_is_one_line(run, capsys):
    """--seq_len [] (evaluated at the training length, as if not given). (--data.num_workers without --data and without
    a run's data: test_data_options_alone_change_the_run_s_own_data.)"""
    final = run / "out" / "final"
    err = cli_error(["evaluate", str(final), "--seq_len", "[]"], capsys)
    assert "--seq_len [] holds no length: give one or more, e.g. [2048, 4096], or leave it out for the training length" in err


def test_the_run_s_data_moved_away_is_named_with_the_file_that_names_it(run, capsys):
    """Without --data a training checkpoint reads the data its hyperparameters.yaml names; moved since, the error says
    so and points to --data, not to what the run's own command should have given."""
    final = run / "out" / "final"
    (run / "val").rename(run / "val-moved")
    try:
        err = cli_error(["evaluate", str(final)], capsys)
        # the run's data read with another worker count is the run's data still
        assert cli_error(["evaluate", str(final), "--data.num_workers", "0"], capsys) == err
    finally:
        (run / "val-moved").rename(run / "val")
    assert err == (f"fabric-lin evaluate: error: {run / 'val'} does not exist: {final / 'hyperparameters.yaml'} names it "
                   "as the run's data (TokenChunks); give --data to read the data where it is now, e.g. --data TokenChunks "
                   "--data.<option> DIR\n"), err


def test_the_run_s_own_data_is_named_with_its_hyperparameters_yaml_not_as_data_given(run, tmp_path, capsys):
    """Without --data, a fault of the run's data module (its validation directory prepared again with another
    tokenizer; no validation split at all) is told as the run's, with the hyperparameters.yaml that names it: the
    errors began "--data:" or named no origin, as if the user had given --data."""
    import yaml

    from fabric_lin.checkpoint import HPARAMS_FILE, MANIFEST_FILE, file_checksum
    from fabric_lin.data import Tokenizer
    from helpers import train_sentencepiece

    final = run / "out" / "final"
    train_sentencepiece(tmp_path / "other", vocab_size=100)
    other = Tokenizer(tmp_path / "other")
    (run / "val").rename(run / "val-kept")
    try:
        write_prepared(run / "val", np.arange(2000, dtype=np.uint16) % 100, other)
        err = cli_error(["evaluate", str(final), "--out_dir", str(tmp_path / "results")], capsys)
    finally:
        shutil.rmtree(run / "val", ignore_errors=True)
        (run / "val-kept").rename(run / "val")
    assert err == (
        f"fabric-lin evaluate: error: the run's data (TokenChunks, from {final / HPARAMS_FILE}): {run / 'val'} was "
        f"tokenized with vocab_size=100, sha256={other.model_hash[:12]}..., from {tmp_path / 'other'}, and the weights "
        f"of {final} were trained on the ids of {Tokenizer(final).describe()}: an id is another piece in each; evaluate "
        f"on data prepared with the model's tokenizer (--tokenizer_path {final}), given with --data\n"), err

    # the same checkpoint, its run's data without a validation split (its manifest rewritten to match)
    no_validation = tmp_path / "no_validation" / "final"
    shutil.copytree(final, no_validation)
    hparams = yaml.safe_load((no_validation / HPARAMS_FILE).read_text())
    hparams["data"]["init_args"]["val_path"] = None
    (no_validation / HPARAMS_FILE).write_text(yaml.safe_dump(hparams))
    manifest = json.loads((no_validation / MANIFEST_FILE).read_text())
    manifest["files"][HPARAMS_FILE] = file_checksum(no_validation / HPARAMS_FILE)
    (no_validation / MANIFEST_FILE).write_text(json.dumps(manifest))
    err = cli_error(["evaluate", str(no_validation)], capsys)
    assert err == (
        f"fabric-lin evaluate: error: the run's data (TokenChunks, from {no_validation / HPARAMS_FILE}) has no validation "
        f"split, which evaluate reads: give --data with one (TextFiles --data.val_dir DIR, TokenChunks --data.val_path "
        f"DIR, SlimPajamaStarcoder --data.validation true)\n"), err


def test_an_earlier_evaluation_in_out_dir_is_kept_unless_overwrite(run, tmp_path, capsys, monkeypatch):
    """A second evaluation into the out_dir of a first is refused before the model is built, naming the file and the
    two ways on; the first's results stay. With --overwrite true it replaces them, whole: a write cut short (Ctrl-C)
    leaves the earlier file as it was and no partial one beside it."""
    import fabric_lin.evaluate
    from fabric_lin.cli import main as cli_main

    for module in ("matplotlib", "matplotlib.figure"):  # no plot: this test does not look at it
        monkeypatch.setitem(sys.modules, module, None)
    final, out = run / "out" / "final", tmp_path / "eval"
    evaluate(final, max_batches=1, out_dir=out)
    first = (out / "evaluate.json").read_bytes()
    with monkeypatch.context() as patch:
        patch.setattr(fabric_lin.evaluate, "build_model", lambda *args: pytest.fail("the model was built"))
        err = cli_error(["evaluate", str(final), "--max_batches", "2", "--out_dir", str(out)], capsys)
    assert err == (f"fabric-lin evaluate: error: {out / 'evaluate.json'} holds the results of an earlier evaluation: "
                   "write this one to another --out_dir, or replace them with --overwrite true\n"), err
    assert (out / "evaluate.json").read_bytes() == first
    for held in ("not JSON", "[1, 2]"):  # not what evaluate writes: kept all the same, in the same line
        other = tmp_path / f"held{len(held)}"
        other.mkdir()
        (other / "evaluate.json").write_text(held)
        err = cli_error(["evaluate", str(final), "--max_batches", "2", "--out_dir", str(other)], capsys)
        assert err == (f"fabric-lin evaluate: error: {other / 'evaluate.json'} holds the results of an earlier "
                       "evaluation: write this one to another --out_dir, or replace them with --overwrite true\n"), err

    def interrupted(written, path):  # Ctrl-C with the new results written, before they take the place of the first
        assert Path(written).stat().st_size > 0
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", interrupted)
        with pytest.raises(KeyboardInterrupt):
            evaluate(final, max_batches=2, out_dir=out, overwrite=True)
    assert (out / "evaluate.json").read_bytes() == first and sorted(p.name for p in out.iterdir()) == ["evaluate.json"]
    (out / "loss_by_position.png").write_bytes(b"an earlier evaluation's plot")  # not these results': removed
    second = evaluate(final, max_batches=2, out_dir=out, overwrite=True)
    assert not (out / "loss_by_position.png").exists()
    assert second["lengths"][0]["batches"] == 2
    assert json.loads((out / "evaluate.json").read_text()) == json.loads(json.dumps(second))


def test_an_earlier_evaluation_is_told_before_any_slow_work(run, tmp_path, capsys, monkeypatch):
    """An evaluate.json already in out_dir (a training checkpoint's default one beside it, a model directory's in it, or
    --out_dir) stops the command before the harness indexes its tasks and builds them (their datasets read: minutes, a
    download) and before the weights are read (and so the data, after them); the earlier results stay as they were."""
    import fabric_lin.evaluate
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint

    checkpoint = tmp_path / "run" / "final"
    shutil.copytree(run / "out" / "final", checkpoint)
    convert_pretrained_checkpoint(checkpoint, tmp_path / "model")
    earlier = {tmp_path / "run" / "evaluate" / "final": [], tmp_path / "model" / "evaluate": [],
               tmp_path / "elsewhere": ["--out_dir", str(tmp_path / "elsewhere")]}
    for out_dir in earlier:
        out_dir.mkdir(parents=True)
        (out_dir / "evaluate.json").write_text('{"earlier": true}\n')
    for slow in ("find_tasks", "load_tasks", "load_checkpoint"):
        monkeypatch.setattr(fabric_lin.evaluate, slow, lambda *args, slow=slow: pytest.fail(f"{slow} ran"))
    for out_dir, options in earlier.items():
        directory = tmp_path / "model" if out_dir == tmp_path / "model" / "evaluate" else checkpoint
        err = cli_error(["evaluate", str(directory), "--tasks", "hellaswag", "--max_batches", "1", *options], capsys)
        assert err == (f"fabric-lin evaluate: error: {out_dir / 'evaluate.json'} holds the results of an earlier "
                       f"evaluation: write this one to another --out_dir, or replace them with --overwrite true\n"), err
        assert (out_dir / "evaluate.json").read_text() == '{"earlier": true}\n'


def test_data_of_another_tokenizer_names_the_models_tokenizer_to_prepare_it_with(run, tmp_path, capsys):
    """A model directory evaluated on data prepared with another tokenizer: one line naming both and the --tokenizer_path
    to prepare it with, as without its tokenizer.model, where it gave pretrain's fix ("or use the one that made it"),
    which evaluate, reading the model's tokenizer, has no way to take."""
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import Tokenizer
    from helpers import train_sentencepiece

    convert_pretrained_checkpoint(run / "out" / "final", tmp_path / "model")
    train_sentencepiece(tmp_path / "other", vocab_size=100)
    other = Tokenizer(tmp_path / "other")
    write_prepared(tmp_path / "val", np.arange(2000, dtype=np.uint16) % 100, other)
    err = cli_error(["evaluate", str(tmp_path / "model"), "--data", "TokenChunks", "--data.val_path", str(tmp_path / "val"),
                     "--seq_len", str(TRAIN_LEN)], capsys)
    assert err == (
        f"fabric-lin evaluate: error: --data: {tmp_path / 'val'} was tokenized with vocab_size=100, "
        f"sha256={other.model_hash[:12]}..., from {tmp_path / 'other'}, and the weights of {tmp_path / 'model'} were "
        f"trained on the ids of {Tokenizer(tmp_path / 'model').describe()}: an id is another piece in each; evaluate on "
        f"data prepared with the model's tokenizer (--tokenizer_path {tmp_path / 'model'})\n")
    assert not (tmp_path / "model" / "evaluate").exists()


def test_a_tokenizer_with_more_pieces_than_the_model_has_embeddings_is_one_line(run, tmp_path, capsys, harness_with_hellaswag):
    """A model directory whose tokenizer.model is not its model's (300 pieces beside 256 embeddings): evaluate (with
    --tasks, or with data of that tokenizer) and generate refuse it in one line before any text is encoded or data read
    (an id past 255 has no embedding). Without a tokenizer.model, data of the larger vocabulary is refused naming the
    model directory, whichever data module reads it. Evaluated on data, both were refused with pretrain's fix: a model
    config of a larger vocab_size."""
    from fabric_lin.convert.model_dir import save_model_dir

    config = Config.from_name("gla-debug", vocab_size=256)
    (tmp_path / "model").mkdir()
    save_model_dir(GPT(config).state_dict(), config, tmp_path / "model", tokenizer_dir=run / "tok")
    expected = f"{tmp_path / 'model'}: its tokenizer has 300 pieces and its model 256 embeddings"
    assert expected in cli_error(["evaluate", str(tmp_path / "model"), "--tasks", "hellaswag"], capsys)
    assert expected in cli_error(["generate", str(tmp_path / "model"), "--prompt", "a"], capsys)
    data = ["--data", "TokenChunks", "--data.val_path", str(run / "val"), "--max_batches", "1"]
    assert expected in cli_error(["evaluate", str(tmp_path / "model"), *data], capsys)
    for name in ("tokenizer.model", "tokenizer_config.json", "trained_with.json"):
        (tmp_path / "model" / name).unlink()
    for data in (data, ["--data", "TextFiles", "--data.val_dir", str(run / "val"), "--max_batches", "1"]):
        assert cli_error(["evaluate", str(tmp_path / "model"), *data], capsys) == (
            f"fabric-lin evaluate: error: {run / 'val'} was tokenized with a vocabulary of 300 tokens (prepared.json), more "
            f"than the 256 embeddings of the model of {tmp_path / 'model'}: its ids are not those of the tokenizer the "
            "model was trained with; evaluate on data prepared with that tokenizer\n")
    assert not (tmp_path / "model" / "evaluate").exists()
