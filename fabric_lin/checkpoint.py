"""The training-checkpoint format: the one module that writes, finds and reads it.

A run's out_dir holds:

    step-XXXXXXXX/    a checkpoint at optimizer step XXXXXXXX (every train.save_interval steps, and at a stop)
    final/            the checkpoint at the end of the run
    .tmp-*/           a checkpoint being written, or left by a killed run: never read
    .damaged-*/       a checkpoint that failed verification; .superseded-*/: one saved after the earlier checkpoint
                      that a resume went back to. Both set aside, never read by --resume auto

A checkpoint directory holds:

    lit_model.pth         Fabric's save of the train state (`train_state`): model, optimizer, the
                          training data's position (`fabric_lin.data.sample_order`), counters and RNG
                          states. One file on one device or DDP; under FSDP a torch.distributed.checkpoint (DCP) directory:
                          `.metadata`, one `__<rank>_0.distcp` per process and Fabric's `meta.pt`
    step.json             {"step_count": N}: which checkpoint is newest, without loading one
    hyperparameters.yaml  the run's arguments, usable with `fabric-lin pretrain --config`
    model_config.yaml     the model's `Config`
    tokenizer files       `fabric_lin.data.tokenizer.TOKENIZER_FILES`, when the run has a tokenizer
    trained_with.json     the tokenizer that prepared the training data (`fabric_lin.data.tokenizer.TRAINED_WITH_FILE`),
                          which the tokenizer files must be, when the run knows it; and the training data (its
                          directories, their index.json digest), which evaluate compares its data with
    manifest.json         size and CRC-32 of every other file (under FSDP, each file of lit_model.pth/),
                          written last

Each is written under `.tmp-<name>/`, fsynced, and renamed last, so a `step-*` or `final` directory
is complete when it was written; the manifest tells whether its bytes are still those that were
written (`verify_checkpoint`). `--resume` verifies before loading: a damaged directory is renamed to
`.damaged-<name>` (never deleted) and the newest verified checkpoint is used. A model directory
(`fabric_lin.convert.model_dir`) uses the same names for its weights and config.
"""
import json
import os
import random
import re
import shutil
import signal
import threading
import zlib
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import numpy as np
import torch
import yaml

from fabric_lin.config import CONFIG_FILE
from fabric_lin.errors import InvalidValue, MissingFile, UserError
from fabric_lin.files import MANIFEST_FILE, STEP_FILE, is_training_checkpoint, write_error
from fabric_lin.model_bytes import ShardRanges, model_part_problems, shard_ranges_once, with_model_checksum
from fabric_lin.save_failures import all_gather_objects, failure_shared
from fabric_lin.weights import MODEL_FILE, meta_model

