"""The training-checkpoint format: the one module that writes, finds and reads it.

A run's out_dir holds:

    step-XXXXXXXX/    a checkpoint at optimizer step XXXXXXXX (every train.save_interval steps, and at a stop)
    final/            the checkpoint at the end of the run
    .tmp-*/           a checkpoint being written, or left by a killed run: never read

A checkpoint directory holds:

    lit_model.pth         Fabric's save of the train state (`train_state`): model, optimizer, train
                          dataloader (litdata's loader state), counters and RNG states. One file on one
                          device or DDP; under FSDP a torch.distributed.checkpoint (DCP) directory:
                          `.metadata`, one `__<rank>_0.distcp` per process and Fabric's `meta.pt`
    step.json             {"step_count": N}: which checkpoint is newest, without loading one
    hyperparameters.yaml  the run's arguments, usable with `fabric-lin pretrain --config`
    model_config.yaml     the model's `Config`
    tokenizer files       `fabric_lin.data.tokenizer.TOKENIZER_FILES`, when the run has a tokenizer

Each is written under `.tmp-<name>/`, fsynced, and renamed last, so a `step-*` or `final` directory
that holds lit_model.pth is complete. A model directory (`fabric_lin.convert.model_dir`) uses the same
names for its weights and config.
"""
import collections
import io
import json
import os
import pathlib
import pickle
import random
import re
import shutil
import warnings
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed.checkpoint
import yaml

MODEL_FILE = "lit_model.pth"
CONFIG_FILE = "model_config.yaml"
HPARAMS_FILE = "hyperparameters.yaml"
STEP_FILE = "step.json"
FINAL_DIR = "final"
TMP_PREFIX = ".tmp-"
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
        "skipped_steps": 0,  # steps whose update was skipped (non-finite loss or gradient norm)
        "rng_states": {},
    }


# ---------------------------------------------------------------- writing


class Checkpointer:
    """Writes one run's checkpoints into `out_dir`: the train state, and beside it what makes the
    directory self-contained (step.json, hyperparameters.yaml, model_config.yaml, the tokenizer)."""

    def __init__(self, out_dir: Path, hparams: Dict[str, Any], config, tokenizer_dir: Optional[Path] = None,
                 keep_last_n: Optional[int] = None):
        self.out_dir = Path(out_dir)
        self.hparams = hparams
        self.config = config
        self.tokenizer_dir = tokenizer_dir
        self.keep_last_n = keep_last_n

    def save(self, fabric, state: Dict[str, Any], final: bool = False) -> Path:
        """Write out_dir/step-<step_count>/ (or out_dir/final/) atomically: everything goes into a
        `.tmp-` directory, renamed last; then prune to `keep_last_n` step directories. Every rank calls it."""
        name = FINAL_DIR if final else step_dir_name(state["step_count"])
        final_dir = self.out_dir / name
        tmp_dir = self.out_dir / f"{TMP_PREFIX}{name}"
        if fabric.global_rank == 0:
            if tmp_dir.exists():  # left by a run killed while saving
                shutil.rmtree(tmp_dir)
            tmp_dir.mkdir(parents=True)
        fabric.barrier()
        state["rng_states"] = get_rng_states()
        fabric.save(tmp_dir / MODEL_FILE, state)  # every rank takes part; it ends with a barrier
        if fabric.global_rank == 0:
            (tmp_dir / STEP_FILE).write_text(json.dumps({"step_count": state["step_count"]}) + "\n")
            save_hparams(self.hparams, tmp_dir / HPARAMS_FILE)
            self.config.save(tmp_dir / CONFIG_FILE)
            if self.tokenizer_dir is not None:
                from fabric_lin.data.tokenizer import copy_tokenizer_files

                copy_tokenizer_files(self.tokenizer_dir, tmp_dir)
            _fsync_tree(tmp_dir)
            if final_dir.exists():  # e.g. a resumed run passing a step it had saved before
                old = self.out_dir / f"{TMP_PREFIX}old-{name}"
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
        fabric.barrier()
        return final_dir

    def final_step(self) -> Optional[float]:
        return final_checkpoint_step(self.out_dir)


