"""fabric_lin/files.py: a file written whole or not at all, output directories taken back on failure without what was
written into them, the directory checks before a command's work, and the readers' one-line errors (a merge key of
YAML, a file system error that stays one). Elsewhere, as commands meet them: the modes of written files
(test_convert_pretrained_checkpoint.py), a YAML key given twice and ~ (test_cli.py), Git LFS pointers
(test_raw_files.py, test_tokenizer.py). Here too, the helpers' own cases that no command meets in the tests: the mode
of a new file under another umask, where the directory above a model looks, a list cut short, and environment
variables set for a block."""
import errno
import os
import re

import pytest

from fabric_lin.errors import AlreadyExists, InvalidValue
from fabric_lin import files
from fabric_lin.files import atomic_write, check_empty_output_dir, created_dir, read_yaml, reading


def test_a_failed_write_leaves_the_earlier_file_whole_and_no_temporary_file(tmp_path):
    target = tmp_path / "model_config.yaml"
    target.write_text("the earlier file\n")

    def write_half_then_fail(tmp):
        assert target.read_text() == "the earlier file\n"  # a reader still sees the whole earlier file
        with open(tmp, "w") as f:
            f.write("half of the ne")
        raise OSError(errno.ENOSPC, "No space left on device", tmp)

    with pytest.raises(OSError, match="No space left on device"):
        atomic_write(target, write_half_then_fail)
    assert target.read_text() == "the earlier file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model_config.yaml"]


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_a_whole_that_fails_takes_back_its_own_files_and_only_those(tmp_path, failure):
    """A model written into a directory that already holds files: failing half-way (a full disk, Ctrl-C), the files it
    wrote are removed, and those that were there before stay as they were."""
    (tmp_path / "notes.txt").write_text("the user's\n")
    (tmp_path / "tokenizer.model").write_bytes(b"an earlier tokenizer")
    with pytest.raises(type(failure)):
        with files.files_taken_back_on_failure(tmp_path):
            (tmp_path / "lit_model.pth").write_bytes(b"weights")
            (tmp_path / "model_config.yaml").write_text("n_layer: 2\n")
            raise failure
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "tokenizer.model"]
    assert (tmp_path / "notes.txt").read_text() == "the user's\n"
    assert (tmp_path / "tokenizer.model").read_bytes() == b"an earlier tokenizer"


def test_a_failed_command_takes_back_the_empty_directories_it_made_and_nothing_else(tmp_path):
    (tmp_path / "runs").mkdir()  # there before: stays, though empty
    with pytest.raises(KeyError):
        with created_dir(tmp_path / "runs" / "a" / "b"):
            raise KeyError("a failure before anything was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())


@pytest.mark.parametrize("kept", ["a file", "a symlink"])
def test_a_failed_command_keeps_the_directories_that_hold_what_it_wrote(tmp_path, kept):
    out = tmp_path / "out" / "model"
    with pytest.raises(KeyError):
        with created_dir(out):
            (out / "logs").mkdir()
            if kept == "a file":
                (out / "logs" / "events.log").write_text("written before the failure")
            else:
                (out / "logs" / "latest").symlink_to(tmp_path / "elsewhere")
            raise KeyError("a failure after something was written")
    assert [p.name for p in (out / "logs").iterdir()] == [("events.log" if kept == "a file" else "latest")]


def test_an_output_directory_is_checked_before_it_is_made(tmp_path):
    (tmp_path / "a file").write_text("")
    refusal = (f"directory {tmp_path / 'a file' / 'out'}: {tmp_path / 'a file'} is a file, expected a directory or "
               f"nothing there")
    with pytest.raises(InvalidValue, match=f"^{re.escape(refusal)}$"):
        with created_dir(tmp_path / "a file" / "out"):
            pass
    with pytest.raises(InvalidValue, match=f"^--output_dir {re.escape(str(tmp_path / 'a file'))}: .* is a file"):
        check_empty_output_dir(tmp_path / "a file")  # not empty, not a directory: refused before the work too
    (tmp_path / "empty").mkdir()
    check_empty_output_dir(tmp_path / "empty")  # empty, or not there yet: taken
    check_empty_output_dir(tmp_path / "not there")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "index.json").write_text("{}")
    with pytest.raises(AlreadyExists, match=f"^Output directory {re.escape(str(tmp_path / 'used'))} exists and is not "
                                            f"empty"):
        check_empty_output_dir(tmp_path / "used")


