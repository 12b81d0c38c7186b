"""A checkpoint save that fails (`fabric_lin.save_failures`): torch.save's own failure raised as it is where the file
system takes further writes, and the file system's error naming lit_model.pth where it refuses them (one process); a
rank that did its part of a save raising the error of the first rank that failed in its own; in a sharded run of 2 CPU processes (FSDP2), a disk that fills up during the shards of
every rank, or of rank 1 alone (its node's disk), and a file system that refuses rank 1's fsync while the manifest's
checksums are taken: every rank raises the file system's error, naming the checkpoint (and, where another rank's disk
was the full one, that rank) instead of torch's CheckpointException on each rank or, on rank 0, a lost peer: the
one line the CLI prints. The unfinished checkpoint is gone and the one before stays whole, the one a resume takes.
A second Ctrl-C during the shards is a KeyboardInterrupt on every rank, not torch's CheckpointException. (One
process, the disk full while the small files are written: test_checkpoint.py.)"""
import errno
import io
import os
from pathlib import Path
from typing import Dict, List, Optional

import lightning_fabric as L
import pytest
import torch

from fabric_lin.checkpoint import Checkpointer, select_resume_dir, verify_checkpoint
from fabric_lin.save_failures import CheckpointFileIO
from fabric_lin.weights import MODEL_FILE


def test_a_failed_write_of_the_weights_that_is_not_the_file_system_s_is_raised(tmp_path, monkeypatch):
    """torch.save's RuntimeError where the file system takes further writes (no full disk): raised as it is, so the save
    fails and no manifest calls the half-written file complete."""
    def half_written(obj, path):
        Path(path).write_bytes(b"half")
        raise RuntimeError("serialization failed")

    monkeypatch.setattr(torch, "save", half_written)
    with pytest.raises(RuntimeError, match="^serialization failed$"):
        CheckpointFileIO().save_checkpoint({"step_count": 1}, tmp_path / MODEL_FILE)