def load_train_state(fabric, checkpoint_dir: Path, state: Dict[str, Any]) -> None:
    """Restore `state` (see `train_state`) in place from a checkpoint directory, RNG states included."""
    fabric.print(f"Resuming from {checkpoint_dir}")
    try:
        fabric.load(Path(checkpoint_dir) / MODEL_FILE, state)
    except KeyError as e:  # a model directory's lit_model.pth holds the weights alone
        raise ValueError(
            f"--resume {checkpoint_dir}: {MODEL_FILE} there is not a training checkpoint ({e}); to start "
            f"from a model directory's weights, use --initial_checkpoint_dir {checkpoint_dir}"
        ) from None
    except ValueError as e:
        if "parameter group" not in str(e):
            raise
        # DDP runs of earlier versions put every parameter in the weight-decay group
        raise ValueError(
            f"--resume {checkpoint_dir}: its optimizer state has other parameter groups than this run's ({e}). "
            "A DDP run of an earlier version put the norm weights and biases in the weight-decay group; "
            f"continue from its weights: fabric-lin convert_pretrained_checkpoint {checkpoint_dir} --output_dir "
            "<DIR>, then --initial_checkpoint_dir <DIR> (AdamW's moments start again)"
        ) from None
    set_rng_states(state["rng_states"])


def save_hparams(hparams: Dict[str, Any], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(to_plain(hparams), f, sort_keys=False)


def to_plain(value: Any) -> Any:
    """Arguments as YAML data that `--config` reads back: dataclasses as mappings, a data module as
    jsonargparse's class_path/init_args, paths as strings."""
    from fabric_lin.data import DataModule

    if isinstance(value, DataModule) and is_dataclass(value):
        cls = type(value)
        init_args = {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def _fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(dirpath))


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
        probe = out_dir / f"{TMP_PREFIX}write-test-{os.getpid()}"
        probe.write_bytes(b"0" * 4096)
        probe.unlink()
    except OSError as e:
        raise OSError(f"out_dir {out_dir} is not writable: {e}") from e
    needed = checkpoint_bytes(config)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise OSError(
            f"out_dir {out_dir} has {free / 1e9:.2f} GB free, but one checkpoint of {config.name or 'this model'} "
            f"takes {needed / 1e9:.2f} GB (fp32 weights and optimizer state): free space or choose another out_dir"
        )


def checkpoint_bytes(config) -> int:
    """Size of one training checkpoint: fp32 weights and AdamW's two fp32 moments."""
    from fabric_lin.convert.model_dir import meta_model

    return 12 * sum(p.numel() for p in meta_model(config).parameters())


# ---------------------------------------------------------------- finding


def step_checkpoints(out_dir: Path) -> List[Path]:
    """Complete step-* checkpoints, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir() if STEP_DIR_PATTERN.match(p.name) and (p / MODEL_FILE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR_PATTERN.match(p.name).group(1)))


def find_resume_dir(resume: Union[bool, str, Path, None], out_dir: Path) -> Optional[Path]:
    """The checkpoint directory to resume from, or None for a fresh start.

    auto/true pick the complete checkpoint with the highest step: `final/` when it is at least as new as
    every step-* directory (a run extended past its first max_steps saves step-* directories after its
    old `final/`); temporary `.tmp-*` directories are never considered."""
    out_dir = Path(out_dir)
    if resume is False or resume is None:
        return None
    if resume is True or resume == "auto":
        candidates = [(int(STEP_DIR_PATTERN.match(p.name).group(1)), 0, p) for p in step_checkpoints(out_dir)]
        final = final_checkpoint_step(out_dir)
        if final is not None:
            candidates.append((final, 1, out_dir / FINAL_DIR))  # on a tie, final/ (its validation is done)
        if candidates:
            return max(candidates)[2]
        if resume == "auto":
            return None
        raise FileNotFoundError(f"--resume true: no checkpoint (step-XXXXXXXX/ or {FINAL_DIR}/ with {MODEL_FILE}) in {out_dir}")
    path = Path(resume)
    if path.name == MODEL_FILE:
        path = path.parent
    if not (path / MODEL_FILE).exists():
        raise FileNotFoundError(f"--resume {resume}: expected a checkpoint directory holding {MODEL_FILE}")
    return path


def final_checkpoint_step(out_dir: Path) -> Optional[float]:
    """The step of a complete out_dir/final/ (inf when it predates step.json: then taken as the newest), or None."""
    final = Path(out_dir) / FINAL_DIR
    if not (final / MODEL_FILE).exists():
        return None
    try:
        return int(json.loads((final / STEP_FILE).read_text())["step_count"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("inf")


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


# ---------------------------------------------------------------- reading the model's weights


def find_training_checkpoint(checkpoint_dir: Path) -> Tuple[Any, Path]:
    """(Config, path of lit_model.pth) of a training checkpoint directory, or a clear error."""
    from fabric_lin.config import Config

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} is not a directory: expected a training checkpoint directory")
    if checkpoint_dir.name.startswith(TMP_PREFIX):
        raise ValueError(f"{checkpoint_dir} is an unfinished checkpoint (a `{TMP_PREFIX}` directory is renamed when complete)")
    weights_path = checkpoint_dir / MODEL_FILE
    if not weights_path.exists():
        steps = [p.name for p in step_checkpoints(checkpoint_dir)]
        finals = [FINAL_DIR] if (checkpoint_dir / FINAL_DIR / MODEL_FILE).exists() else []
        hint = f"; it holds checkpoints {(steps[-3:] + finals)}, pass one of those" if steps or finals else ""
        raise FileNotFoundError(f"{checkpoint_dir} is not a training checkpoint: it has no {MODEL_FILE}{hint}")
    if weights_path.is_dir() and not (weights_path / ".metadata").is_file():
        raise ValueError(
            f"{weights_path} is a directory without the torch.distributed.checkpoint `.metadata` file; "
            "expected Fabric's sharded FSDP checkpoint"
        )
    return Config.from_checkpoint(checkpoint_dir), weights_path


def load_model_weights(weights_path: Path) -> Dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint's lit_model.pth, single file or FSDP-sharded, as saved
    (names may carry torch.compile's `_orig_mod.` prefix)."""
    weights_path = Path(weights_path)
    if weights_path.is_dir():
        return load_sharded_model_state(weights_path)
    return load_single_file_model_state(weights_path)


def load_single_file_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """The `model` entry of a checkpoint saved by `fabric.save` on one device (or DDP)."""
    from fabric_lin.convert.model_dir import tensor_dict, torch_load_tensors

    # the checkpoint also holds the RNG states, which include NumPy's (an array)
    checkpoint = torch_load_tensors(path, allow_numpy=True)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path}: expected the dict saved by fabric.save, got {type(checkpoint).__name__}")
    if "model" not in checkpoint:
        if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            raise ValueError(f"{path} holds a bare state dict: {path.parent} is already a model directory, not a training checkpoint")
        raise ValueError(f"{path}: no 'model' entry; found keys {sorted(map(str, checkpoint))}")
    return tensor_dict(checkpoint["model"], path)


