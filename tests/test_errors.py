"""What a run of several processes says of an error that one rank other than 0 meets alone (`fabric_lin.errors`:
a path missing on its node, a file only it reads): that rank prints nothing (the CLI prints an error from rank 0
only), and rank 0, which then finds its peer gone, printed only that, a lost peer (exit code 75). The rank leaves its
error in the run's store, and rank 0 prints it, naming the rank, with the rank's exit code."""
import os
import sys
from pathlib import Path

import pytest

from helpers import DEBUG_ARGS, run_forked_ranks

pytestmark = pytest.mark.slow


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
