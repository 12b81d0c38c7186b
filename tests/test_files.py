"""fabric_lin/files.py: a file written whole or not at all, output directories taken back on failure without what was
written into them, the directory checks before a command's work, and the readers' one-line errors (a merge key of
YAML, a file system error that stays one). Elsewhere, as commands meet them: the modes of written files
(test_convert_pretrained_checkpoint.py), a YAML key given twice and ~ (test_cli.py), Git LFS pointers
(test_raw_files.py, test_tokenizer.py)."""
import errno
import re

import pytest

from fabric_lin.errors import AlreadyExists, InvalidValue
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
