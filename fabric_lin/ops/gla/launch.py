"""How the GLA Triton kernels are launched: one immutable `GLALaunch`, a `KernelLaunch` per kernel.

`SHIPPED` is what every call uses unless it passes another (`chunk_gla(..., launch=...)`, the model's
`gla_launch`). It needs no search at start-up and nothing is re-tuned when the batch size or the sequence
length changes. `tune.py` searches its fields at one layer shape and returns another `GLALaunch`; it never
changes this module. The figures behind each value are in `benchmarks/results/`.

Rules that depend on the call rather than on the GPU are not settings: the state pass splits into
chunk-parallel updates and a scan where the sequential form would leave the GPU idle, its warps follow its
program count where `state.warps` is None, and dq/dk takes at least 8 warps over key tiles narrower than 64
(see `chunk_bwd.py` and `state_pass.py`).
"""
from dataclasses import dataclass

from fabric_lin.ops.launch import KernelLaunch, LaunchBundle


@dataclass(frozen=True)
class GLALaunch(LaunchBundle):
    cumsum: KernelLaunch = KernelLaunch(BK=16, warps=2)
    """The in-chunk gate cumsum (also writes the decayed keys in the backward pass)."""
    state: KernelLaunch = KernelLaunch(BK=64, BV=128, warps=None)
    """The sequential state passes (forward states; the backward's states and state gradients in one launch)."""
    scan: KernelLaunch = KernelLaunch(BK=16, BV=64, warps=4, stages=3)
    """The elementwise scan of the split state pass (long sequences with few heads)."""
    output: KernelLaunch = KernelLaunch(BK=64, BV=256, warps=4)
    """The forward output kernel, which also makes the intra-chunk scores (value tiles at least 64 wide)."""
    dv: KernelLaunch = KernelLaunch(BK=128, BV=64, warps=4, maxnreg=168)
    """dv and the scores' gradient; one key tile covering K forms the decayed keys once for all value tiles."""
    dqk: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=8)
    """dq, dk and the gate's gradient: the launch of the chunks that need the levels."""
    dqk_single_warps: int = 4
    """Warps of dq/dk's first launch, the chunks whose scores take one reference row."""
    updates_warps: int = 4
    """Warps of the split state pass's chunk-parallel updates (in `state`'s tiles: they stand for that pass)."""
    step_warps: int = 4
    """Warps of the decoding step (fused_recurrent.py; its tiles follow the head dims)."""


SHIPPED = GLALaunch()
