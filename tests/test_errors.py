"""What a run of several processes says of an error that one rank other than 0 meets alone (`fabric_lin.errors`:
a path missing on its node, a file only it reads): that rank prints nothing (the CLI prints an error from rank 0
only), and rank 0, which then finds its peer gone, printed only that, a lost peer (exit code 75). The rank leaves its
error in the run's store, and rank 0 prints it, naming the rank, with the rank's exit code; where several ranks left
one, the first of them. Beside it, the errors of a file system that the CLI prints in one line (no space left, a quota
reached, no permission, a read-only file system), and a broken pipe that is not standard output's, which is a bug."""
import errno
import os
import sys
from pathlib import Path

import pytest

from helpers import DEBUG_ARGS, run_forked_ranks


def _rank_of_a_run(rank: int, tmp_path: Path, port: int, failing: int, failure: str) -> None:
    """Rank `rank` of `fabric-lin pretrain` on 2 CPU processes (gla-debug, the sample corpus), started as torchrun
    starts them, in which rank `failing` alone meets `failure` after the launch: a missing file (a user's error) or a
    bug. Its output goes to tmp_path/rank-<rank>.log; the process ends with the command's exit code (the CLI ends a
    process of several itself, with os._exit, after a reported error)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0", TORCHELASTIC_RUN_ID="rank-error",
                      CUDA_VISIBLE_DEVICES="")
    log = os.open(tmp_path / f"rank-{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = sys.stderr = open(log, "w", buffering=1, closefd=False)  # not pytest's capture, which forked with us
    import fabric_lin.pretrain as pretrain
    from fabric_lin.cli import main
    from fabric_lin.errors import MissingFile

    def fails_here(*args, **kwargs):
        if failure == "missing file":
            raise MissingFile(f"{tmp_path / 'train'} does not exist: expected the directory of the training data")
        raise ZeroDivisionError("division by zero")

    if rank == failing:
        pretrain.select_resume_dir = fails_here  # after the launch, where no other rank waits for this one
    try:
        main(["pretrain", *DEBUG_ARGS, "--train.max_steps", "1", "--devices", "2", "--out_dir", str(tmp_path / "out")])
        code = 0
    except SystemExit as exit:
        code = exit.code
    except BaseException:  # a bug's traceback is its output; the CLI lets it through with exit code 1
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as the interpreter would end with it (a bug's traceback: 1)


def run_with_a_failing_rank(tmp_path: Path, failure: str):
    """[(exit code, output)] of ranks 0 and 1, rank 1 meeting `failure` alone."""
    codes = run_forked_ranks(lambda rank, port: _rank_of_a_run(rank, tmp_path, port, 1, failure))
    return [(codes[rank], (tmp_path / f"rank-{rank}.log").read_text()) for rank in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["missing file", "bug"])
def test_an_error_of_rank_1_alone_is_printed_by_rank_0(tmp_path, failure):
    (code_0, out_0), (code_1, out_1) = run_with_a_failing_rank(tmp_path, failure)
    if failure == "missing file":
        line = (f"fabric-lin pretrain: error on rank 1: {tmp_path / 'train'} does not exist: expected the directory of "
                "the training data\n")
        assert (code_0, code_1) == (2, 2) and "fabric-lin pretrain: error" not in out_1
    else:
        line = ("fabric-lin pretrain: error on rank 1: ZeroDivisionError: division by zero (a bug: its traceback is in "
                "rank 1's output)\n")
        assert (code_0, code_1) == (1, 1) and "ZeroDivisionError: division by zero" in out_1  # its traceback
    assert out_0.endswith(line) and out_0.count(line) == 1, out_0[-2000:]
    assert "peer process" not in out_0 and "Traceback" not in out_0


def test_rank_0_prints_the_error_of_the_first_rank_that_left_one(monkeypatch):
    """Ranks 3 and 1 of a run of 4 end on errors of their own, rank 3 first; rank 0 meets a lost peer and finds rank 1's
    error, the lowest rank's, whichever came first. What rank 0 itself ends on is its own to print: it leaves none."""
    import torch.distributed as dist
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin import errors

    store = dist.HashStore()  # the run's store, as every rank reaches it
    monkeypatch.setattr(errors, "_run_store", lambda: store)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    for rank, line, code in ((3, "a bug of rank 3", 1), (1, "a file missing on rank 1's node", 2),
                             (0, "a peer process of the run ended", 75)):
        monkeypatch.setattr(rank_zero_only, "rank", rank, raising=False)
        errors.leave_error_for_rank_0(line, code)
    assert not store.check([errors.RANK_ERROR_KEY.format(0)])
    assert errors.error_left_by_another_rank() == (1, "a file missing on rank 1's node", 2)


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS])
def test_a_file_system_error_that_names_its_file_is_one_line(monkeypatch, capsys, number):
    from fabric_lin import cli

    path = "/data/out/.tmp-step-00000100/lit_model.pth"

    def refused(argv):
        raise OSError(number, os.strerror(number), path)

    monkeypatch.setattr(cli, "run", refused)
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["pretrain"])
    assert info.value.code == 2
    assert capsys.readouterr().err == f"fabric-lin pretrain: error: [Errno {number}] {os.strerror(number)}: '{path}'\n"


def test_a_broken_pipe_that_is_not_standard_output_s_keeps_its_traceback(monkeypatch, capfd):
    """Standard output is a file that takes writes (no reader gone): a BrokenPipeError comes from elsewhere (a socket, a
    child process's pipe), a bug, not a command cut short by `| head`, which ends quietly with exit code 141."""
    from fabric_lin import cli

    def pipe_gone(argv):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    monkeypatch.setattr(cli, "run", pipe_gone)
    with pytest.raises(BrokenPipeError):
        cli.main(["pretrain"])


def test_a_bug_of_another_rank_is_left_for_rank_0_as_one_line_of_its_start(monkeypatch):
    """Rank 1 meets a bug whose message runs over several lines (as torch's do): what it leaves for rank 0 to print is
    one line, the message's words joined by single spaces and cut after 300 characters, naming where the traceback is."""
    import json

    import torch.distributed as dist
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    from fabric_lin import cli, errors

    store = dist.HashStore()
    monkeypatch.setattr(errors, "_run_store", lambda: store)
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    words = [f"word{i}" for i in range(100)]
    message = "shapes differ:\n  " + "\n\t".join(words)

    def bug(argv):
        raise ValueError(message)

    monkeypatch.setattr(cli, "run", bug)
    with pytest.raises(ValueError):
        cli.main(["pretrain"])
    left = json.loads(store.get(errors.RANK_ERROR_KEY.format(1)))
    said = ("shapes differ: " + " ".join(words))[:300]
    assert left == {"line": f"ValueError: {said} (a bug: its traceback is in rank 1's output)", "exit_code": 1}
