"""The bytes of a training checkpoint's lit_model.pth that hold the model, apart from the optimizer's state (twice the
model's bytes in fp32) and the rest of the train state: all that the commands reading the model alone (evaluate,
generate, convert_pretrained_checkpoint) check against the checkpoint's manifest, so that they read a third of it.
A resume checks everything (`fabric_lin.checkpoint.verify_checkpoint`).

One file (`fabric.save` on one device or under DDP) is torch.save's zip archive: data.pkl, the structure, and a record
per storage, each with the CRC-32 of its bytes in the archive's directory. The model's part is data.pkl and the records
of the tensors under its `model` entry (`model_records`: data.pkl read with every storage left on the meta device).

A sharded one (FSDP2) is a torch.distributed.checkpoint directory: the model's tensors lie in byte ranges of the shard
files that its .metadata places (`model_ranges`). pretrain's manifest records, beside each shard file's CRC-32, that of
the bytes of those ranges in the order of the file (`model_crc32`); a checkpoint whose manifest has none is checked
whole.
"""
import functools
import io
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fabric_lin.errors import UserError
from fabric_lin.weights import MODEL_FILE

READ_BLOCK = 16 << 20  # bytes read at a time: a tensor of gigabytes is never held in memory for its checksum
MODEL_ENTRY = "model"  # the entry of the train state that holds the model's tensors (`fabric_lin.checkpoint.train_state`)
ShardRanges = Callable[[], Dict[str, List[Tuple[int, int]]]]


def shard_ranges_once(directory: Path) -> ShardRanges:
    """`model_ranges` of the checkpoint `directory`'s sharded lit_model.pth, read on the first call and kept for the
    next: one read of its .metadata for all of its shard files (a .metadata that does not read is tried again)."""
    return functools.cache(functools.partial(model_ranges, Path(directory) / MODEL_FILE))


def model_part_problems(directory: Path, name: str, expected: Dict[str, Any],
                        shard_ranges: ShardRanges) -> Optional[List[str]]:
    """What is wrong with the model's part of the file `name` of the checkpoint `directory` (its manifest entry
    `expected`, whose size it has; `shard_ranges` from `shard_ranges_once(directory)`): [] where it is whole; None where
    that part cannot be told apart (a file other than the weights, or a shard of a manifest without `model_crc32`),
    and the file is to be checked whole."""
    path = Path(directory) / name
    if name == MODEL_FILE:
        return single_file_problems(path)
    shards = Path(directory) / MODEL_FILE
    if "model_crc32" not in expected or path.parent != shards or not name.endswith(".distcp"):
        return None
    try:
        ranges = shard_ranges().get(path.name, [])
    except UserError as error:  # a .metadata damaged since: its own entry names it too
        return [f"{name}: the model's part cannot be found: {error}"]
    got = ranges_crc32(path, ranges)
    if got != expected["model_crc32"]:
        return [f"{name}'s bytes of the model changed since it was written (CRC-32 {got}, {expected['model_crc32']} in "
                f"manifest.json)"]
    return []


# ---------------------------------------------------------------- one file: torch.save's zip archive


def single_file_problems(path: Path) -> Optional[List[str]]:
    """The model's part of the one-file lit_model.pth `path` checked against the CRC-32s of its zip archive: its
    data.pkl, then the record of each storage under its `model` entry, read through `zipfile` (which compares each
    record's bytes with its CRC-32). None for a file that is no zip archive (nothing to tell the parts by)."""
    if not zipfile.is_zipfile(path):
        return None
    problem = f"{MODEL_FILE}'s bytes changed since it was written"
    record = "data.pkl"
    try:
        with zipfile.ZipFile(path) as archive:
            # saved without CRC-32s (torch.utils.serialization.config.save.compute_crc32 off), data.pkl's 0 too: no
            # record can be checked, not even read (zipfile would take each for damaged)
            if any(info.CRC == 0 and info.file_size for info in archive.infolist()):
                return None
            try:
                records = model_records(archive)  # its data.pkl read whole, so checked against its CRC-32
            except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, RuntimeError):
                return None  # as it was written, and not what a train state is: the loader's error says what it holds
            for record in records:
                with archive.open(record) as f:  # raises BadZipFile at the end of bytes that do not give its CRC-32
                    while f.read(READ_BLOCK):
                        pass
    except zipfile.BadZipFile as error:
        if "CRC" not in str(error):  # the archive's directory itself does not read
            return [f"{problem} (its zip archive does not read: {' '.join(str(error).split())})"]
        return [f"{problem} (its record {record}, of the model, does not give the CRC-32 that its zip directory "
                f"records)"]
    return []


