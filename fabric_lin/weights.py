"""A model's weights as files hold them: the file name, loading tensors without unpickling anything else,
the parameter names free of the wrappers' prefixes, a model of the right shapes that holds no memory, and what model
a set of weights is at a glance (family, layers, width), for the error of weights beside another model's config.
Used by the training checkpoint (fabric_lin.checkpoint), the FSDP shard reader (fabric_lin.sharded_checkpoint)
and the model directories of fabric_lin.convert alike."""
import contextlib
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch
import torch.nn as nn

from fabric_lin.config import Config
from fabric_lin.errors import InvalidValue
from fabric_lin.files import reading
from fabric_lin.model import GPT

MODEL_FILE = "lit_model.pth"  # a model directory's weights, or a training checkpoint's whole train state
# prefixes that torch.compile, FSDP, Fabric and activation checkpointing put into parameter names
WRAPPER_PREFIXES = ("_forward_module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name as the bare model names it: without the prefixes that compile, FSDP, DDP, Fabric and
    checkpoint wrappers add."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name.removeprefix("module.")  # DistributedDataParallel's (the model has no submodule of that name)


def canonical_state_dict(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """`state_dict` with every name made canonical (`canonical_name`), refusing two tensors of one name."""
    out = {}
    for name, tensor in state_dict.items():
        clean = canonical_name(name)
        if clean in out:
            raise InvalidValue(f"two tensors map to {clean!r} once the wrappers' prefixes are removed (one is {name!r})")
        out[clean] = tensor
    return out


FAMILY_NAMES = {"gla": "GLA", "gdn": "Gated DeltaNet", "deltanet": "DeltaNet", "transformer": "Transformer"}
# a tensor of the layers of one family alone (GDN's layers hold a b_proj too, so A_log is looked for first); a
# transformer's layers, and a hybrid's attention layers, hold none of them
FAMILY_TENSORS = (("gdn", "attn.A_log"), ("gla", "attn.gk_proj.0.weight"), ("deltanet", "attn.b_proj.weight"))
_LAYER_TENSOR = re.compile(r"layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class Outline:
    """What a model is at a glance: its family (a Config's block_type), number of layers and width (hidden size)."""
    family: str
    layers: int
    width: Optional[int]
    sign: str = ""  # in the weights, the tensor that tells the family

    def __str__(self) -> str:
        width = f", width {self.width}" if self.width is not None else ""
        layers = f"{self.layers} layer{'' if self.layers == 1 else 's'}"
        return f"a {FAMILY_NAMES[self.family]} model ({layers}{width}{self.sign})"

    def same_model(self, other: "Outline") -> bool:
        return (self.family, self.layers, self.width) == (other.family, other.layers, other.width)


def config_outline(config: Config) -> Outline:
    return Outline(config.block_type, config.num_layers, config.hidden_size)


def weights_outline(state_dict: Dict[str, torch.Tensor]) -> Outline:
    """The family, layer count and width of the model whose weights (canonical names) `state_dict` holds: the family told
    by the tensors its layers hold, the layers by their indices, the width by the embeddings."""
    layer_tensors = {}
    for name in state_dict:
        match = _LAYER_TENSOR.fullmatch(name)
        if match:
            layer_tensors.setdefault(match[2], set()).add(int(match[1]))
    family, sign = "transformer", f"; its layers hold none of {', '.join(t for _, t in FAMILY_TENSORS)}"
    for block_type, tensor in FAMILY_TENSORS:
        if tensor in layer_tensors:
            family, sign = block_type, f"; its layers hold {tensor}"
            break
    layers = 1 + max((i for indices in layer_tensors.values() for i in indices), default=-1)
    embeddings = state_dict.get("embeddings.weight")
    width = embeddings.shape[-1] if embeddings is not None and embeddings.dim() == 2 else None
    return Outline(family, layers, width, sign)


def meta_model(config: Config) -> nn.Module:
    with torch.device("meta"):
        return GPT(config)


def torch_load_tensors(path: Path, allow_numpy: bool = False):
    """`torch.load(weights_only=True)`, memory-mapped when the file allows it.

    `allow_numpy` admits plain numpy arrays (what a NumPy RNG state is made of, in a training
    checkpoint's metadata); no other global is ever admitted. A file cut short is one InvalidValue naming it.
    """
    safe = numpy_rng_globals() if allow_numpy else []
    # torch.load fails on a damaged file with any of these, by where the file breaks off
    with reading(path, "tensors written by torch.save", RuntimeError, OSError, EOFError, pickle.UnpicklingError):
        try:
            with torch.serialization.safe_globals(safe) if safe else contextlib.nullcontext():
                try:
                    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError as e:
                    if "mmap" not in str(e):  # e.g. a file in the legacy (non-zip) format cannot be mapped
                        raise
                    return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            # the refusal of a global; a whole torch.save archive is a zip file (one cut short has lost its end, so
            # its unpickling error is the damage's, which `reading` reports)
            if not zipfile.is_zipfile(path):
                raise
            raise not_plain_values(str(path), e) from None


def numpy_rng_globals() -> list:
    """What torch.load(weights_only=True) must admit, beyond tensors and plain values, to read a NumPy RNG state (plain
    arrays), as a training checkpoint's train state holds one."""
    import numpy as np

    reconstruct = (getattr(np, "_core", None) or np.core).multiarray._reconstruct  # numpy 2 / numpy 1
    return [reconstruct, np.ndarray, np.dtype, *(type(np.dtype(t)) for t in ("uint32", "int64", "float64"))]


def not_plain_values(what: str, error: pickle.UnpicklingError) -> InvalidValue:
    """The refusal of what `torch.load(weights_only=True)` refused to unpickle (`error`), in the file or entry `what`,
    with torch's line that names the refused global."""
    lines = str(error).splitlines()
    detail = next((line for line in lines if "GLOBAL" in line), lines[-1] if lines else type(error).__name__)
    return InvalidValue(f"{what} holds objects other than tensors and plain containers, so it is not loaded (files are "
                        f"never unpickled beyond tensors). Details: {detail.strip()[:300]}")


def load_safetensors(path: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of the safetensors file `path`; a file cut short is one InvalidValue naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with reading(path, "safetensors", SafetensorError):
        return load_file(path)


def open_safetensors(path: Path):
    """safetensors' `safe_open` of `path` (its tensors read one at a time); a file cut short is one InvalidValue
    naming it (safetensors checks at opening that the file covers every tensor its header lists)."""
    from safetensors import SafetensorError, safe_open

    with reading(path, "safetensors", SafetensorError):
        return safe_open(path, framework="pt")


def tensor_dict(state, path: Path) -> Dict[str, torch.Tensor]:
    if not isinstance(state, dict):
        raise InvalidValue(f"{path}: expected a dict of tensors, got {type(state).__name__}")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise InvalidValue(f"{path}: expected a dict of name -> tensor; these entries are not: {', '.join(map(repr, bad[:12])) + (f' ... ({len(bad) - 12} more)' if len(bad) > 12 else '')}")
    return state


def inside(directory: Path, name: str, what: str) -> Path:
    """`directory / name`, refusing a name that leaves `directory` (absolute, or through `..`).

    The check is on the name, not on where symlinks lead: a Hugging Face cache snapshot links its
    files to blobs elsewhere, and links made by the directory's owner are theirs to make."""
    if not isinstance(name, str) or not name or Path(name).is_absolute():
        raise InvalidValue(f"{what}: file name {name!r} is not a relative path inside {directory}")
    normal = os.path.normpath(name)
    if normal == ".." or normal.startswith(".." + os.sep) or normal == ".":
        raise InvalidValue(f"{what}: file name {name!r} points outside {directory}")
    return Path(directory) / normal