def test_a_full_disk_while_the_weights_are_written_names_their_file(tmp_path, monkeypatch):
    """One process: torch.save's zip writer fails on a full disk with a RuntimeError about file positions, and the file
    system refuses further writes at their fsync (as NFS reports a full disk). The save raises the file system's error
    naming lit_model.pth of the unfinished checkpoint: the one line the CLI prints. The checkpoint before stays."""
    from fabric_lin.checkpoint import train_state
    from fabric_lin.cli import expected_failure
    from fabric_lin.config import Config

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[CheckpointFileIO()])
    model = torch.nn.Linear(4, 3)
    state = train_state(model, torch.optim.AdamW(model.parameters()), train_dataloader={"samples": 4})
    out_dir = tmp_path / "out"
    checkpointer = Checkpointer(out_dir, {"train": {"micro_batch_size": 2}}, Config.from_name("gla-debug"))
    state["step_count"] = 2
    checkpointer.save(fabric, state)

    def zip_writer_on_a_full_disk(obj, path, *args, **kwargs):
        Path(path).write_bytes(b"PK")  # the part written before the disk filled up
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 2")

    def fsync_refused(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", zip_writer_on_a_full_disk)
        patch.setattr(os, "fsync", fsync_refused)
        state["step_count"] = 4
        with pytest.raises(OSError) as raised:
            checkpointer.save(fabric, state)
    weights = out_dir / ".tmp-step-00000004" / MODEL_FILE
    assert (raised.value.errno, raised.value.filename) == (errno.ENOSPC, str(weights))
    assert expected_failure(raised.value)
    assert_only_the_checkpoint_before_stays(out_dir)


class RankOfFour:
    """What `failure_shared` asks of Fabric, on rank `global_rank` of a run of 4 processes."""

    world_size = 4

    def __init__(self, global_rank: int):
        self.global_rank = global_rank


def test_a_rank_that_did_its_part_raises_the_error_of_the_first_rank_that_failed(tmp_path, monkeypatch):
    """Ranks 2 and 3 of a run of 4 fail in their part of a save with errors that are not the file system's (bugs); each
    raises its own. Rank 0 did its part, and must raise all the same, or it would go on to the save's next collective
    and wait there for ranks that have left the save: a RuntimeError naming the first failing rank and its error."""
    import fabric_lin.save_failures as save_failures

    checkpoint = tmp_path / ".tmp-step-00000004"
    told: Dict[int, object] = {}  # what each failing rank gave the exchange

    def exchange(fabric, own):
        told[fabric.global_rank] = own
        return [own if rank == fabric.global_rank else told.get(rank) for rank in range(fabric.world_size)]

    monkeypatch.setattr(save_failures, "all_gather_objects", exchange)
    for rank, error in ((2, ValueError("a shard of no tensor\nsecond line")), (3, KeyError("optimizer"))):
        with pytest.raises(type(error)) as raised:
            with save_failures.failure_shared(RankOfFour(rank), checkpoint):
                raise error
        assert raised.value is error
    with pytest.raises(RuntimeError) as raised:
        with save_failures.failure_shared(RankOfFour(0), checkpoint):
            pass
    assert str(raised.value) == f"rank 2 failed while saving {checkpoint}: ValueError: a shard of no tensor"


def test_a_ctrl_c_in_a_rank_s_part_of_a_save_passes_at_once(tmp_path, monkeypatch):
    """A second Ctrl-C in a rank's part of a save stops it at once: no exchange with the other ranks, which may be
    anywhere else in the save (and get the same Ctrl-C there)."""
    import fabric_lin.save_failures as save_failures

    monkeypatch.setattr(save_failures, "all_gather_objects", lambda fabric, own: pytest.fail("exchanged with the others"))
    with pytest.raises(KeyboardInterrupt):
        with save_failures.failure_shared(RankOfFour(1), tmp_path / ".tmp-step-00000004"):
            raise KeyboardInterrupt


class FillingFile(io.RawIOBase):
    """A file written on a disk that `room` (a one-element list, shared by the files of the disk) bytes fill: a write
    past them raises Python's OSError for a full disk, which names no file."""

    def __init__(self, file, room: list):
        self.file, self.room = file, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        size = len(memoryview(data))
        if size > self.room[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room[0] -= size
        return self.file.write(data)

    def tell(self) -> int:
        return self.file.tell()

    def flush(self) -> None:
        self.file.flush()

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        super().close()  # flushes first
        self.file.close()


def what_was_raised(error: Optional[BaseException]) -> Optional[Dict[str, object]]:
    return None if error is None else {"type": type(error).__name__, "errno": getattr(error, "errno", None),
                                       "filename": getattr(error, "filename", None), "message": str(error)}


def sharded_run(rank: int, out_dir: Path, port: int):
    """(Fabric, the train state, a Checkpointer into out_dir) of one of the 2 CPU processes of a sharded (FSDP2) run of
    a one-layer gla-debug, started as torchrun starts them."""
    from helpers import sharded_gla_rank

    fabric, state, config = sharded_gla_rank(rank, port, "full-disk")
    return fabric, state, Checkpointer(out_dir, {"train": {"micro_batch_size": 2}}, config)


def _sharded_saves_on_a_failing_disk(rank: int, out_dir: Path, port: int, room: int, filling: List[int],
                                     fsync_refused: List[int]) -> None:
    """One rank of `sharded_run`: a complete checkpoint at step 2, then one at step 4 during which the disks of the ranks
    `filling` fill up after `room` more bytes written from Python (where torch.distributed.checkpoint writes the
    shards), then, where `fsync_refused` names ranks, one at step 6 whose fsyncs of the manifest's checksums on those
    ranks the file system refuses for want of room (as NFS reports a full disk). What the saves at steps 4 and 6
    raised is left in out_dir/../rank-<rank>.pt."""
    import builtins

    import fabric_lin.checkpoint as checkpoint_module

    fabric, state, checkpointer = sharded_run(rank, out_dir, port)
    state["step_count"] = 2
    checkpointer.save(fabric, state)

    def save(step: int) -> Optional[Dict[str, object]]:
        state["step_count"] = step
        try:
            checkpointer.save(fabric, state)
        except BaseException as error:  # what the save raised is the result
            return what_was_raised(error)
        return None

    real_open, left = io.open, [room]

    def open_on_a_filling_disk(file, mode="r", *args, **kwargs):
        opened = real_open(file, mode, *args, **kwargs)
        on_the_disk = isinstance(file, (str, Path)) and Path(file).is_relative_to(out_dir)
        return FillingFile(opened, left) if on_the_disk and set(mode) & set("wax") and "b" in mode else opened

    if rank in filling:
        builtins.open = io.open = open_on_a_filling_disk
    raised = [save(4)]
    builtins.open = io.open = real_open
    if fsync_refused:
        real_checksum = checkpoint_module.file_checksum

        def checksum_refused(path, fsync=False):
            if fsync:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_checksum(path, fsync)

        if rank in fsync_refused:
            checkpoint_module.file_checksum = checksum_refused
        raised.append(save(6))
        checkpoint_module.file_checksum = real_checksum
    torch.save(raised, out_dir.parent / f"rank-{rank}.pt")


def run_two_ranks(tmp_path: Path, target, *args) -> List:
    """What each of the 2 ranks of `target(rank, out_dir, port, *args)` left in tmp_path/rank-<rank>.pt, in rank order;
    both processes must end."""
    from helpers import run_forked_ranks

    codes = run_forked_ranks(lambda rank, port: target(rank, tmp_path / "out", port, *args))
    assert codes == [0, 0]
    return [torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True) for rank in (0, 1)]


def saves_on_a_failing_disk(tmp_path: Path, filling: List[int], fsync_refused: List[int]) -> List[list]:
    """What each rank's saves raised (`_sharded_saves_on_a_failing_disk`), in rank order."""
    return run_two_ranks(tmp_path, _sharded_saves_on_a_failing_disk, 64 << 10, filling, fsync_refused)


def no_space(checkpoint: Path, on_rank: Optional[int] = None) -> Dict[str, object]:
    """What a rank raised for a full disk while writing `checkpoint`: the OSError the CLI prints in one line."""
    strerror = os.strerror(errno.ENOSPC) + (f" (on rank {on_rank})" if on_rank is not None else "")
    return {"type": "OSError", "errno": errno.ENOSPC, "filename": str(checkpoint),
            "message": f"[Errno 28] {strerror}: '{checkpoint}'"}


def assert_only_the_checkpoint_before_stays(out_dir: Path) -> None:
    assert sorted(p.name for p in out_dir.iterdir()) == ["step-00000002"]
    assert verify_checkpoint(out_dir / "step-00000002").ok
    assert select_resume_dir(L.Fabric(accelerator="cpu", devices=1), "auto", out_dir) == out_dir / "step-00000002"


@pytest.mark.slow
def test_a_disk_that_fills_up_during_a_sharded_save_keeps_the_checkpoint_before(tmp_path):
    """Both ranks' disks fill up in the middle of the shards of the step-4 checkpoint, where torch.save's zip writer turns
    the OSError into a RuntimeError that torch.distributed.checkpoint gathers into a CheckpointException on every rank
    (not even an Exception: a traceback from each). Every rank raises the file system's error instead."""
    from fabric_lin.cli import expected_failure

    unfinished = tmp_path / "out" / ".tmp-step-00000004"
    for raised in saves_on_a_failing_disk(tmp_path, filling=[0, 1], fsync_refused=[]):
        assert raised == [no_space(unfinished)]
    assert expected_failure(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(unfinished)))
    assert_only_the_checkpoint_before_stays(tmp_path / "out")