def model_records(archive: zipfile.ZipFile) -> List[str]:
    """The names of the records of torch.save's archive `archive` that hold the model: its data.pkl, then the storages
    of the tensors under its `model` entry, in their order. data.pkl is read as `torch.load(weights_only=True)` reads
    it (the plain values that a train state holds and NumPy's RNG state, nothing else), every storage left on the
    meta device, so that none is read."""
    from torch import _weights_only_unpickler

    from fabric_lin.weights import numpy_rng_globals

    pickles = [name for name in archive.namelist() if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise KeyError(f"{len(pickles)} data.pkl records, where torch.save writes one")
    prefix = pickles[0][: -len("data.pkl")]
    keys: Dict[int, str] = {}  # the meta storage's identity -> its record's key

    def persistent_load(saved_id: Tuple) -> torch.storage.TypedStorage:
        kind, storage_type, key, _, numel = (part.decode("ascii") if isinstance(part, bytes) else part
                                             for part in saved_id)
        if kind != "storage":
            raise ValueError(f"a persistent id of kind {kind!r}, where torch.save writes storages")
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        storage = torch.UntypedStorage(numel * torch.empty((), dtype=dtype).element_size(), device="meta")
        keys[storage._cdata] = str(key)
        return torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)

    with torch.serialization.safe_globals(numpy_rng_globals()):
        unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(archive.read(pickles[0])), encoding="utf-8")
        unpickler.persistent_load = persistent_load
        state = unpickler.load()
    model = state.get(MODEL_ENTRY) if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise KeyError(f"no {MODEL_ENTRY!r} entry of tensors")
    storages = {keys[tensor.untyped_storage()._cdata] for tensor in model.values() if isinstance(tensor, torch.Tensor)}
    return [pickles[0]] + [f"{prefix}data/{key}" for key in sorted(storages, key=lambda key: (len(key), key))]


# ---------------------------------------------------------------- sharded: torch.distributed.checkpoint's shard files


def model_ranges(shards: Path, entry: str = MODEL_ENTRY) -> Dict[str, List[Tuple[int, int]]]:
    """For each shard file of the torch.distributed.checkpoint directory `shards` (a sharded lit_model.pth), the byte
    ranges (offset, length) that its .metadata places the items of the train state's `entry` in (by default the
    model's), in the order of the file."""
    from fabric_lin.sharded_checkpoint import _SafeDCPReader

    metadata = _SafeDCPReader(str(shards)).read_metadata()
    planner_data = metadata.planner_data or {}
    ranges: Dict[str, List[Tuple[int, int]]] = {}
    for index, info in (metadata.storage_data or {}).items():
        location = planner_data.get(index.fqn, tuple(index.fqn.split(".", 1)))
        if location and location[0] == entry:
            ranges.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length)))
    return {name: sorted(spans) for name, spans in ranges.items()}


def ranges_crc32(path: Path, ranges: List[Tuple[int, int]]) -> str:
    """The CRC-32 (8 hex digits) of the bytes of `ranges` (offset, length) of the file `path`, one after the other;
    bytes past the file's end count as absent."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        for offset, length in ranges:
            f.seek(offset)
            while length > 0:
                block = f.read(min(length, READ_BLOCK))
                if not block:
                    break
                crc = zlib.crc32(block, crc)
                length -= len(block)
    return f"{crc:08x}"


def with_model_checksum(directory: Path, name: str, entry: Dict[str, Any], shard_ranges: ShardRanges) -> Dict[str, Any]:
    """The manifest entry `entry` of the file `name` of the checkpoint `directory`, with `model_crc32` where it is a
    shard file of a sharded lit_model.pth (`model_part_problems` reads it); `shard_ranges` from
    `shard_ranges_once(directory)`."""
    path = Path(directory) / name
    if path.parent == Path(directory) / MODEL_FILE and name.endswith(".distcp"):
        try:
            ranges = shard_ranges().get(path.name, [])
        except UserError:  # a .metadata that is not DCP's: the shard is checked whole, as its reader will refuse it
            return entry
        entry = {**entry, "model_crc32": ranges_crc32(path, ranges)}
    return entry
