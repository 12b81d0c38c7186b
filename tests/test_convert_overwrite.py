"""--overwrite true: a converter writes the new model aside (model_dir.model_written_aside) and replaces the earlier
model only once every file of the new one is written whole. Stopped before that, by a KeyboardInterrupt as any of its
files is written or by a real Ctrl-C to the command, the output directory keeps the earlier model byte for byte (and
loadable), its evaluation and the user's own files; completed, it holds the new model's files and the user's own alone.
Neither leaves a staging file, and one that a kill -9 left is removed by the next conversion (so is a file or a
link at its name, not what the link names). A signal as the new model moves in waits for its end, and the command's
last line then says that the model is whole."""
import contextlib
import shutil
import signal
from pathlib import Path

import pytest
import torch

import fabric_lin_process
from fabric_lin import files
from fabric_lin.config import Config
from fabric_lin.convert import model_dir
from fabric_lin.convert.hf import convert_from_hf, convert_to_hf, read_fla_checkpoint
from fabric_lin.convert.model_dir import STAGING_DIR, load_model_dir_weights
from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
from helpers import ctrl_c, make_model_dir, small_config, wait_for

# the user's own files in the output directory, and the earlier model's evaluation (which goes with that model)
USERS_FILES = {Path("notes.txt"): b"the user's own file stays", Path("evaluate/notes.txt"): b"so does this one"}
EARLIER_EVALUATION = Path("evaluate/evaluate.json")
# (convert_from_llama writes its model directory as convert_pretrained_checkpoint and convert_from_hf do)
CONVERTERS = {"convert_to_hf": convert_to_hf, "convert_pretrained_checkpoint": convert_pretrained_checkpoint,
              "convert_from_hf": convert_from_hf}