def test_yaml_merge_keys_are_no_key_given_twice(tmp_path):
    """`<<: *base` brings in another mapping's keys, which the mapping's own keys replace (YAML's merge key)."""
    path = tmp_path / "runs.yaml"
    path.write_text("base: &base\n  lr: 1.0e-3\n  steps: 10\nrun:\n  <<: *base\n  steps: 20\n")
    assert read_yaml(path) == {"base": {"lr": 1e-3, "steps": 10}, "run": {"lr": 1e-3, "steps": 20}}


def test_a_file_system_error_while_reading_stays_what_it_is(tmp_path):
    """A reader's OSError that names its file (no permission) is not taken for a damaged file: its fix is not to write
    the file again."""
    path = tmp_path / "tokenizer.model"
    with pytest.raises(PermissionError) as raised:
        with reading(path, "a SentencePiece model", OSError):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
    assert raised.value.filename == str(path)
    with pytest.raises(InvalidValue, match=f"^{re.escape(str(path))} cannot be read as a SentencePiece model: unexpected "
                                           f"end; "):
        with reading(path, "a SentencePiece model", OSError):
            raise OSError("unexpected end")  # names no file: the parser's complaint about the content


def test_a_reader_s_complaint_is_its_first_sentence_on_one_line_or_its_kind(tmp_path):
    path = tmp_path / "lit_model.pth"
    with pytest.raises(InvalidValue, match=f"^{re.escape(str(path))} cannot be read as weights: invalid load key, 'x'; "
                                           f"it may be truncated"):
        with reading(path, "weights", ValueError):
            raise ValueError("invalid load key,\n 'x'. The file was written by something else.")
    with pytest.raises(InvalidValue, match=f"^{re.escape(str(path))} cannot be read as weights: EOFError; "):
        with reading(path, "weights", EOFError):
            raise EOFError()  # a message of its own it has not


def test_a_yaml_key_that_is_a_list_is_the_parser_s_one_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model_name: gla-debug\n? [train, max_steps]\n: 10\n")
    with pytest.raises(InvalidValue, match=f"^{re.escape(str(path))} cannot be read as YAML: found unhashable key at line "
                                           f"2, column 3; "):
        read_yaml(path)


@pytest.mark.parametrize("proc", ["/proc", "no /proc"])
def test_the_usual_mode_is_the_one_a_new_file_gets_under_any_umask(tmp_path, monkeypatch, proc):
    """Under umask 002 (group-writable files, as on many shared machines) and 077; without /proc (macOS) the umask is
    read by setting it, and left as it was."""
    if proc == "no /proc":
        def no_proc(path, *args, **kwargs):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        monkeypatch.setattr(files, "open", no_proc, raising=False)
    previous = os.umask(0o002)
    try:
        for umask in (0o002, 0o077):
            os.umask(umask)
            new_file = tmp_path / f"new-{umask:o}"
            new_file.write_text("")
            assert (files.default_file_mode(), os.umask(umask)) == (new_file.stat().st_mode & 0o777, umask)
    finally:
        os.umask(previous)


def test_a_copy_whose_source_is_missing_names_the_source(tmp_path):
    """An error naming its own file keeps it: the copy's destination is not the file that is missing."""
    with pytest.raises(FileNotFoundError) as raised:
        files.copy_file(tmp_path / "tokenizer.model", tmp_path / "out" / "tokenizer.model")
    assert raised.value.filename == str(tmp_path / "tokenizer.model")


