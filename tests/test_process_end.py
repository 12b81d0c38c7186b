"""The end of a command run as one process of several (`fabric_lin.cli.end_process_of_several`): the process group
destroyed before the atexit functions run, what was printed written out, exit code 0, and no interpreter finalization
for gloo's worker threads to run into."""
import atexit
import json
import os
import sys

import torch

from helpers import run_forked_ranks


def _rank_that_ends(rank: int, port: int, out_dir) -> None:
    import torch.distributed as dist

    from fabric_lin.cli import end_process_of_several

    atexit._clear()  # the forked pytest's own exit functions are not this rank's
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    held = dist.group.WORLD  # as FSDP2's device mesh, in torch's DTensor caches, holds it for the interpreter's life
    gathered = [torch.empty(1) for _ in range(2)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))  # the last collective's tensors are Python's

    def record() -> None:
        (out_dir / f"rank-{rank}.json").write_text(json.dumps({"initialized": dist.is_initialized()}))

    atexit.register(record)
    sys.stdout = open(out_dir / f"stdout-{rank}", "w")
    print("end of the run", end="")
    end_process_of_several()
    raise AssertionError(f"still running after the end, holding {held}")


def test_a_process_of_several_ends_with_exit_code_0_after_the_group_and_the_atexit_functions(tmp_path):
    assert run_forked_ranks(lambda rank, port: _rank_that_ends(rank, port, tmp_path)) == [0, 0]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank-{rank}.json").read_text()) == {"initialized": False}
        assert (tmp_path / f"stdout-{rank}").read_text() == "end of the run"


def test_a_process_without_a_process_group_goes_on():
    from fabric_lin.cli import end_process_of_several

    assert not torch.distributed.is_initialized()
    end_process_of_several()  # returns: the interpreter ends as usual