HPARAMS_FILE = "hyperparameters.yaml"
FINAL_DIR = "final"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"
SUPERSEDED_PREFIX = ".superseded-"
MANIFEST_FORMAT = 1
READ_BLOCK = 16 << 20  # bytes read at a time while checksumming: a 90 GB checkpoint is never held in memory
STEP_DIR_PATTERN = re.compile(r"^step-(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def train_state(model, optimizer, train_dataloader) -> Dict[str, Any]:
    """What a checkpoint holds, as `fabric.save` and `fabric.load` take it: the objects, whose state is
    saved and restored in place, and the counters."""
    return {
        "model": model,
        "optimizer": optimizer,
        "train_dataloader": train_dataloader,
        "iter_num": 0,  # micro-batches taken
        "step_count": 0,  # optimizer steps taken
        "tokens_seen": 0,  # tokens trained on, over all processes (steps of different sizes after a resume that changed them)
        "schedule_tokens_per_step": 0,  # tokens per step of the run's first attempt: the learning rate schedule's unit
        "skipped_steps": 0,  # steps whose update was skipped (non-finite loss or gradient norm)
        "rng_states": {},
    }


# ---------------------------------------------------------------- writing


class Checkpointer:
    """Writes one run's checkpoints into `out_dir`: the train state, and beside it what makes the
    directory self-contained (step.json, hyperparameters.yaml, model_config.yaml, the tokenizer and
    `trained_with`, the record of the tokenizer that prepared the training data)."""

    def __init__(self, out_dir: Path, hparams: Dict[str, Any], config, tokenizer_dir: Optional[Path] = None,
                 keep_last_n: Optional[int] = None, trained_with: Optional[Dict[str, Any]] = None):
        from fabric_lin.data.tokenizer import read_tokenizer_files

        self.out_dir = Path(out_dir)
        self.hparams = hparams
        self.config = config
        # read once, before the first step: each checkpoint holds the tokenizer the run started with, also where its
        # directory is moved, deleted or written over while the run trains (a save would fail, losing the steps since
        # the last one, or copy another tokenizer than its trained_with.json records)
        self.tokenizer_files = read_tokenizer_files(tokenizer_dir) if tokenizer_dir is not None else None
        self.keep_last_n = keep_last_n
        self.trained_with = trained_with

    def save(self, fabric, state: Dict[str, Any], final: bool = False) -> Path:
        """Write out_dir/step-<step_count>/ (or out_dir/final/) atomically: everything goes into a
        `.tmp-` directory, the manifest last, renamed at the end; then prune to `keep_last_n` step
        directories. Every rank calls it. Interrupted (a second Ctrl-C, an error), it removes its
        `.tmp-` directory and leaves the checkpoints that were there."""
        name = FINAL_DIR if final else step_dir_name(state["step_count"])
        final_dir = self.out_dir / name
        tmp_dir = self.out_dir / f"{TMP_PREFIX}{name}"
        # each part ends with an exchange of its failures, a barrier: a rank that fails alone must not leave the
        # others waiting for it in the next collective (fabric_lin.save_failures)
        with failure_shared(fabric, tmp_dir):
            if fabric.global_rank == 0:
                if tmp_dir.exists():  # left by a run killed while saving
                    shutil.rmtree(tmp_dir)
                tmp_dir.mkdir(parents=True)
        try:
            state["rng_states"] = get_rng_states()
            with failure_shared(fabric, tmp_dir):
                # fabric.save without its closing barrier, which a rank failing in its part would skip: every rank
                # writes its shards under FSDP, rank 0 the one file otherwise
                from lightning_fabric.wrappers import _unwrap_objects

                fabric.strategy.save_checkpoint(path=tmp_dir / MODEL_FILE, state=_unwrap_objects(state))
            with failure_shared(fabric, tmp_dir):  # all files written before any is checksummed
                if fabric.global_rank == 0:
                    self.write_beside_the_weights(tmp_dir, state["step_count"])
            write_manifest(fabric, tmp_dir)
        except BaseException:
            # every rank has asked the file system what it said (failure_shared): removing the directory frees what
            # it held, and a full disk would take a write again
            if fabric.global_rank == 0:
                shutil.rmtree(tmp_dir, ignore_errors=True)
            raise
        with failure_shared(fabric, tmp_dir):
            if fabric.global_rank == 0:
                self.put_in_place(fabric, tmp_dir, final_dir, state["step_count"], final)
        return final_dir

    def put_in_place(self, fabric, tmp_dir: Path, final_dir: Path, step_count: int, final: bool) -> None:
        """Rename the complete `tmp_dir` to `final_dir` (rank 0), replacing a checkpoint of that name; prune."""
        # a signal between the two renames would leave neither the old nor the new directory in place
        with signals_deferred(signal.SIGINT, signal.SIGTERM):
            earlier_end = final_checkpoint_step(self.out_dir) if final else None
            kept_as = self.out_dir / step_dir_name(earlier_end) if earlier_end is not None else None
            if kept_as is not None and earlier_end < step_count and not kept_as.exists():
                # a finished run continued to a later end: its end stays, as the checkpoint of that step
                os.replace(final_dir, kept_as)
                keep_evaluation_as(final_dir, kept_as)
                fabric.print(f"Kept the earlier end of the run, {final_dir} at step {earlier_end}, as {kept_as}")
            # evaluate's results of the checkpoint this one replaces would be taken for this one's
            remove_evaluation_results(training_checkpoint_evaluation_dir(final_dir))
            if final_dir.exists():  # e.g. a resumed run passing a step it had saved before
                old = self.out_dir / f"{TMP_PREFIX}old-{final_dir.name}"
                if old.exists():
                    shutil.rmtree(old)
                os.replace(final_dir, old)
                os.replace(tmp_dir, final_dir)
                shutil.rmtree(old)
            else:
                os.replace(tmp_dir, final_dir)
            _fsync_dir(self.out_dir)
        if not final and self.keep_last_n is not None:
            prune_checkpoints(self.out_dir, self.keep_last_n)
        fabric.print(f"Saved checkpoint {final_dir}")

    def write_beside_the_weights(self, directory: Path, step_count: int) -> None:
        """step.json, hyperparameters.yaml, model_config.yaml, the tokenizer's files and `trained_with` (rank 0)."""
        from fabric_lin.data.tokenizer import write_tokenizer_files, write_trained_with

        (directory / STEP_FILE).write_text(json.dumps({"step_count": step_count}) + "\n")
        save_hparams(self.hparams, directory / HPARAMS_FILE)
        self.config.save(directory / CONFIG_FILE)
        if self.tokenizer_files is not None:
            write_tokenizer_files(self.tokenizer_files, directory)
        if self.trained_with is not None:
            write_trained_with(directory, self.trained_with)

    def final_step(self) -> Optional[float]:
        return final_checkpoint_step(self.out_dir)


def keep_evaluation_as(checkpoint_dir: Path, kept_as: Path) -> None:
    """Move evaluate's results of `checkpoint_dir` to those of `kept_as`, the same weights under another name, where
    `kept_as` has none of its own."""
    evaluation, kept_evaluation = map(training_checkpoint_evaluation_dir, (checkpoint_dir, kept_as))
    if evaluation.is_dir() and not kept_evaluation.exists():
        os.replace(evaluation, kept_evaluation)


class signals_deferred:
    """Run the block without Python's handlers of these signals: one that arrives meanwhile goes to its
    handler when the block ends; where its action was the default one (to end the process), it ends the block as a
    KeyboardInterrupt, as a Ctrl-C to Python's own handler does (naming the signal but for SIGINT), so that what
    called the block says how it ended: sent again to the process, it would kill it without a word, after a block
    that finished its work. (Blocking the signal with pthread_sigmask would not do: the kernel hands it to another
    thread, and Python runs the handler on the main thread all the same.) Elsewhere than on the main thread, where no
    handler runs, it does nothing."""

    def __init__(self, *signals):
        self.signals = signals

    def __enter__(self):
        self.arrived: List[int] = []
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self.previous[signum] = signal.signal(signum, lambda signum, frame: self.arrived.append(signum))

    def __exit__(self, *exc):
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        for signum in self.arrived:
            handler = self.previous[signum]
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                raise KeyboardInterrupt() if signum == signal.SIGINT else KeyboardInterrupt(signal.Signals(signum).name)


# ---------------------------------------------------------------- the manifest


def file_checksum(path: Path, fsync: bool = False) -> Dict[str, Any]:
    """{"size": bytes, "crc32": 8 hex digits} of a file, read in blocks of READ_BLOCK bytes (zlib's CRC-32
    runs at several GB/s: a few seconds per rank for a sharded 7B checkpoint). `fsync`: also flush the
    file to disk while it is open."""
    crc, size = 0, 0
    block = bytearray(READ_BLOCK)
    view = memoryview(block)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(block)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
            size += n
        if fsync:
            os.fsync(f.fileno())
    return {"size": size, "crc32": f"{crc:08x}"}


def checkpoint_files(directory: Path) -> List[str]:
    """The files under `directory` but the manifest, as sorted relative POSIX paths."""
    directory = Path(directory)
    names = []
    for dirpath, _, filenames in os.walk(directory):
        for filename in filenames:
            name = (Path(dirpath) / filename).relative_to(directory).as_posix()
            if name != MANIFEST_FILE:
                names.append(name)
    return sorted(names)


_SHARD_FILE = re.compile(r"__(\d+)_\d+\.distcp$")


def share(names: List[str], rank: int, world: int) -> List[str]:
    """The files of `names` that `rank` checksums: a DCP shard `__<r>_<n>.distcp` goes to rank r, which
    wrote it (on its node, still in the page cache), the other files in turn to every rank."""
    mine = []
    for i, name in enumerate(names):
        shard = _SHARD_FILE.search(name)
        if (int(shard.group(1)) if shard else i) % world == rank:
            mine.append(name)
    return mine


def write_manifest(fabric, directory: Path) -> Dict[str, Any]:
    """Write `directory`/manifest.json: size and CRC-32 of every other file, under FSDP each shard of
    lit_model.pth/ too, with that of its bytes of the model (`fabric_lin.model_bytes`). Every rank calls it: the
    files are shared out (`share`), so that each rank reads (and fsyncs) about 1/world_size of a sharded checkpoint;
    rank 0 writes the manifest, atomically."""
    directory = Path(directory)
    rank, world = fabric.global_rank, fabric.world_size
    files = fabric.broadcast(checkpoint_files(directory) if rank == 0 else None, src=0)
    shard_ranges = shard_ranges_once(directory)
    with failure_shared(fabric, directory):  # an fsync may be where a file system reports a full disk
        mine = {name: with_model_checksum(directory, name, file_checksum(directory / name, fsync=True), shard_ranges)
                for name in share(files, rank, world)}
    entries: Dict[str, Any] = {}
    for part in all_gather_objects(fabric, mine):
        entries.update(part)
    manifest = {"format": MANIFEST_FORMAT, "checksum": "crc32", "files": {name: entries[name] for name in files}}
    with failure_shared(fabric, directory):
        if rank == 0:
            tmp = directory / f"{MANIFEST_FILE}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / MANIFEST_FILE)
            for dirpath, _, _ in os.walk(directory):
                _fsync_dir(Path(dirpath))
    return manifest


@dataclass
class Verification:
    """What `verify_checkpoint` found in one checkpoint directory."""

    directory: Path
    problems: List[str] = field(default_factory=list)
    """What is wrong, one entry per file; empty: the checkpoint may be loaded"""

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        shown = self.problems[:4]
        more = len(self.problems) - len(shown)
        return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def verify_checkpoint(directory: Path, fabric=None, model_only: bool = False) -> Verification:
    """Check a checkpoint directory against its manifest: every file listed is there, of its size and
    CRC-32. With `fabric`, every rank calls it and checks a share of the files; all get the whole result.
    `model_only`: of lit_model.pth, the bytes of the model alone, where they can be told apart (`fabric_lin.model_bytes`):
    for a command that reads nothing else, not the optimizer's state, twice as large."""
    directory = Path(directory)
    rank, world = (fabric.global_rank, fabric.world_size) if fabric is not None else (0, 1)
    problems = _verify_share(directory, rank, world, model_only)
    if fabric is not None and world > 1:
        problems = sorted({p for part in all_gather_objects(fabric, problems) for p in part})
    return Verification(directory, problems)


def _verify_share(directory: Path, rank: int, world: int, model_only: bool = False) -> List[str]:
    shard_ranges = shard_ranges_once(directory) if model_only else None
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.is_file():
        return [f"{MANIFEST_FILE} is missing (it is written last: the checkpoint was never completed, or lost it since)"]
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("crc32"), str) for e in files.values()
        ):
            raise InvalidValue('"files" is not a mapping of file name -> {"size", "crc32"}')
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{MANIFEST_FILE} is unreadable ({type(e).__name__}: {e})"]
    problems = []
    if not any(name == MODEL_FILE or name.startswith(MODEL_FILE + "/") for name in files):
        problems.append(f"{MANIFEST_FILE} lists no {MODEL_FILE}")
    for name in share(sorted(files), rank, world):
        problems += _file_problems(directory, name, files[name], shard_ranges)
    return problems