def test_the_directories_below_are_those_that_tell_within_the_depth_in_name_order(tmp_path):
    """A model two levels below is found, not one three levels below, nor one in a hidden directory or below another
    model; a file or a directory not there has nothing below it."""
    for place in ("b-model", "b-model/inner", "a-run/merged", "a-run/adapter/x", ".cache/model", "c/d/e/model"):
        (tmp_path / place).mkdir(parents=True)
        (tmp_path / place / "config.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("")

    def model(directory):
        return "model" if (directory / "config.json").is_file() else None

    assert list(files.directories_below(tmp_path, model).items()) == [(tmp_path / "a-run" / "merged", "model"),
                                                                        (tmp_path / "b-model", "model")]
    assert list(files.directories_below(tmp_path, model, depth=3)) == [
        tmp_path / "a-run" / "adapter" / "x", tmp_path / "a-run" / "merged", tmp_path / "b-model"]
    assert files.directories_below(tmp_path / "notes.txt", model) == {}
    assert files.directories_below(tmp_path / "not there", model) == {}


def test_a_short_list_says_how_many_more_only_past_its_limit():
    assert files.short_list(range(3), limit=3) == "0, 1, 2"
    assert files.short_list(range(5), limit=3) == "0, 1, 2, ... (2 more)"


def test_environment_variables_are_as_before_after_the_block(monkeypatch):
    monkeypatch.setenv("FABRIC_LIN_TEST_SET", "before")
    monkeypatch.delenv("FABRIC_LIN_TEST_UNSET", raising=False)
    with pytest.raises(KeyError):
        with files.environment_variables({"FABRIC_LIN_TEST_SET": "within", "FABRIC_LIN_TEST_UNSET": "within"}):
            assert os.environ["FABRIC_LIN_TEST_SET"] == os.environ["FABRIC_LIN_TEST_UNSET"] == "within"
            raise KeyError("a failure within the block")
    assert os.environ["FABRIC_LIN_TEST_SET"] == "before" and "FABRIC_LIN_TEST_UNSET" not in os.environ


@pytest.fixture
def unwritable_dir(tmp_path):
    """A directory no file can be made in: mode 0o555, or for root (whom modes do not stop) immutable, where the file
    system allows it."""
    import os
    import subprocess

    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    immutable = os.access(directory, os.W_OK) and subprocess.run(["chattr", "+i", str(directory)],
                                                                 capture_output=True).returncode == 0
    if os.access(directory, os.W_OK):
        directory.chmod(0o755)
        pytest.skip("no way here to make a directory unwritable")
    yield directory
    if immutable:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    directory.chmod(0o755)


def test_an_output_directory_that_cannot_be_written_is_refused_before_the_work(unwritable_dir, tmp_path, capsys,
                                                                                      monkeypatch):
    """An output directory in a directory that cannot be written: refused in one line naming it before any work, where
    train_tokenizer trained the whole tokenizer and then failed with "[Errno 13] Permission denied: '...'"."""
    from fabric_lin.files import check_dir_can_be_made
    from helpers import cli_error

    refusal = (f"--output_dir {unwritable_dir / 'tok'}: {unwritable_dir} is not writable (no permission to write in it, "
               "or a read-only file system); give a directory that can be written")
    with pytest.raises(InvalidValue, match=f"^{re.escape(refusal)}$"):
        check_dir_can_be_made(unwritable_dir / "tok", "--output_dir")
    monkeypatch.chdir(unwritable_dir.parent)  # the directory itself, as the user gave it, is named so
    with pytest.raises(InvalidValue, match=f"^--output_dir {unwritable_dir.name}: {unwritable_dir.name} is not writable"):
        check_dir_can_be_made(unwritable_dir.name, "--output_dir")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("a few words of text\n" * 50)
    assert cli_error(["train_tokenizer", "--input_dir", str(tmp_path / "text"), "--output_dir", str(unwritable_dir / "tok"),
                      "--vocab_size", "300"], capsys) == f"fabric-lin train_tokenizer: error: {refusal}\n"
    assert "Training" not in capsys.readouterr().out


def test_a_full_disk_while_writing_names_the_file(tmp_path, monkeypatch):
    """Python reports a write that finds the disk full naming no file, which the CLI took for a bug (a traceback): a
    command's output written whole (atomic_write) and a run's metrics.jsonl name theirs."""
    import lightning_fabric as L

    import fabric_lin.metrics as metrics_module
    from fabric_lin.cli import expected_failure

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as written_whole:
        atomic_write(tmp_path / "evaluate.json", full_disk)
    writer = metrics_module.MetricsWriter(L.Fabric(accelerator="cpu", devices=1), tmp_path, max_steps=2,
                                          tokens_per_step=100)
    monkeypatch.setattr(metrics_module, "open", lambda path, *args, **kwargs: full_disk(), raising=False)
    with pytest.raises(OSError) as appended:
        writer.log_checkpoint(2, "step-00000002")
    for raised, path in ((written_whole.value, tmp_path / "evaluate.json"), (appended.value, tmp_path / "metrics.jsonl")):
        assert (raised.errno, raised.filename) == (errno.ENOSPC, str(path)) and expected_failure(raised)
    assert list(tmp_path.iterdir()) == []


def test_a_directory_the_file_system_will_not_make_is_named_in_one_line_and_nothing_is_left(tmp_path, monkeypatch):
    # what the checks before cannot see (root may write anywhere, yet /proc takes no new directory; a full disk):
    # the second of two new directories refused by the file system
    real_mkdir = os.mkdir

    def refusing_mkdir(path, mode=0o777):
        if os.path.basename(path) == "b":
            raise OSError(errno.ENOSPC, "No space left on device", path)
        real_mkdir(path, mode)

    monkeypatch.setattr(os, "mkdir", refusing_mkdir)
    target = tmp_path / "a" / "b"
    with pytest.raises(InvalidValue, match=f"^directory {re.escape(str(target))} could not be made: No space left on "
                                           f"device$"):
        with created_dir(target):
            pass
    assert list(tmp_path.iterdir()) == []  # the "a" it made on the way is taken back


@pytest.mark.parametrize("command", ["prepare_text", "train_tokenizer", "prepare_slimpajama"])
def test_a_preparation_s_output_dir_inside_a_checkpoint_or_prepared_data_is_refused(tmp_path, capsys, command):
    """prepare_text's, the recipes' and train_tokenizer's --output_dir inside a training checkpoint (told by its
    step.json or manifest.json) or a prepared data directory (its index.json): what is written there would go with them
    when the run prunes or replaces the checkpoint, or the data is prepared again. One line, before any input is read,
    nothing made; as pretrain's --out_dir and the converters' --output_dir are refused."""
    from helpers import cli_error

    checkpoint, data = tmp_path / "run" / "step-00000002", tmp_path / "data" / "train"
    for directory, marker in ((checkpoint, "step.json"), (data, "index.json")):
        directory.mkdir(parents=True)
        (directory / marker).write_text("{}")
    tokenizer = tmp_path / "tok"  # not read: the output dir is refused first
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.jsonl.zst").write_bytes(b"")  # nor is the input
    for inside, holder, kind in ((checkpoint / "tok", checkpoint, "a training checkpoint, whose files are the ones its "
                                  "manifest lists and go with it when its run prunes or replaces it"),
                                 (data / "more" / "fineweb", data, "a prepared data directory, whose files go with it "
                                  "when it is prepared again")):
        argv = [command, "--input_dir", str(tmp_path / "raw"), "--output_dir", str(inside)]
        argv += [] if command == "train_tokenizer" else ["--tokenizer_path", str(tokenizer)]
        assert cli_error(argv, capsys) == (f"fabric-lin {command}: error: --output_dir {inside} is inside {holder}, "
                                           f"{kind}: give a directory outside it\n")
        assert not inside.exists() and not (data / "more").exists()
