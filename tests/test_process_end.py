"""The end of a command run as one process of several (`fabric_lin.cli.main`, `end_process_of_several`): after
success the process group destroyed before the atexit functions run, what was printed written out, and the exit code
the command ended with (0, or a reported error's), with no interpreter finalization for gloo's worker threads to run
into."""
import atexit
import json
import os
import sys

import pytest
import torch

from helpers import run_forked_ranks


def _rank_that_ends(rank: int, port: int, out_dir, error: bool) -> None:
    import torch.distributed as dist

    from fabric_lin import cli
    from fabric_lin.errors import InvalidValue

    atexit._clear()  # the forked pytest's own exit functions are not this rank's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))

    def run(argv) -> None:  # a command of two processes: a collective, then its end
        dist.init_process_group("gloo", rank=rank, world_size=2)
        held = dist.group.WORLD  # as FSDP2's device mesh, in torch's DTensor caches, holds it for the interpreter's life
        gathered = [torch.empty(1) for _ in range(2)]
        dist.all_gather(gathered, torch.tensor([float(rank)]))  # the last collective's tensors are Python's
        atexit.register(lambda: (out_dir / f"rank-{rank}.json").write_text(
            json.dumps({"initialized": dist.is_initialized(), "held": str(held)})))
        print("end of the run", end="")
        sys.stderr.write("\rsteps 2/2")  # a progress bar's last state: no newline flushes it
        if error:
            raise InvalidValue("--data.seed -1: expected a seed of 0 or more")

    cli.run = run
    sys.stdout = open(out_dir / f"stdout-{rank}", "w")
    sys.stderr = open(out_dir / f"stderr-{rank}", "w")
    try:
        cli.main(["pretrain"])
    except SystemExit as ending:
        raise AssertionError(f"exit {ending.code} left to the interpreter's finalization")
    raise AssertionError("still running after the end")


@pytest.mark.parametrize("error", [False, True], ids=["success", "reported-error"])
def test_a_process_of_several_ends_with_its_exit_code_after_the_atexit_functions(tmp_path, error):
    codes = run_forked_ranks(lambda rank, port: _rank_that_ends(rank, port, tmp_path, error))
    assert codes == ([2, 2] if error else [0, 0])
    for rank in range(2):
        state = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        # after success the group is gone before the atexit functions; after an error it stays (a peer may be gone)
        assert state["initialized"] is error
        assert (tmp_path / f"stdout-{rank}").read_text() == "end of the run"
        said = (tmp_path / f"stderr-{rank}").read_bytes().decode()  # the \r as written
        assert said.startswith("\rsteps 2/2"), said
        assert ("--data.seed -1: expected a seed of 0 or more" in said) is error, said


def test_a_process_without_a_process_group_goes_on():
    from fabric_lin.cli import end_process_of_several

    assert not torch.distributed.is_initialized()
    end_process_of_several(0)  # returns: the interpreter ends as usual