def _file_problems(directory: Path, name: str, expected: Dict[str, Any],
                   shard_ranges: Optional[ShardRanges] = None) -> List[str]:
    """What is wrong with the file `name` against its manifest entry `expected`; with `shard_ranges`
    (`verify_checkpoint`'s model_only), of lit_model.pth only the model's part where it can be told apart."""
    parts = Path(name).parts
    if Path(name).is_absolute() or ".." in parts or not parts:
        return [f"{MANIFEST_FILE} lists {name!r}, which is not a path inside the checkpoint"]
    path = directory / name
    if not path.is_file():
        return [f"{name} is missing"]
    size = path.stat().st_size
    if size != expected["size"]:
        how = "truncated" if size < expected["size"] else "grown"
        return [f"{name} has {size:,} bytes, {expected['size']:,} when it was written ({how})"]
    model_part = model_part_problems(directory, name, expected, shard_ranges) if shard_ranges is not None else None
    if model_part is not None:
        return model_part
    got = file_checksum(path)
    if got["size"] != expected["size"]:
        return [f"{name} changed size while it was read"]
    if got["crc32"] != expected["crc32"]:
        return [f"{name}'s bytes changed since it was written (CRC-32 {got['crc32']}, {expected['crc32']} in {MANIFEST_FILE})"]
    return []


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def set_aside(directory: Path, prefix: str = DAMAGED_PREFIX) -> Path:
    """Rename a checkpoint directory to `<prefix><name>` (`-2`, `-3`, ... if taken; a damaged one `.damaged-<name>`): out
    of the way of --resume and pruning, kept for inspection."""
    directory = Path(directory)
    target = directory.with_name(f"{prefix}{directory.name}")
    n = 2
    while target.exists():
        target = directory.with_name(f"{prefix}{directory.name}-{n}")
        n += 1
    os.replace(directory, target)
    return target