def load_sharded_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """Consolidate the `model` entry of a DCP checkpoint directory into full CPU tensors, in this
    process and without a process group: DCP reassembles every tensor from its shards into a
    preallocated full one. The optimizer's entries are not read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _SafeDCPReader(str(path))
    metadata = reader.read_metadata()
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
        raise ValueError(f"{path}: model entries {not_tensors[:8]} are pickled objects, not tensors; they are not read")
    if not full:
        top = sorted({str(planner_data.get(k, (k,))[0]) for k in metadata.state_dict_metadata})
        raise ValueError(f"{path}: no tensors under 'model'; the checkpoint's top-level entries are {top}")
    state = {"model": full}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_SafeDCPReader(str(path)), no_dist=True)
    return state["model"]


class _SafeDCPReader(torch.distributed.checkpoint.FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with only DCP's own metadata classes (plus
    torch.Size, dtypes and layouts) allowed, and whose shard file names must stay in the directory.
    (torch's own reader uses a plain `pickle.load`, which runs whatever the file names.)"""

    def read_metadata(self, *args, **kwargs):
        from fabric_lin.convert.model_dir import inside

        path = Path(self.path) / ".metadata"
        metadata = _RestrictedUnpickler(io.BytesIO(path.read_bytes()), path).load()
        if not isinstance(metadata, torch.distributed.checkpoint.metadata.Metadata):
            raise ValueError(f"{path}: expected a torch.distributed.checkpoint Metadata, got {type(metadata).__name__}")
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
            raise ValueError(
                f"{self.path} refers to {module}.{name}, which is not part of a torch.distributed.checkpoint "
                "metadata file; refusing to unpickle it"
            )
        return obj
