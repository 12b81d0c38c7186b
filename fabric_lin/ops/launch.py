"""What every kernel's Python wrapper shares: how a kernel is launched (`KernelLaunch`, `LaunchBundle`) and the
host-side arithmetic around a launch, kept cheap because a gla-340M training step calls it hundreds of times (the
step is host-bound where its kernels are short).

* KernelLaunch: one kernel's tile widths, warps, pipeline stages and register cap, an immutable value.
* LaunchBundle: the base of a kernel family's launch settings (`fabric_lin.ops.gla.launch.GLALaunch`, GDNLaunch,
  NormLaunch, ...): a frozen dataclass of KernelLaunch fields and plain values, its defaults the shipped settings.
  The model builds one per family and passes it down explicitly; nothing is looked up in module state.
* cdiv, next_power_of_2, tile_width: plain Python. Recent Triton makes triton.cdiv and
  triton.next_power_of_2 constexpr functions, whose every host call unwraps its arguments first
  (microseconds each, ~1,700 calls per step).
* multiprocessors: the GPU's multiprocessor count, asked of the driver once per device.
"""
import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class KernelLaunch:
    """How one Triton kernel is launched."""

    BK: int = 64
    """Key (or row) tile width; a head dim narrower than it takes the next power of two (at least 16)."""
    BV: int = 64
    """Value tile width, likewise."""
    warps: Optional[int] = 4
    """Warps per program; None: chosen from the launch's program count (see the kernel's host function)."""
    stages: int = 1
    """Software-pipelining stages of the kernel's loops."""
    maxnreg: int = 0
    """Registers per thread the compiler may use (0: its own choice)."""

    def options(self, warps: Optional[int] = None) -> dict:
        """Triton's launch options: num_warps (`warps` where the host chose them), num_stages, maxnreg."""
        options = {"num_warps": warps if warps is not None else self.warps, "num_stages": self.stages}
        if self.maxnreg:
            options["maxnreg"] = self.maxnreg
        return options


def launch_to_json(launch) -> str:
    """A launch bundle (a frozen dataclass of KernelLaunch fields and plain values) as a JSON string: the form
    a torch.library op takes it in (ops accept strings, not Python objects)."""
    return json.dumps(dataclasses.asdict(launch), sort_keys=True)


def launch_from_dict(cls, data: dict, source: str = "launch settings"):
    """An instance of the launch bundle `cls` from a dict (e.g. parsed JSON); unknown keys are an error that
    names them and the valid ones."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping of {cls.__name__} fields, got {type(data).__name__}")
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        value = data[field.name]
        if dataclasses.is_dataclass(field.default):  # a KernelLaunch field
            kernel_fields = {f.name for f in dataclasses.fields(KernelLaunch)}
            unknown = sorted(set(value) - kernel_fields) if isinstance(value, dict) else None
            if unknown is None or unknown:
                raise ValueError(f"{source}: {field.name} has unknown keys {unknown}; valid keys are {sorted(kernel_fields)}")
            value = KernelLaunch(**value)
        values[field.name] = value
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{source}: unknown keys {unknown}; valid keys are {[f.name for f in dataclasses.fields(cls)]}")
    return cls(**values)


@dataclass(frozen=True)
class LaunchBundle:
    """A kernel family's launch settings: subclass it as a frozen dataclass whose fields are KernelLaunch values
    (one per kernel) and plain ones, their defaults the shipped settings."""

    def __post_init__(self):
        # the form the custom ops take it in, made once: under torch.compile reading it is a constant
        object.__setattr__(self, "as_json", launch_to_json(self))

    @classmethod
    def from_dict(cls, data: dict, source: Optional[str] = None):
        return launch_from_dict(cls, data, source or f"{cls.__name__} settings")

    @classmethod
    def from_json(cls, text: str):
        """The bundle an op was given as `as_json` (parsed once per distinct text)."""
        return _from_json(cls, text)


def launch_json(launch: Optional[LaunchBundle], shipped: LaunchBundle) -> str:
    """What a kernel op takes for `launch`: its JSON text, `shipped`'s where launch is None. A launch of another
    class than shipped's is a TypeError naming the class expected."""
    if launch is None:
        return shipped.as_json
    if not isinstance(launch, type(shipped)):
        expected = type(shipped)
        raise TypeError(f"launch must be a {expected.__module__}.{expected.__name__}, got {type(launch).__name__}")
    return launch.as_json


@functools.lru_cache(maxsize=256)
def _from_json(cls, text: str):
    return cls.from_dict(json.loads(text))


def with_settings(launch, settings: dict):
    """A launch bundle with some fields changed: {"dqk.warps": 4, "dqk_single_warps": 8, ...}, "kernel.field" for
    a KernelLaunch's field."""
    top = {}
    for key, value in settings.items():
        kernel, _, field = key.partition(".")
        if not hasattr(launch, kernel) or (field and not hasattr(getattr(launch, kernel), field)):
            raise ValueError(f"unknown {type(launch).__name__} setting {key!r}")
        if field:
            top[kernel] = dataclasses.replace(top.get(kernel, getattr(launch, kernel)), **{field: value})
        else:
            top[kernel] = value
    return dataclasses.replace(launch, **top)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def tile_width(limit: int, dim: int) -> int:
    """A tile over a dim of `dim` elements: `limit` wide, or the dim's next power of two (at least 16, the
    narrowest tile a tensor-core product takes) where that is narrower."""
    return min(limit, max(16, next_power_of_2(dim)))


@functools.lru_cache(maxsize=None)
def _multiprocessors_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 1 for any other device (Triton's interpreter on the CPU)."""
    if device.type != "cuda":
        return 1
    return _multiprocessors_of(device.index if device.index is not None else torch.cuda.current_device())