def load_train_state(fabric, checkpoint_dir: Path, state: Dict[str, Any]) -> None:
    """Restore `state` (see `train_state`) in place from a checkpoint directory, RNG states included. A sharded
    checkpoint resumes on any mesh, or in a run that does not shard; a one-file one in a sharded run too."""
    from lightning_fabric.strategies import ModelParallelStrategy

    from torch.distributed.checkpoint.api import CheckpointException

    from fabric_lin.sharded_checkpoint import (
        load_one_file_train_state,
        load_sharded_train_state,
        read_checked_metadata,
        read_failure,
        restore_the_rest,
    )

    fabric.print(f"Resuming from {checkpoint_dir}")
    # loading the optimizer puts the checkpoint's param_groups in place of its own settings: a resume may change
    # optimizer.* (weight decay, betas, eps), so this run's are put back; the learning rate, set at every step, stays
    # the checkpoint's until then (a resume with nothing left to train saves the state it loaded)
    own_settings = [{k: v for k, v in group.items() if k not in ("params", "lr")}
                    for group in state["optimizer"].param_groups]
    weights_path = Path(checkpoint_dir) / MODEL_FILE
    sharded_run = isinstance(fabric.strategy, ModelParallelStrategy)
    try:
        if weights_path.is_dir() and sharded_run:
            # on this run's mesh, whatever the mesh that wrote it (torch.distributed.checkpoint reshards). Fabric's
            # sharded load puts the saved state dicts of the other objects in their place instead of handing them
            # their state (the data loader would start over): it restores the model and the optimizer, and returns
            # the rest, restored here
            read_checked_metadata(weights_path, fabric_meta=True)
            try:
                restore_the_rest(state, fabric.load(weights_path, {"model": state["model"], "optimizer": state["optimizer"]}))
            except CheckpointException as error:  # every rank's, a BaseException whose message is a traceback
                raise read_failure(weights_path, error) from error
        elif weights_path.is_dir():
            fabric.print(f"{weights_path} is sharded and this run is not: its tensors are reassembled whole")
            load_sharded_train_state(weights_path, state)
        elif sharded_run:
            fabric.print(f"{weights_path} is one file and this run is sharded: each process keeps its shards of it")
            load_one_file_train_state(weights_path, state)
        else:
            fabric.load(weights_path, state)
    except KeyError as e:  # a model directory's lit_model.pth holds the weights alone
        raise InvalidValue(
            f"--resume {checkpoint_dir}: {MODEL_FILE} there is not a training checkpoint ({e}); to start "
            f"from a model directory's weights, use --initial_checkpoint_dir {checkpoint_dir}"
        ) from None
    for group, own in zip(state["optimizer"].param_groups, own_settings):
        group.update(own)
    set_rng_states(state["rng_states"])


