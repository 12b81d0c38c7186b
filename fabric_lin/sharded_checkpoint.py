"""Training checkpoints read across layouts: a sharded one in a process that does not shard, and a one-file one
in a sharded run.

A sharded run's (FSDP2's) lit_model.pth is a torch.distributed.checkpoint (DCP) directory: the model's and
the optimizer's tensors in shards (`__<rank>_0.distcp`, described by `.metadata`), and Fabric's `meta.pt`
with the rest of the train state. DCP reassembles each tensor whole from its shards into a preallocated one
(`no_dist=True`), so any process can read one: `convert_pretrained_checkpoint` takes the model's weights,
and a run that does not shard (one device, or DDP) resumes the whole train state (`load_sharded_train_state`),
e.g. a run of 2 GPUs continued on 1. The other way, a sharded run resumes a one-file checkpoint (of one device
or DDP) with `load_one_file_train_state`. A sharded run resuming a sharded checkpoint, on any mesh, is Fabric's
own `fabric.load` (DCP reshards). Pickled entries are read as plain values only (`weights_only`). Every load first
checks that the files `.metadata` names are there and hold its bytes (`read_checked_metadata`), and a failure of DCP's
read is one error naming the directory (`read_failure`): the manifest was verified before, but files may go since.
"""
import collections
import io
import itertools
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from fabric_lin.errors import InvalidValue, MissingFile
from fabric_lin.weights import canonical_name, canonical_state_dict, inside, not_plain_values, torch_load_tensors

FABRIC_META_FILE = "meta.pt"  # Fabric's sharded save: what is neither a module nor an optimizer


def load_sharded_train_state(path: Path, state: Dict[str, Any]) -> None:
    """Restore `state` (`checkpoint.train_state`: model, optimizer, the data loader, counters, RNG states)
    in place from the sharded lit_model.pth/ `path`, in a process that does not run FSDP. The optimizer's
    state, saved keyed by parameter names, is keyed here by this optimizer's parameter order: each parameter gets
    the state saved under its name, in groups of the same parameters as the saved ones (else refused)."""
    path = Path(path)
    read_checked_metadata(path, fabric_meta=True)
    model, optimizer = state["model"], state["optimizer"]
    own = {canonical_name(name): name for name in model.state_dict()}
    saved = canonical_state_dict(load_sharded_model_state(path))
    check_same_parameters(path, set(own), set(saved))
    model.load_state_dict({own[name]: tensor for name, tensor in saved.items()})

    names = {id(p): canonical_name(name) for name, p in model.named_parameters()}
    own_groups = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    position = {name: i for i, name in enumerate(name for group in own_groups for name in group)}
    saved_optimizer = read_sharded_entry(path, "optimizer")
    saved_groups = [[canonical_name(name) for name in group["params"]] for group in saved_optimizer["param_groups"]]
    for i, (saved_group, own_group) in enumerate(itertools.zip_longest(saved_groups, own_groups, fillvalue=[])):
        if sorted(saved_group) != sorted(own_group):
            raise unmatched_optimizer_state(path, f"groups the parameters otherwise than this run's: its group {i} holds "
                                                  f"{sorted(saved_group)[:8]}, this run's {sorted(own_group)[:8]}")

    def index(name: str) -> int:
        if canonical_name(name) not in position:
            raise InvalidValue(f"{path}: the optimizer state names parameter {name!r}, which this run's model does not have")
        return position[canonical_name(name)]

    # torch's load_state_dict pairs the saved groups' parameters with this optimizer's by their places in the groups, so
    # each group lists its parameters in this run's order: every parameter gets the state saved under its name, in
    # whatever order the run that saved it registered them
    optimizer.load_state_dict({
        "state": {index(name): value for name, value in saved_optimizer.get("state", {}).items()},
        "param_groups": [{**group, "params": [position[name] for name in own_group]}
                         for group, own_group in zip(saved_optimizer["param_groups"], own_groups)],
    })
    restore_the_rest(state, torch_load_tensors(path / FABRIC_META_FILE, allow_numpy=True))


