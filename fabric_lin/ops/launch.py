"""Host-side helpers of the kernels' Python wrappers, kept cheap because a gla-340M training step calls
them hundreds of times (the step is host-bound where its kernels are short).

* cdiv, next_power_of_2: plain Python. Recent Triton makes triton.cdiv and triton.next_power_of_2
  constexpr functions, whose every host call unwraps its arguments first (microseconds each, ~1,700
  calls per step).
* multiprocessors: the GPU's multiprocessor count, asked of the driver once per device.
* op_or_fn: a torch.library custom op while torch.compile traces (where it must be one opaque node of
  the graph), its Python function otherwise (the dispatcher costs ~10 us per call in eager mode).
"""
import functools
from typing import Callable

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _multiprocessors_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors(device: torch.device) -> int:
    """Multiprocessors of the CUDA device `device`."""
    return _multiprocessors_of(device.index if device.index is not None else torch.cuda.current_device())


def op_or_fn(op: Callable, fn: Callable) -> Callable:
    """`op` (a custom op made from `fn`) under torch.compile, `fn` itself in eager mode."""
    return op if torch.compiler.is_compiling() else fn