def save_hparams(hparams: Dict[str, Any], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_plain(hparams), f, sort_keys=False)


def to_plain(value: Any) -> Any:
    """Arguments as YAML data that `--config` reads back: dataclasses as mappings, a data module as
    jsonargparse's class_path/init_args, paths as absolute paths (the file is read from other directories)."""
    from fabric_lin.data import DataModule

    if isinstance(value, DataModule) and is_dataclass(value):
        cls = type(value)
        init_args = {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, Path):
        return os.path.abspath(value)
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_out_dir(out_dir: Path, config) -> None:
    """Before any work: out_dir is writable and has room for one checkpoint of `config`'s model."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"out_dir {out_dir} is not writable: {e}") from e
    refused = write_error(out_dir, probe_bytes=4096)
    if refused is not None:
        raise UserError(f"out_dir {out_dir} is not writable: {refused}") from refused
    needed = checkpoint_bytes(config)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise UserError(
            f"out_dir {out_dir} has {free / 1e9:.2f} GB free, but one checkpoint of {config.name or 'this model'} "
            f"takes {needed / 1e9:.2f} GB (fp32 weights and optimizer state): free space or choose another out_dir"
        )


def checkpoint_bytes(config) -> int:
    """Size of one training checkpoint: fp32 weights and AdamW's two fp32 moments."""
    return 12 * sum(p.numel() for p in meta_model(config).parameters())


