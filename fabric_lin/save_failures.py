"""A checkpoint save that fails: the file system's error behind it (no space left, a quota reached, no permission), the
same failure raised on every rank of a run of several processes, and Fabric's writer of a one-file lit_model.pth, which
names the file a failed write was for.

A save is shared out: every rank writes its shards (torch.distributed.checkpoint), rank 0 alone writes the other
files, each rank checksums a share of them. A rank that fails alone in its part would leave the others waiting for it
in the save's next collective until its process ended, and they would report a lost peer (`PeerLost`) in place of the
disk that is full; rank 0, which reports a run's errors, would say nothing else. So each part ends with an exchange
(`failure_shared`) that tells every rank whether any failed, and every rank raises the failure: its own, or the first
failing rank's, naming that rank."""
import contextlib
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from lightning_fabric.plugins import TorchCheckpointIO

from fabric_lin.errors import FILE_SYSTEM_ERRNOS
from fabric_lin.files import refused_write

class CheckpointFileIO(TorchCheckpointIO):
    """Fabric's writer of lit_model.pth (one device and DDP): `torch.save` straight into the file.

    Lightning's own writer first serialises the whole checkpoint into memory, then writes it through an
    fsspec transaction, which puts the bytes in a temporary file of the default temporary directory
    ($TMPDIR) and moves them: a second copy of every checkpoint in memory and on a file system the run
    never chose, so a node with a small /tmp fails every save. The file lies in the checkpoint's `.tmp-`
    directory, renamed only when everything is written, so writing it in place is just as safe."""

    def save_checkpoint(self, checkpoint: Dict[str, Any], path, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        try:
            torch.save(checkpoint, path)  # fsynced with the rest when the manifest is written
        except RuntimeError as error:
            # torch's zip writer reports a failed write (a full disk, a quota) as a RuntimeError about file
            # positions: the file system's own error is the one to report, naming the file
            reason = refused_write(error, Path(path).parent)
            if reason is None:
                raise
            raise OSError(reason.errno, reason.strerror, str(path)) from error


def file_system_error(error: BaseException, checkpoint_dir: Path, rank: int = 0) -> Optional[OSError]:
    """The file system's error behind a failed save into `checkpoint_dir` (no space left, a quota reached, no
    permission), naming the file it names, else the checkpoint: the error the CLI reports in one line. Python's writes
    report a full disk naming no file; torch.save reports one as a RuntimeError of its zip writer, in Fabric's meta.pt
    and in the shards that torch.distributed.checkpoint writes, which gives every rank a CheckpointException holding
    each failing rank's error (a BaseException, which no `except Exception` catches): this `rank`'s own is the one
    looked into, and a further write into out_dir tells what the file system said of a RuntimeError. None for any
    other error, and for a CheckpointException where this rank did not fail."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(error, CheckpointException):
        own = error.failures.get(rank)
        if own is None:
            return None
        error = own[0]  # (the exception, its stack)
    if isinstance(error, RuntimeError):
        refused = refused_write(error, checkpoint_dir.parent)
        error = OSError(refused.errno, refused.strerror) if refused is not None else error
    if not isinstance(error, OSError) or error.errno not in FILE_SYSTEM_ERRNOS:
        return None
    return error if error.filename else OSError(error.errno, error.strerror, str(checkpoint_dir))


def all_gather_objects(fabric, obj: Any) -> List[Any]:
    """`obj` of every rank, in rank order (Fabric's all_gather takes tensors only)."""
    if fabric.world_size == 1:
        return [obj]
    gathered: List[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(gathered, obj)
    return gathered


# What a rank tells the others of its part of a save: None (it did its part), ("file system", errno, strerror,
# filename) or ("error", the error's type name, its message)
Outcome = Optional[Tuple[str, Any, Any, Any]]


@contextlib.contextmanager
def failure_shared(fabric, checkpoint_dir: Path) -> Iterator[None]:
    """Within: a part of the save of `checkpoint_dir` that each rank does alone, or that every rank takes part in; its
    end is a barrier. There every rank learns whether any failed, and each raises: the file system's error behind its
    own failure, else the first one of another rank's (in rank order, naming the rank: the disk of another node may be
    the full one), else its own error, else another rank's error as a RuntimeError naming that rank and what it raised.
    A KeyboardInterrupt passes at once (a second Ctrl-C is every process's); so does one that
    torch.distributed.checkpoint caught, as every rank's CheckpointException."""
    from torch.distributed.checkpoint.api import CheckpointException

    rank = fabric.global_rank
    failure: Optional[BaseException] = None
    try:
        yield
    except (Exception, CheckpointException) as error:
        if isinstance(error, CheckpointException) and any(
                isinstance(failed[0], KeyboardInterrupt) for failed in error.failures.values()):
            raise KeyboardInterrupt from error
        failure = error
    reason = file_system_error(failure, checkpoint_dir, rank) if failure is not None else None
    outcome: Outcome = (("file system", reason.errno, reason.strerror, reason.filename) if reason is not None
                        else ("error", type(failure).__name__, str(failure).splitlines()[0] if str(failure) else "", None)
                        if failure is not None else None)
    outcomes = all_gather_objects(fabric, outcome)
    if reason is not None:
        raise reason from failure
    others = [(r, o) for r, o in enumerate(outcomes) if o is not None and r != rank]
    for other, (kind, number, strerror, filename) in others:
        if kind == "file system":
            raise OSError(number, f"{strerror} (on rank {other})", filename) from failure
    if failure is not None:
        raise failure
    if others:
        other, (_, name, message, _) = others[0]
        raise RuntimeError(f"rank {other} failed while saving {checkpoint_dir}: {name}: {message}")
