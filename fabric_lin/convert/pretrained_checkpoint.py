"""Training checkpoint -> model directory.

A training checkpoint `out_dir/step-XXXXXXXX/` (or `final/`) holds `lit_model.pth` as Fabric saved it:
- one device (or DDP): a single file, the dict {model, optimizer, train_dataloader, iter_num, ...};
- FSDP with state_dict_type="sharded": a directory in torch.distributed.checkpoint (DCP) format,
  `.metadata` plus one `__<rank>_0.distcp` per process holding the tensors {model: ..., optimizer: ...},
  and Fabric's `meta.pt` with the remaining (non-tensor) state, written by rank 0.

Only the model's tensors are read. The sharded form is consolidated in this process, on the CPU,
without a process group: DCP reassembles every tensor from its shards into a preallocated full one.
"""
import collections
import io
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.distributed.checkpoint

from fabric_lin.config import Config
from fabric_lin.convert.model_dir import (
    CONFIG_FILE,
    MODEL_FILE,
    cast_floating,
    check_state_dict,
    inside,
    parse_dtype,
    prepare_output_dir,
    save_model_dir,
    strip_compile_prefix,
    tensor_dict,
    torch_load_tensors,
)

FABRIC_SHARDED_METADATA = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME


def convert_pretrained_checkpoint(
    checkpoint_dir: Path, output_dir: Optional[Path] = None, dtype: Optional[str] = None, overwrite: bool = False
) -> None:
    """Write the model of a training checkpoint as a model directory (lit_model.pth with the model's
    state dict alone, model_config.yaml, tokenizer files), for `generate`, evaluation and
    `pretrain --initial_checkpoint_dir`.

    Args:
        checkpoint_dir: a training checkpoint directory, e.g. out/pretrain/gla-340M/step-00002048
            or .../final; from one device or FSDP-sharded from many.
        output_dir: where to write the model directory (required).
        dtype: cast floating-point weights to float32, bfloat16 or float16 (default: keep).
        overwrite: write into a non-empty output_dir.
    """
    if output_dir is None:
        raise ValueError("convert_pretrained_checkpoint: --output_dir is required")
    checkpoint_dir = Path(checkpoint_dir)
    torch_dtype = parse_dtype(dtype)
    config, weights_path = find_training_checkpoint(checkpoint_dir)
    output_dir = prepare_output_dir(Path(output_dir), overwrite, sources=[checkpoint_dir])

    if weights_path.is_dir():
        state_dict = load_sharded_model_state(weights_path)
        form = f"sharded ({len(list(weights_path.glob('*.distcp')))} shard files)"
    else:
        state_dict = load_single_file_model_state(weights_path)
        form = "single file"
    state_dict = strip_compile_prefix(state_dict)
    check_state_dict(state_dict, config, source=str(weights_path))
    state_dict = cast_floating(state_dict, torch_dtype)

    tokenizer_files = save_model_dir(state_dict, config, output_dir, tokenizer_dir=checkpoint_dir)
    n_params = sum(t.numel() for t in state_dict.values())
    print(
        f"Converted {checkpoint_dir} ({form}): {len(state_dict)} tensors, {n_params:,} parameters, "
        f"dtype {dtype or 'as saved'} -> {output_dir / MODEL_FILE}"
    )
    print(f"Copied {CONFIG_FILE} and tokenizer files {tokenizer_files}")


def find_training_checkpoint(checkpoint_dir: Path):
    """(Config, path of lit_model.pth) of a training checkpoint directory, or a clear error."""
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} is not a directory: expected a training checkpoint directory")
    if checkpoint_dir.name.startswith(".tmp-"):
        raise ValueError(f"{checkpoint_dir} is an unfinished checkpoint (a `.tmp-` directory is renamed when complete)")
    weights_path = checkpoint_dir / MODEL_FILE
    if not weights_path.exists():
        steps = sorted(p.name for p in checkpoint_dir.glob("step-*") if (p / MODEL_FILE).exists())
        finals = [p.name for p in checkpoint_dir.glob("final") if (p / MODEL_FILE).exists()]
        hint = f"; it holds checkpoints {(steps[-3:] + finals)}, pass one of those" if steps or finals else ""
        raise FileNotFoundError(f"{checkpoint_dir} is not a training checkpoint: it has no {MODEL_FILE}{hint}")
    if weights_path.is_dir() and not (weights_path / ".metadata").is_file():
        raise ValueError(
            f"{weights_path} is a directory without the torch.distributed.checkpoint `.metadata` file; "
            "expected Fabric's sharded FSDP checkpoint"
        )
    config = Config.from_checkpoint(checkpoint_dir)
    return config, weights_path


def load_single_file_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """The `model` entry of a checkpoint saved by `fabric.save` on one device (or DDP)."""
    # the checkpoint also holds the RNG states, which include NumPy's (an array)
    checkpoint = torch_load_tensors(path, allow_numpy=True)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path}: expected the dict saved by fabric.save, got {type(checkpoint).__name__}")
    if "model" not in checkpoint:
        if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            raise ValueError(f"{path} holds a bare state dict: {path.parent} is already a model directory, not a training checkpoint")
        raise ValueError(f"{path}: no 'model' entry; found keys {sorted(map(str, checkpoint))}")
    return tensor_dict(checkpoint["model"], path)


class _SafeDCPReader(torch.distributed.checkpoint.FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled with only DCP's own metadata classes (plus
    torch.Size, dtypes and layouts) allowed, and whose shard file names must stay in the directory.
    (torch's own reader uses a plain `pickle.load`, which runs whatever the file names.)"""

    def read_metadata(self, *args, **kwargs):
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


def load_sharded_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """Consolidate the `model` entry of a DCP checkpoint directory into full CPU tensors."""
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