# ---------------------------------------------------------------- finding


def step_checkpoints(out_dir: Path) -> List[Path]:
    """Complete step-* checkpoints, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir() if STEP_DIR_PATTERN.match(p.name) and (p / MODEL_FILE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR_PATTERN.match(p.name).group(1)))


def checkpoint_dirs(out_dir: Path) -> List[Path]:
    """Every step-* directory and final/ in out_dir, newest first: by step, final/ first on a tie (its
    validation is done). Damaged ones included: a final/ whose step.json cannot be read comes first, so that
    verifying it sets it aside."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for path in out_dir.iterdir():
        match = STEP_DIR_PATTERN.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), 0, path))
    final = out_dir / FINAL_DIR
    if final.is_dir():
        step = checkpoint_step(final)
        found.append((step if step is not None else float("inf"), 1, final))
    return [path for *_, path in sorted(found, reverse=True)]


def explicit_resume_dir(resume: Union[str, Path], out_dir: Optional[Path] = None) -> Path:
    """The directory `--resume <path>` names (the path of its lit_model.pth is taken too). `out_dir`: the run's, whose
    checkpoint a path that is not there may have meant by its name (`--resume final`)."""
    path = Path(resume)
    if path.name == MODEL_FILE:
        path = path.parent
    if path.name.startswith(TMP_PREFIX):
        raise InvalidValue(f"--resume {resume}: an unfinished checkpoint (a `{TMP_PREFIX}` directory is renamed when complete)")
    if not ((path / MODEL_FILE).exists() or (path / MANIFEST_FILE).is_file()):
        held = [p.name for p in checkpoint_dirs(path)]
        if held:
            raise InvalidValue(
                f"--resume {resume} is a run's out_dir, not one of its checkpoints ({', '.join(held[:3])}): to continue from "
                f"its newest, give --out_dir {path} --resume auto; or name one, e.g. --resume {path / held[0]}"
            )
        raise not_a_checkpoint_to_resume(resume, path, out_dir)
    if not is_training_checkpoint(path):
        raise InvalidValue(
            f"--resume {resume}: it is not a training checkpoint (it has no {STEP_FILE} or {MANIFEST_FILE}); to start "
            f"from a model directory's weights, use --initial_checkpoint_dir {path}"
        )
    return path


def not_a_checkpoint_to_resume(resume: Union[str, Path], path: Path, out_dir: Optional[Path] = None) -> MissingFile:
    """The error for a --resume path that holds no checkpoint: one that is not there names the checkpoint of `out_dir`
    it names relative to it (`final`: a path is relative to the current directory), else the checkpoints of the run
    directory it points into (a mistyped step); one that is there says what it holds (an export, adapters, ...) and
    what takes a model's weights."""
    in_out_dir = Path(out_dir) / path if out_dir is not None and not path.is_absolute() else None
    if not path.exists() and in_out_dir is not None and (in_out_dir / MODEL_FILE).exists():
        return MissingFile(f"--resume {resume} does not exist (a path is relative to the current directory): did you "
                           f"mean --resume {in_out_dir}, out_dir's checkpoint, or --resume auto for its newest?")
    if not path.exists():
        beside = [p.name for p in checkpoint_dirs(path.parent)]
        return MissingFile(f"--resume {resume} does not exist: expected a training checkpoint (a run's "
                           f"step-XXXXXXXX/ or {FINAL_DIR}/)"
                           + (f"; {path.parent} holds {', '.join(beside[:4])}" if beside else "")
                           # a word that is no path may have been meant for one of the words --resume takes
                           + (", or false, true or auto" if len(Path(resume).parts) == 1 else ""))
    held = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    holds = ("it is a file" if not path.is_dir() else "it is empty" if not held
             else f"it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''}")
    return MissingFile(f"--resume {resume} is not a training checkpoint: it has no {MODEL_FILE} ({holds}); --resume "
                       f"continues a run from its step-XXXXXXXX/ or {FINAL_DIR}/, and a new run starts from a model "
                       f"directory's weights with --initial_checkpoint_dir")