@pytest.mark.slow
def test_a_full_disk_of_rank_1_alone_is_what_every_rank_raises(tmp_path):
    """Rank 1's disk alone fills up during its shards (rank 0 raised torch's CheckpointException, a traceback), then a
    file system refuses rank 1's fsync alone while the manifest's checksums are taken (rank 0 waited for it in the next
    collective and, once rank 1 had ended, reported a lost peer). Rank 0 raises rank 1's full disk, naming rank 1: the
    line the CLI prints."""
    rank_0, rank_1 = saves_on_a_failing_disk(tmp_path, filling=[1], fsync_refused=[1])
    unfinished = [tmp_path / "out" / f".tmp-step-0000000{step}" for step in (4, 6)]
    assert rank_0 == [no_space(checkpoint, on_rank=1) for checkpoint in unfinished]
    assert rank_1 == [no_space(checkpoint) for checkpoint in unfinished]
    assert_only_the_checkpoint_before_stays(tmp_path / "out")


def _a_ctrl_c_during_the_shards(rank: int, out_dir: Path, port: int, interrupted: int) -> None:
    """One rank of `sharded_run`: a complete checkpoint at step 2, then one at step 4 during whose shards a second
    Ctrl-C reaches rank `interrupted`. What the second save raised is left in out_dir/../rank-<rank>.pt."""
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    fabric, state, checkpointer = sharded_run(rank, out_dir, port)
    state["step_count"] = 2
    checkpointer.save(fabric, state)

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    if rank == interrupted:
        dcp_filesystem._write_item = ctrl_c
    state["step_count"] = 4
    try:
        checkpointer.save(fabric, state)
        raised = None
    except BaseException as error:  # what the save raised is the result
        raised = what_was_raised(error)
    torch.save(raised, out_dir.parent / f"rank-{rank}.pt")


@pytest.mark.slow
def test_a_ctrl_c_during_the_shards_of_a_sharded_save_is_a_ctrl_c_on_every_rank(tmp_path):
    """torch.distributed.checkpoint catches a KeyboardInterrupt in its write as any failure, into the CheckpointException
    it gives every rank: the CLI printed its traceback, not `interrupted`. Every rank raises the KeyboardInterrupt, and
    the checkpoint before stays."""
    for raised in run_two_ranks(tmp_path, _a_ctrl_c_during_the_shards, 1):
        assert raised == {"type": "KeyboardInterrupt", "errno": None, "filename": None, "message": ""}
    assert_only_the_checkpoint_before_stays(tmp_path / "out")