# the last file each converter writes: the one by which a reader takes the directory for a model
LAST_FILE = {"convert_to_hf": "config.json", "convert_pretrained_checkpoint": "lit_model.pth",
             "convert_from_hf": "lit_model.pth"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """For each converter: the new model's source, and an output directory holding an earlier model of the kind the
    converter writes (an export of other weights, a model directory of another model), the earlier model's evaluation
    and the user's files."""
    from test_convert_pretrained_checkpoint import fabric_single_device_checkpoint

    root = tmp_path_factory.mktemp("inputs")
    make_model_dir(root / "old", small_config(), seed=0)
    make_model_dir(root / "new", small_config(), seed=1)
    convert_to_hf(root / "old", root / "convert_to_hf" / "out")
    convert_to_hf(root / "new", root / "new_hf")
    checkpoint, _ = fabric_single_device_checkpoint(root / "run", Config.from_name("gla-debug"))
    for command in ("convert_pretrained_checkpoint", "convert_from_hf"):
        shutil.copytree(root / "old", root / command / "out")
    for command in CONVERTERS:
        out = root / command / "out"
        for name, content in {**USERS_FILES, EARLIER_EVALUATION: b'{"val_loss": 4.1}'}.items():
            (out / name).parent.mkdir(exist_ok=True)
            (out / name).write_bytes(content)
    return {"convert_to_hf": (root / "new", root / "convert_to_hf" / "out"),
            "convert_pretrained_checkpoint": (checkpoint, root / "convert_pretrained_checkpoint" / "out"),
            "convert_from_hf": (root / "new_hf", root / "convert_from_hf" / "out")}


def files_of(directory: Path) -> dict:
    return {path.relative_to(directory): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


def earlier_model(out: Path, command: str) -> dict:
    """The tensors of the model in `out`, read as the next command reads it."""
    if command == "convert_to_hf":
        return read_fla_checkpoint(out)[1]
    return load_model_dir_weights(out, Config.from_checkpoint(out))


def interrupt_file(monkeypatch, number: int) -> list:
    """Ctrl-C as a conversion has written its file `number` (from 0) whole, before it renames the file to its name
    (`files.atomic_write`, which writes each of them, asks for the file's mode between the two). Returns a list that
    grows by one as each file is written."""
    written = []
    mode = files.default_file_mode

    def counted() -> int:
        if len(written) == number:
            raise KeyboardInterrupt
        written.append(len(written))
        return mode()

    monkeypatch.setattr(files, "default_file_mode", counted)
    return written


@pytest.mark.parametrize("command", CONVERTERS)
def test_an_overwrite_interrupted_at_any_file_keeps_the_earlier_model(inputs, tmp_path, monkeypatch, command):
    source, earlier = inputs[command]
    before, weights = files_of(earlier), earlier_model(earlier, command)
    with monkeypatch.context() as patch:
        written = interrupt_file(patch, number=10**6)  # counts alone
        CONVERTERS[command](source, tmp_path / "whole")
    assert len(written) >= 4  # the weights, their config, the tokenizer and its record at least
    for number in range(len(written)):
        out = tmp_path / f"interrupted-at-{number}"
        shutil.copytree(earlier, out)
        with monkeypatch.context() as patch:
            interrupt_file(patch, number)
            with pytest.raises(KeyboardInterrupt):
                CONVERTERS[command](source, out, overwrite=True)
        assert files_of(out) == before, f"interrupted at file {number}"
        assert [p.name for p in out.iterdir() if p.name.startswith(".tmp-")] == []
    kept = earlier_model(out, command)
    assert kept.keys() == weights.keys() and all(torch.equal(kept[name], weights[name]) for name in weights)


@pytest.mark.parametrize("command", CONVERTERS)
def test_a_completed_overwrite_leaves_the_new_model_and_the_users_files_alone(inputs, tmp_path, command):
    source, earlier = inputs[command]
    CONVERTERS[command](source, tmp_path / "alone")
    out = tmp_path / "out"
    shutil.copytree(earlier, out)
    CONVERTERS[command](source, out, overwrite=True)
    assert files_of(out) == {**files_of(tmp_path / "alone"), **USERS_FILES}
    assert not (out / STAGING_DIR).exists()


def earlier_model_with_a_signal_in_the_swap(inputs, tmp_path, monkeypatch, command, signum):
    """(source, out): out holds an earlier model (the user's files beside it), and `signum` is raised as the next
    conversion into it starts to remove that model, in the middle of the replacement."""
    source, earlier = inputs[command]
    CONVERTERS[command](source, tmp_path / "alone")
    out = tmp_path / "out"
    shutil.copytree(earlier, out)
    remove = model_dir.remove_earlier_model

    def signal_first(directory):
        signal.raise_signal(signum)
        remove(directory)

    monkeypatch.setattr(model_dir, "remove_earlier_model", signal_first)
    return source, out


@pytest.mark.parametrize("command", CONVERTERS)
def test_a_ctrl_c_during_the_replacement_waits_for_its_end(inputs, tmp_path, monkeypatch, command):
    """SIGINT as the earlier model's files are removed: the replacement (renames, milliseconds) goes on to its end, so
    the directory holds the new model whole, and the Ctrl-C then ends the command."""
    source, out = earlier_model_with_a_signal_in_the_swap(inputs, tmp_path, monkeypatch, command, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        CONVERTERS[command](source, out, overwrite=True)
    assert files_of(out) == {**files_of(tmp_path / "alone"), **USERS_FILES}


def test_a_staging_directory_that_a_kill_left_is_removed_by_the_next_conversion(inputs, tmp_path, capsys):
    """A kill -9 leaves the staging directory with what it held, up to a whole new model not moved in yet: no model to
    any command (hidden from the search for models below a directory), and gone with the next conversion into that
    directory, which takes a directory holding nothing else for an empty one."""
    source, earlier = inputs["convert_to_hf"]
    out = tmp_path / "out"
    (out / STAGING_DIR).mkdir(parents=True)
    for name in ("model.safetensors", "config.json", ".tmp-tokenizer.model"):
        (out / STAGING_DIR / name).write_bytes(b"of the model written aside")
    assert model_dir.what_it_holds(out) is None and model_dir.models_below(tmp_path) == ""
    convert_to_hf(source, out)  # no --overwrite: nothing else is there
    assert f"Removed {out / STAGING_DIR}: the unfinished files of a conversion that was stopped" in capsys.readouterr().out
    assert not (out / STAGING_DIR).exists()
    shutil.copytree(earlier, tmp_path / "earlier")
    (tmp_path / "earlier" / STAGING_DIR).mkdir()
    (tmp_path / "earlier" / STAGING_DIR / "config.json").write_text("{}")
    convert_to_hf(source, tmp_path / "earlier", overwrite=True)
    assert files_of(tmp_path / "earlier") == {**files_of(out), **USERS_FILES}


def test_a_file_or_a_link_where_the_staging_directory_goes_is_taken_away_and_not_what_the_link_names(inputs, tmp_path):
    """Whatever stands at the staging directory's name is the conversion's to take away, with --overwrite or without:
    a file, or a link to a directory, whose directory and files stay."""
    source, _ = inputs["convert_to_hf"]
    convert_to_hf(source, tmp_path / "alone")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("not the conversion's")
    makers = {"file": lambda path: path.write_text("a file"), "link": lambda path: path.symlink_to(elsewhere)}
    for overwrite in (False, True):
        for name, make in makers.items():
            out = tmp_path / f"{name}-{overwrite}"
            out.mkdir()
            make(out / STAGING_DIR)
            convert_to_hf(source, out, overwrite=overwrite)
            assert files_of(out) == files_of(tmp_path / "alone"), (name, overwrite)
    assert files_of(elsewhere) == {Path("notes.txt"): b"not the conversion's"}


@pytest.mark.slow  # a new command, held mid-write: seconds
@pytest.mark.parametrize("command", CONVERTERS)
def test_ctrl_c_to_an_overwriting_command_keeps_the_earlier_model(inputs, tmp_path, command):
    """A real SIGINT to the command's job, held (fabric_lin_process's held_before) as it is about to rename the last
    file of the new model, written whole, to its name: the command ends as interrupted (130), and the output
    directory is as it was."""
    source, earlier = inputs[command]
    out = tmp_path / "out"
    shutil.copytree(earlier, out)
    before = files_of(out)
    log, err = tmp_path / "stdout", tmp_path / "stderr"
    argv = [*fabric_lin_process.FABRIC_LIN, command, str(source), "--output_dir", str(out), "--overwrite", "true"]
    job = fabric_lin_process.start(argv, log, err_log=err, held_before=LAST_FILE[command])
    try:
        held = fabric_lin_process.HELD.format(LAST_FILE[command])
        assert wait_for(lambda: held in log.read_text(), job, timeout=120), err.read_text()[-3000:]
        assert (out / STAGING_DIR / f".tmp-{LAST_FILE[command]}").is_file()
        ctrl_c(job)
        returncode = job.wait(60)
    finally:
        fabric_lin_process.stop(job)
    assert returncode == 130, err.read_text()[-3000:]
    assert err.read_text().splitlines()[-1] == (f"fabric-lin {command}: interrupted: nothing half-written is left; run "
                                                f"the same command again")
    assert files_of(out) == before


# (the signal, how this process handles it before the command starts, the command's last line, its exit code): a
# terminal's Ctrl-C to Python's own handler, one to a process that left SIGINT to its default action (the deferred
# signal was sent again to it: killed, -2, without a word), and a scheduler's SIGTERM
SIGNALS_IN_THE_SWAP = {"ctrl-c": (signal.SIGINT, signal.default_int_handler, "interrupted", 130),
                       "ctrl-c, default action": (signal.SIGINT, signal.SIG_DFL, "interrupted", 130),
                       "sigterm": (signal.SIGTERM, None, "stopped by SIGTERM", 143)}


@pytest.mark.parametrize("command, case", [(command, "ctrl-c") for command in CONVERTERS]
                         + [("convert_to_hf", "ctrl-c, default action"), ("convert_pretrained_checkpoint", "sigterm")])
def test_a_signal_as_the_new_model_moves_in_ends_the_command_saying_the_model_is_whole(inputs, tmp_path, monkeypatch,
                                                                                        capsys, command, case):
    """A signal as the new model takes the earlier one's place (held until that is done): the command ends with one line
    that says the new model is whole in its directory, and 130 (143 for SIGTERM), where it said that nothing
    half-written was left and to run the command again, or, where SIGINT's action was the default one, ended killed by
    the signal with no line at all. The directory holds the new model, as a conversion that was not stopped leaves it."""
    import os

    from fabric_lin.cli import main as cli_main

    signum, handler, said, exit_code = SIGNALS_IN_THE_SWAP[case]
    source, out = earlier_model_with_a_signal_in_the_swap(inputs, tmp_path, monkeypatch, command, signum)
    monkeypatch.setattr(os, "kill", lambda pid, sent: pytest.fail(f"the process sent itself signal {sent}"))
    inherited = signal.signal(signal.SIGINT, handler) if handler is not None else None
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as ended:
            cli_main([command, str(source), "--output_dir", str(out), "--overwrite", "true"])
    finally:
        if handler is not None:
            signal.signal(signal.SIGINT, inherited)
    err = capsys.readouterr().err
    assert ended.value.code == exit_code and "Traceback" not in err, err
    assert err.splitlines()[-1] == (f"fabric-lin {command}: {said}: the conversion had finished: the new model in {out} "
                                    f"is whole (the signal came as its files took the earlier model's place, which "
                                    f"went on to its end)")
    assert files_of(out) == {**files_of(tmp_path / "alone"), **USERS_FILES}
    assert not (out / STAGING_DIR).exists()


def test_a_signal_as_the_files_move_in_ends_the_block_once_the_directory_is_synced(tmp_path, monkeypatch):
    """Ctrl-C as the earlier model goes: the block goes on to put the new files in place and sync the directory, whose
    renames a power cut would otherwise undo, then ends as a KeyboardInterrupt that says the model is whole."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "lit_model.pth").write_bytes(b"earlier")
    synced = []
    sync = model_dir.sync_to_disk
    monkeypatch.setattr(model_dir, "sync_to_disk", lambda path: (synced.append(Path(path).name), sync(path)))
    remove = model_dir.remove_earlier_model
    monkeypatch.setattr(model_dir, "remove_earlier_model",
                        lambda directory: (signal.raise_signal(signal.SIGINT), remove(directory)))
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt) as stopped:
            with model_dir.model_written_aside(out) as staging:
                (staging / "lit_model.pth").write_bytes(b"new")
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert synced == ["lit_model.pth", "out"]
    assert "the new model in" in stopped.value.kept and files_of(out) == {Path("lit_model.pth"): b"new"}


@pytest.mark.parametrize("signum, action, said", [(signal.SIGTERM, signal.SIG_DFL, "SIGTERM"),
                                                  (signal.SIGINT, signal.SIG_DFL, ""),
                                                  (signal.SIGTERM, signal.SIG_IGN, None)])
def test_a_signal_deferred_at_its_default_action_ends_the_block_as_the_cli_tells_it(signum, action, said):
    """A signal whose action is to end the process ends the block, once done, as a KeyboardInterrupt that the CLI tells
    by its text: SIGTERM's (143, "stopped by SIGTERM"), or none for SIGINT (130, "interrupted"); one that is ignored is
    dropped. Off the main thread, where Python runs no handler and sets none, the block runs as it is."""
    import threading

    from fabric_lin.checkpoint import signals_deferred

    inherited = signal.signal(signum, action)
    done = []
    try:
        with pytest.raises(KeyboardInterrupt) if said is not None else contextlib.nullcontext() as stopped:
            with signals_deferred(signal.SIGINT, signal.SIGTERM):
                signal.raise_signal(signum)
                done.append(signum)
        assert done == [signum] and signal.getsignal(signum) == action
        if said is not None:
            assert str(stopped.value) == said
        thread = threading.Thread(target=lambda: done.append(signals_deferred(signum).__enter__()))
        thread.start()
        thread.join()
        assert len(done) == 2 and signal.getsignal(signum) == action
    finally:
        signal.signal(signum, inherited)