def select_resume_dir(fabric, resume: Union[bool, str, Path, None], out_dir: Path) -> Optional[Path]:
    """The verified checkpoint to resume from, or None for a fresh start. Every rank calls it.

    `--resume <dir>`: that directory, refused with what is wrong if it fails verification. auto/true: the
    newest checkpoint in out_dir that passes; each newer one that fails is reported, set aside as
    `.damaged-<name>` (by rank 0) and the next one tried."""
    out_dir = Path(out_dir)
    if resume is False or resume is None:
        return None
    if not (resume is True or resume == "auto"):
        path = explicit_resume_dir(resume, out_dir)
        check = verify_checkpoint(path, fabric)
        if not check.ok:
            raise InvalidValue(
                f"--resume {resume}: the checkpoint is damaged: {check.describe()}. It is not loaded: pass an older "
                f"checkpoint directory, or --resume auto for the newest verified one in out_dir"
            )
        return path
    damaged: List[Path] = []
    for candidate in checkpoint_dirs(out_dir):
        check = verify_checkpoint(candidate, fabric)
        if check.ok:
            if damaged:
                fabric.print(f"Warning: resuming from {candidate}, the newest checkpoint that verifies")
            return candidate
        moved = fabric.broadcast(set_aside(candidate) if fabric.global_rank == 0 else None, src=0)
        fabric.print(f"Warning: checkpoint {candidate} is damaged: {check.describe()}. Set aside as {moved}")
        damaged.append(moved)
    set_aside_earlier = damaged_checkpoints(out_dir)
    if set_aside_earlier:
        # starting from step 0 here would put a second run's steps and metrics into the first one's out_dir
        raise InvalidValue(
            f"--resume {resume}: no checkpoint in {out_dir} verifies; the damaged ones are set aside as "
            f"{', '.join(set_aside_earlier)}. Resume from a good copy of one with --resume <dir>, start again in a new "
            f"--out_dir, or start again from step 0 in this one with --resume false --overwrite true (deletes them)"
        )
    if resume == "auto":
        return None
    raise MissingFile(f"--resume true: no checkpoint (step-XXXXXXXX/ or {FINAL_DIR}/) in {out_dir}")


def damaged_checkpoints(out_dir: Path) -> List[str]:
    """Names of the checkpoints of out_dir that a resume set aside as damaged (`.damaged-*`)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    return sorted(p.name for p in out_dir.iterdir() if p.is_dir() and p.name.startswith(DAMAGED_PREFIX))


def earlier_run_checkpoints(out_dir: Path) -> List[str]:
    """Names of the step-* directories and final/ that a run wrote into out_dir, and of those set aside (damaged, or
    superseded by a resume from an earlier checkpoint)."""
    out_dir = Path(out_dir)
    superseded = sorted(p.name for p in out_dir.iterdir() if p.is_dir() and p.name.startswith(SUPERSEDED_PREFIX)) \
        if out_dir.is_dir() else []
    return sorted(p.name for p in checkpoint_dirs(out_dir)) + damaged_checkpoints(out_dir) + superseded


def set_aside_later_checkpoints(out_dir: Path, resume_dir: Path) -> List[Path]:
    """A resume from a checkpoint of out_dir older than others there (back before a loss spike, say) trains their steps
    again: they are renamed `.superseded-<name>`, so that the next --resume auto takes this attempt's newest, not the
    replaced attempt's (as metrics.jsonl moves the replaced steps' records to metrics.superseded.jsonl). Kept, not
    deleted; --overwrite true deletes them. Returns their new paths."""
    out_dir = Path(out_dir)
    step = checkpoint_step(resume_dir)
    if step is None or Path(resume_dir).resolve().parent != out_dir.resolve():
        return []
    later = [p for p in checkpoint_dirs(out_dir) if (checkpoint_step(p) or 0) > step]
    return [set_aside(p, SUPERSEDED_PREFIX) for p in later]


def delete_checkpoints(out_dir: Path) -> List[str]:
    """Delete out_dir's step-* directories, final/, set-aside `.damaged-*` and `.superseded-*`, and leftover `.tmp-*`
    directories.
    Each is renamed to a `.tmp-` name first, so a kill during the deletion leaves nothing that looks complete."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    doomed = [p for p in out_dir.iterdir() if p.is_dir() and (
        STEP_DIR_PATTERN.match(p.name) or p.name == FINAL_DIR or p.name.startswith((DAMAGED_PREFIX, SUPERSEDED_PREFIX, TMP_PREFIX))
    )]
    for path in sorted(doomed):
        trash = path if path.name.startswith(TMP_PREFIX) else out_dir / f"{TMP_PREFIX}deleted-{path.name}"
        if trash != path:
            os.replace(path, trash)
        shutil.rmtree(trash)
    return sorted(p.name for p in doomed) + delete_checkpoint_evaluations(out_dir)


