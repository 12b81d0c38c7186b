"""The one kind of error that means "the user gave something wrong": a value, a key, a file, a missing package.

Raised where the mistake is found, with a message that names what was given and what was expected (and the
fix, where there is one). `fabric_lin.cli` prints such an error as one line with exit code 2; any other
error is a bug and keeps its traceback. The subclasses are also the built-in error a Python caller would
catch for the same mistake (`except ValueError`, `except FileNotFoundError`, ...).

Beside them, `PeerLost`: no mistake of the user's, and no bug either, but a run of several processes that cannot go on
because one of them is gone; the CLI prints it as one line too, on every rank that is left, naming the rank
(`process_rank`). Where the rank that is gone ended on an error of its own, rank 0 prints that error instead, which the
rank left in the run's store (`leave_error_for_rank_0`)."""
import errno
import json
import os
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

# The errors of a file system that a command reports in one line where they name their file: no space left, a quota
# reached, no permission, a read-only file system (nothing the command could have done otherwise)
FILE_SYSTEM_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
# Set (to anything but 0 or false), every error keeps its traceback and nothing that torch prints is held back
DEBUG_ENV = "FABRIC_LIN_DEBUG"


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "False")


class UserError(Exception):
    """Something given to fabric-lin is wrong: the message says what, and what was expected."""


class InvalidValue(UserError, ValueError):
    """A value (an argument, a setting, a file's content) that cannot be used."""


class MissingFile(UserError, FileNotFoundError):
    """A file or directory that should be there is not."""


class AlreadyExists(UserError, FileExistsError):
    """An output that is already there and would be overwritten or mixed with."""


class MissingPackage(UserError, ImportError):
    """An optional package that this use needs is not installed."""


# sysexits.h's EX_TEMPFAIL: nothing the user gave is wrong (not 2), the same command may succeed, and a job script can
# tell it from a bug's 1
PEER_LOST_EXIT_CODE = 75
# sysexits.h's EX_UNAVAILABLE: the run's processes did not all join (another node's command not started, or started
# with another MASTER_ADDR or MASTER_PORT, or a firewall between them): not a lost peer (75), which a job script
# resubmits with --resume auto, while the same command on the same nodes would wait in vain again
JOIN_FAILED_EXIT_CODE = 69


class PeerLost(Exception):
    """Another process of a multi-process run ended (killed, out of memory, its node lost) or became unreachable while
    this one exchanged data with it: the run cannot go on. `during` says what the run was doing; `advice`, where the
    run knows it, its newest complete checkpoint and how to continue."""

    def __init__(self, during: str, cause: str):
        super().__init__(during, cause)
        self.during, self.cause, self.advice = during, cause, ""

    def __str__(self) -> str:
        return (f"a peer process of the run ended or became unreachable during {self.during} ({self.cause})"
                + (f"; {self.advice}" if self.advice else ""))

    def line(self, prog: str, rank: int) -> str:
        """The one line a command prints for it, on every rank that is left, before it exits with PEER_LOST_EXIT_CODE."""
        return f"{prog}: error on rank {rank}: {self}"


# Where a rank other than 0 leaves the line of the error it ends on, in the run's store (torch.distributed's key-value
# store, which every process reaches while the process group lives, whatever its collectives are waiting for): an error
# that rank alone meets (a path missing on its node, a file only it reads) is printed by rank 0, which would otherwise
# see only its peer gone (`PeerLost`), where the CLI prints the errors of rank 0 and of each node's first process only
RANK_ERROR_KEY = "fabric_lin/error-of-rank-{}"


def _run_store():
    """The process group's store, or None where there is no process group (one process, or not launched yet)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def leave_error_for_rank_0(line: str, exit_code: int) -> None:
    """On a rank other than 0 of a run of several processes: leave `line`, what this rank fails with, and the exit code
    it ends with for rank 0 (`error_left_by_another_rank`). Nothing where the store cannot be reached: the rank is
    ending all the same."""
    try:
        store = _run_store()
        if store is not None and process_rank() != 0:
            store.set(RANK_ERROR_KEY.format(process_rank()), json.dumps({"line": line, "exit_code": exit_code}))
    except Exception:  # noqa: BLE001 - a store gone with its host (rank 0): nothing is left to tell
        pass


def error_left_by_another_rank() -> Optional[Tuple[int, str, int]]:
    """(rank, line, exit code) of the first other rank that left the error it ended on (`leave_error_for_rank_0`), else
    None."""
    try:
        store = _run_store()
        if store is None:
            return None
        world = sys.modules["torch.distributed"].get_world_size()
        for rank in range(world):
            key = RANK_ERROR_KEY.format(rank)
            if rank != process_rank() and store.check([key]):
                left = json.loads(store.get(key).decode("utf-8", "replace"))
                return rank, str(left["line"]), int(left["exit_code"])
    except Exception:  # noqa: BLE001 - no store to ask: the peer's loss is all that is known
        return None
    return None


def process_rank() -> int:
    """This process's global rank: Fabric's, once it has launched, else the launchers' environment (0 alone). Read
    where torch and Lightning may not be imported yet: a command's first error comes before them."""
    rank_zero = sys.modules.get("lightning_fabric.utilities.rank_zero")
    if rank_zero is not None and getattr(rank_zero.rank_zero_only, "rank", None) is not None:
        return int(rank_zero.rank_zero_only.rank)
    for key in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def named_for_rank(message: str, rank: int) -> str:
    """A command's one line as a rank other than 0 says it: "error: ..." as "error on rank N: ...", any other line
    followed by "(rank N)"; rank 0's as it is."""
    if rank == 0:
        return message
    if message.startswith("error: "):
        return message.replace("error: ", f"error on rank {rank}: ", 1)
    return f"{message} (rank {rank})"


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block, SIGTERM (`kill`, `timeout`, a scheduler) raises KeyboardInterrupt("SIGTERM") as Ctrl-C does, so
    that the block's clean-up of what it was writing runs; SIGTERM's default action would end the process where it
    stands, leaving half-written files behind. Outside the main thread, where no handler can be set, the block runs as
    it is. (KeyboardInterrupt itself: a script ends on an uncaught one as killed by SIGINT, on a subclass with 1.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
