"""How the Gated DeltaNet Triton kernels are launched: one immutable `GDNLaunch`, a `KernelLaunch` per kernel.

`SHIPPED` is what every call uses unless it passes another (`chunk_gated_delta_rule(..., launch=...)`). The
values are plain defaults (64-wide tiles, 4 warps), not yet timed on a GPU: nothing is searched at start-up,
and nothing changes with the batch size or the sequence length.

The state passes hold the whole key dimension of the state in one program (the correction D = U - W S needs
every key row of S), so their `BK` is not a setting: the tile is K rounded up to a power of two.
"""
from dataclasses import dataclass

from fabric_lin.ops.launch import KernelLaunch, launch_from_dict, launch_to_json


@dataclass(frozen=True)
class GDNLaunch:
    l2norm: KernelLaunch = KernelLaunch(BK=16, warps=4)
    """The q/k L2 norm, forward and backward; BK: rows per program (each program holds whole rows)."""
    solve: KernelLaunch = KernelLaunch(BK=64, warps=4)
    """Per chunk: the gate's cumsum, A = strict_lower(beta K K^T * decay) and (I + A)^-1; BK: key tile of K K^T."""
    wu: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """W = (I + A)^-1 (beta exp(b) K) and U = (I + A)^-1 (beta V), forward and again in the backward pass."""
    state: KernelLaunch = KernelLaunch(BV=64, warps=4)
    """The forward state pass (per-chunk states and the corrections D = U - W S); BV: value tile."""
    output: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """o = scale (exp(b) q S + (q k^T * decay) D), one value tile of one chunk per program."""
    dd_local: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """The chunk's own part of dD, scale (q k^T * decay)^T do."""
    dstate: KernelLaunch = KernelLaunch(BV=64, warps=4)
    """The reverse state pass: the state gradients and the rest of dD."""
    dqkw: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """dq, the output's and state's part of dk, dW and their part of the gate's gradient, per key tile."""
    wy_bwd: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """Through W, U and (I + A)^-1 to dk, dv, dbeta; the gate's gradient summed and cumulated back."""

    def __post_init__(self):
        # the form the torch.library ops take it in, made once: under torch.compile reading it is a constant
        object.__setattr__(self, "as_json", launch_to_json(self))

    @classmethod
    def from_dict(cls, data: dict, source: str = "GDN launch settings") -> "GDNLaunch":
        return launch_from_dict(cls, data, source)


SHIPPED = GDNLaunch()