# evaluate's results, written by default into the model directory or export it evaluates (their evaluate/), and
# beside a training checkpoint (out_dir/evaluate/step-XXXXXXXX/ or out_dir/evaluate/final/)
EVALUATION_DIR = "evaluate"
RESULTS_FILE = "evaluate.json"
PLOT_FILE = "loss_by_position.png"


def training_checkpoint_evaluation_dir(checkpoint_dir: Path) -> Path:
    """Where evaluate writes its results of a training checkpoint by default: beside it, never inside it (its files are
    the ones its manifest lists)."""
    return Path(checkpoint_dir).parent / EVALUATION_DIR / Path(checkpoint_dir).name


def remove_evaluation_results(directory: Path) -> List[str]:
    """Delete evaluate's results (and plot) in `directory`, and the directory where nothing else is left in it: the
    results of weights that are replaced, which name the directory and would be taken for the new weights'. Returns
    the names of the files deleted."""
    directory = Path(directory)
    removed = []
    for name in (RESULTS_FILE, PLOT_FILE):
        if (directory / name).is_file():
            (directory / name).unlink()
            removed.append(name)
    if directory.is_dir() and not any(directory.iterdir()):
        directory.rmdir()
    return removed


def delete_checkpoint_evaluations(out_dir: Path) -> List[str]:
    """Delete evaluate's results of out_dir's checkpoints (out_dir/evaluate/step-*/ and final/), which the run that
    replaces them would otherwise seem to have; other files there stay. Returns what was deleted, as evaluate/<name>."""
    evaluations = Path(out_dir) / EVALUATION_DIR
    if not evaluations.is_dir():
        return []
    deleted = [f"{EVALUATION_DIR}/{path.name}" for path in sorted(evaluations.iterdir())
               if path.is_dir() and (STEP_DIR_PATTERN.match(path.name) or path.name == FINAL_DIR)
               and remove_evaluation_results(path)]
    if not any(evaluations.iterdir()):
        evaluations.rmdir()
    return deleted


def checkpoint_step(directory: Path) -> Optional[int]:
    """The optimizer step of a checkpoint directory, from its step.json; None where it cannot be read."""
    step = _read_json(Path(directory) / STEP_FILE)
    step = step.get("step_count") if isinstance(step, dict) else None
    return step if isinstance(step, int) else None


def final_checkpoint_step(out_dir: Path) -> Optional[int]:
    """The step of out_dir/final/, or None where there is none (or its step.json cannot be read)."""
    return checkpoint_step(Path(out_dir) / FINAL_DIR)


def prune_checkpoints(out_dir: Path, keep_last_n: int) -> None:
    """Delete all but the newest `keep_last_n` complete step-* checkpoints (called after a save completes)."""
    for old in step_checkpoints(out_dir)[:-keep_last_n]:
        # rename first, so a kill during the deletion leaves a .tmp- directory, never a partial step-*
        doomed = Path(out_dir) / f"{TMP_PREFIX}deleted-{old.name}"
        os.replace(old, doomed)
        shutil.rmtree(doomed)


# ---------------------------------------------------------------- RNG states


def get_rng_states() -> Dict[str, Any]:
    """Python, NumPy and torch generator states, as tensors and plain values (loadable with weights_only)."""
    np_state = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Dict[str, Any]) -> None:
    if not states:
        return
    random.setstate(tuple(states["python"]) if not isinstance(states["python"], tuple) else states["python"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