def load_one_file_train_state(path: Path, state: Dict[str, Any]) -> None:
    """Restore `state` in place from the one-file lit_model.pth `path` (of one device, or DDP), in a sharded run:
    every rank reads the file and keeps its shards. The optimizer's state, saved keyed by each parameter's
    position in the optimizer's groups, is keyed by parameter names for torch.distributed: this run's groups
    are built as every run builds them (pretrain's `main`), so a position names the same parameter."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    path = Path(path)
    model, optimizer = state["model"].module, state["optimizer"].optimizer  # inside Fabric's wrappers
    saved = torch_load_tensors(path, allow_numpy=True)
    weights = canonical_state_dict(saved.pop("model"))
    check_same_parameters(path, {canonical_name(name) for name in model.state_dict()}, set(weights))
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, weights, options=options)
    names = {id(p): canonical_name(name) for name, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved_optimizer = saved.pop("optimizer")
    # a position names the same parameter only in groups of the same sizes: the same total is not enough (one group of
    # every parameter would give a norm's moments to a projection)
    saved_sizes = [len(group["params"]) for group in saved_optimizer["param_groups"]]
    own_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != own_sizes:
        raise unmatched_optimizer_state(path, f"holds parameter groups of {saved_sizes} parameters, this run's of "
                                              f"{own_sizes}")
    set_optimizer_state_dict(model, optimizer, {
        "state": {order[i]: value for i, value in saved_optimizer["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in saved_optimizer["param_groups"]],
    }, options=options)
    restore_the_rest(state, saved)


def unmatched_optimizer_state(path: Path, difference: str) -> InvalidValue:
    return InvalidValue(
        f"{path}: the checkpoint's optimizer {difference}, so its state cannot be matched to this run's parameters; start "
        f"from its weights alone: fabric-lin convert_pretrained_checkpoint {path.parent} --output_dir DIR, then "
        f"--initial_checkpoint_dir DIR"
    )


def check_same_parameters(path: Path, own: set, saved: set) -> None:
    if own != saved:
        raise InvalidValue(
            f"{path}: the checkpoint's model does not fit this run's: missing {sorted(own - saved)[:8]}, "
            f"unexpected {sorted(saved - own)[:8]}"
        )


def restore_the_rest(state: Dict[str, Any], saved: Dict[str, Any]) -> None:
    """As fabric.load does with what is neither the model nor the optimizer: objects restore their state (the data
    loader, inside Fabric's wrapper, which does not pass `load_state_dict` on), values are replaced."""
    from lightning_fabric.wrappers import _unwrap_objects

    objects = _unwrap_objects(state)
    for key, value in saved.items():
        if hasattr(objects.get(key), "load_state_dict"):
            objects[key].load_state_dict(value)
        else:
            state[key] = value


def read_sharded_entry(path: Path, top: str) -> Any:
    """The top-level entry `top` of a DCP directory (e.g. "optimizer"), nested as it was saved, every tensor
    whole on the CPU."""
    metadata = read_checked_metadata(path)
    root: Dict[str, Any] = {}
    for key, item in metadata.state_dict_metadata.items():
        location = (metadata.planner_data or {}).get(key, tuple(key.split(".")))
        if not location or location[0] != top:
            continue
        leaf = torch.empty(item.size, dtype=item.properties.dtype) if isinstance(item, TensorStorageMetadata) else None
        _set_nested(root, location, leaf)
    if top not in root:
        raise InvalidValue(f"{path}: no entry {top!r} in the checkpoint")
    planner = _PlainValuesLoadPlanner()
    load_in_this_process(path, root, planner)
    if planner.refused:
        entry, error = planner.refused[0]
        raise not_plain_values(f"{path}: its entry {entry!r}", error)
    return root[top]


def _set_nested(root: Dict[str, Any], location: tuple, leaf: Any) -> None:
    """Place `leaf` at `location` (keys of dicts, indices of lists) under `root`, making the containers."""
    node: Union[Dict, List] = root
    for part, following in zip(location[:-1], location[1:]):
        empty = [] if isinstance(following, int) else {}
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            node[part] = empty if node[part] is None else node[part]
            node = node[part]
        else:
            node = node.setdefault(part, empty)
    if isinstance(node, list):
        node.extend([None] * (location[-1] + 1 - len(node)))
    node[location[-1]] = leaf


class _PlainValuesLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading the pickled (non-tensor) entries with `weights_only=True`: plain
    values (numbers, strings, lists, dicts) only. The value read is handed on re-serialised, since the
    parent class unpickles with weights_only=False. An entry that holds anything else is left out and named in
    `refused` (raised here, the error would reach the caller inside DCP's own exception, a traceback long)."""

    def __init__(self):
        super().__init__()
        self.refused: List[Tuple[str, pickle.UnpicklingError]] = []  # (entry, torch.load's refusal)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            self.refused.append((read_item.dest_index.fqn, error))
            return
        buffer = io.BytesIO()
        torch.save(plain, buffer)
        buffer.seek(0)
        super().load_bytes(read_item, buffer)


def load_sharded_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """Consolidate the `model` entry of a DCP checkpoint directory into full CPU tensors, in this
    process and without a process group: DCP reassembles every tensor from its shards into a
    preallocated full one. The optimizer's entries are not read."""
    metadata = read_checked_metadata(path)
    planner_data = metadata.planner_data or {}
    full: Dict[str, torch.Tensor] = {}
    not_tensors = []
    for key, item in metadata.state_dict_metadata.items():
        location = planner_data.get(key, tuple(key.split(".", 1)))
        if not location or location[0] != "model":
            continue  # the optimizer's state
        name = ".".join(str(part) for part in location[1:])
        if not isinstance(item, TensorStorageMetadata):
            not_tensors.append(name)
            continue
        full[name] = torch.empty(item.size, dtype=item.properties.dtype)
    if not_tensors:
        raise InvalidValue(f"{path}: model entries {not_tensors[:8]} are pickled objects, not tensors; they are not read")
    if not full:
        top = sorted({str(planner_data.get(k, (k,))[0]) for k in metadata.state_dict_metadata})
        raise InvalidValue(f"{path}: no tensors under 'model'; the checkpoint's top-level entries are {top}")
    state = {"model": full}
    load_in_this_process(path, state)
    return state["model"]


def load_in_this_process(path: Path, state: Dict[str, Any], planner: Optional[DefaultLoadPlanner] = None) -> None:
    """DCP's load of `state` (tensors preallocated whole) from the DCP directory `path`, in this process alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, storage_reader=_SafeDCPReader(str(path)), planner=planner, no_dist=True)
        except CheckpointException as error:
            raise read_failure(path, error) from error


def read_checked_metadata(path: Path, fabric_meta: bool = False) -> Metadata:
    """The `.metadata` of the DCP directory `path`, read as `_SafeDCPReader` reads it, once every shard file it
    places tensors in is there and holds the bytes it places there (and, with `fabric_meta`, Fabric's meta.pt is
    there): a checkpoint copied in part, or changed since its manifest was verified (pruned by the run that wrote it,
    while it is read), is named file by file, not by torch.distributed.checkpoint's traceback of every rank."""
    metadata = _SafeDCPReader(str(path)).read_metadata()
    ends: Dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        ends[name] = max(ends.get(name, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = Path(path) / name
        if not shard.is_file():
            raise MissingFile(f"{path}: the sharded checkpoint is incomplete: its shard {name} is missing (its .metadata "
                              f"places tensors in it)")
        size = shard.stat().st_size
        if size < end:
            raise InvalidValue(f"{shard} is truncated: {size:,} bytes, where the checkpoint's .metadata places data up "
                               f"to byte {end:,}")
    if fabric_meta and not (Path(path) / FABRIC_META_FILE).is_file():
        raise MissingFile(f"{path}: the sharded checkpoint is incomplete: {FABRIC_META_FILE} is missing (Fabric's file of "
                          f"the train state that is neither the model nor the optimizer)")
    return metadata


def read_failure(path: Path, error: CheckpointException) -> BaseException:
    """What a load from the DCP directory `path` raises for torch.distributed.checkpoint's CheckpointException (a
    BaseException, whose message is each failing rank's traceback): a Ctrl-C during the load stays a
    KeyboardInterrupt; a file missing or cut short since the load began is named; any other failure to read is named
    with the directory, in one line."""
    failures = [failed[0] for _, failed in sorted(error.failures.items())]
    if any(isinstance(failure, KeyboardInterrupt) for failure in failures):
        return KeyboardInterrupt()
    read_checked_metadata(path)  # raises for a file that went missing or was cut short
    first = failures[0] if failures else error
    return InvalidValue(f"{path}: the sharded checkpoint cannot be read ({first_sentence(first)}): it is damaged; "
                        f"load an older checkpoint of the run")


def first_sentence(error: BaseException) -> str:
    """A reader's complaint in one line: its type and the first sentence of its message (torch's go on for lines)."""
    said = " ".join(str(error).split()).split(". ")[0][:300]
    return f"{type(error).__name__}: {said}" if said else type(error).__name__


class _SafeDCPReader(torch.distributed.checkpoint.FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with only DCP's own metadata classes (plus
    torch.Size, dtypes and layouts) allowed, and whose shard file names must stay in the directory.
    (torch's own reader uses a plain `pickle.load`, which runs whatever the file names.)"""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        if not path.is_file():
            raise MissingFile(f"{self.path}: the sharded checkpoint has no .metadata (torch.distributed.checkpoint's index "
                              f"of its shards, written last): it is incomplete")
        try:
            metadata = _RestrictedUnpickler(io.BytesIO(path.read_bytes()), path).load()
        except InvalidValue:
            raise
        except (EOFError, pickle.UnpicklingError, AttributeError, IndexError, TypeError, ValueError) as error:
            raise InvalidValue(f"{path} is damaged: it does not read as torch.distributed.checkpoint's metadata "
                               f"({first_sentence(error)})") from error
        if not isinstance(metadata, torch.distributed.checkpoint.metadata.Metadata):
            raise InvalidValue(f"{path}: expected a torch.distributed.checkpoint Metadata, got {type(metadata).__name__}")
        for info in (metadata.storage_data or {}).values():
            inside(Path(self.path), str(info.relative_path), str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = torch.distributed.checkpoint.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.filesystem as dcp_filesystem
        import torch.distributed.checkpoint.metadata as dcp_metadata

        obj = None
        if module == "torch.distributed.checkpoint.metadata" and isinstance(getattr(dcp_metadata, name, None), type):
            obj = getattr(dcp_metadata, name)
        elif module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            obj = dcp_filesystem._StorageInfo
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            obj = getattr(torch, name)
        elif module == "torch.serialization" and name == "_get_layout":
            obj = torch.serialization._get_layout
        elif module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"):
            obj = getattr(pathlib, name)
        elif module == "collections" and name == "OrderedDict":
            obj = collections.OrderedDict
        if obj is None:
            raise InvalidValue(
                f"{self.path} refers to {module}.{name}, which is not part of a torch.distributed.checkpoint "
                "metadata file; refusing to unpickle it"
            )
        return obj
