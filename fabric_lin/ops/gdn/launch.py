"""How the Gated DeltaNet Triton kernels are launched: one immutable `GDNLaunch`, a `KernelLaunch` per kernel.

`SHIPPED` is what every call uses unless it passes another (`chunk_gated_delta_rule(..., launch=...)`). The
values are plain defaults (64-wide tiles, 4 warps, no software pipelining) where no other was timed faster on a
GPU. The kernels given `stages` were each timed faster pipelined at 4 x 8192 x 16 heads on an H100, and together
at the benchmark's three shapes: forward 9-17%, forward + backward 4-9% faster than unpipelined
(benchmarks/results/2026-12-05-gdn-stages-h100.md). Nothing is searched at start-up, and nothing changes with the
sequence length; the state passes' launch is chosen by the number of sequences and heads (below).

The state passes hold the whole key dimension of the state in one program (the correction D = U - W S needs
every key row of S), so their `BK` is not a setting: the tile is K rounded up to a power of two. Their only
parallelism is one program per value tile, sequence and head, each looping over all of its sequence's chunks;
where that leaves the GPU short of programs (4 x 16 heads of V = 128 in 64-wide tiles: 128 programs for an
H200's 132 multiprocessors, one each), `state_pass_launch` takes `narrow_state` (`narrow_dstate`) instead.
"""
from dataclasses import dataclass

from fabric_lin.ops.launch import KernelLaunch, LaunchBundle, cdiv, tile_width


@dataclass(frozen=True)
class GDNLaunch(LaunchBundle):
    l2norm: KernelLaunch = KernelLaunch(BK=16, warps=4)
    """The q/k L2 norm, forward and backward; BK: rows per program (each program holds whole rows)."""
    solve: KernelLaunch = KernelLaunch(BK=64, warps=2, stages=2)
    """Per chunk: the gate's cumsum, A = strict_lower(beta K K^T * decay) and (I + A)^-1; BK: key tile of K K^T.
    Two warps: at four, its 64 x 64 inverse takes 255 registers a thread on sm_90 (Triton 3.6), at two 241 without
    spills, and the forward pass is 10-15% faster (benchmarks/results/2026-12-05-gdn-solve-warps-h100.md). Two
    stages: the next key tile of K K^T loads while this one multiplies."""
    wu: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """W = (I + A)^-1 (beta exp(b) K) and U = (I + A)^-1 (beta V), forward and again in the backward pass."""
    state: KernelLaunch = KernelLaunch(BV=64, warps=4)
    """The forward state pass (per-chunk states and the corrections D = U - W S); BV: value tile."""
    output: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4, stages=2)
    """o = scale (exp(b) q S + (q k^T * decay) D), one value tile of one chunk per program."""
    dd_local: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4)
    """The chunk's own part of dD, scale (q k^T * decay)^T do."""
    dstate: KernelLaunch = KernelLaunch(BV=64, warps=4)
    """The reverse state pass: the state gradients and the rest of dD."""
    narrow_state: KernelLaunch = KernelLaunch(BV=32, warps=4, stages=3)
    """The forward state pass where its own launch would have no more programs than the GPU has multiprocessors: an
    SM with one program has nothing to do while that program's loads are in flight. Narrower value tiles, so twice
    the programs, two to an SM where one multiplies while the other waits; and stages=3, so that each program
    loads the next two chunks' W, U and keys while it multiplies this one's (sm_90, Triton 3.6, K = V = 128: 150
    registers, 111 KB of shared memory: two programs an SM; 4 stages were slower, 2 gave half the gain)."""
    narrow_dstate: KernelLaunch = KernelLaunch(BV=32, warps=4, stages=2)
    """The reverse state pass's counterpart of narrow_state (168 registers, 103 KB of shared memory). Two stages, not
    three: at three, the forward and backward pass at 4 x 8192 x 16 heads was 5% slower."""
    dqkw: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4, stages=2)
    """dq, the output's and state's part of dk, dW and their part of the gate's gradient, per key tile."""
    wy_bwd: KernelLaunch = KernelLaunch(BK=64, BV=64, warps=4, stages=2)
    """Through W, U and (I + A)^-1 to dk, dv, dbeta; the gate's gradient summed and cumulated back. Keep BK at 64: at
    32 with K = 128, its bf16 dk, dg and dbeta on an H100 (Triton 3.6) were wrong (dk 12% off) or NaN, though the
    interpreter's match the reference at that shape (benchmarks/results/2026-12-05-gdn-stages-h100.md)."""
    step_warps: int = 4
    """Warps of the decoding step (fused_recurrent.py; its tiles follow the head dims)."""


SHIPPED = GDNLaunch()


def state_pass_launch(own: KernelLaunch, narrow: KernelLaunch, V: int, N: int, H: int, multiprocessors: int) -> KernelLaunch:
    """A state pass's launch: `own` (GDNLaunch.state or dstate), or `narrow` (narrow_state or narrow_dstate) where
    own's value tiles give at most one program per multiprocessor (N sequences, H heads, value width V): 4 x 16 heads of
    V = 128 on an H200 (128 programs, 132 SMs) take narrow, the gdn-340M layer's 16 x 4 heads of V = 256 (256) their
    own. In Triton's interpreter a device counts one multiprocessor, so there only a one-program pass takes
    `narrow`."""
    programs = cdiv(V, tile_width(own.BV, V)) * N * H
    return narrow if programs <= multiprocessors else own



def pair_state_passes(programs: int, multiprocessors: int) -> bool:
    """Whether the backward pass runs the forward state pass again beside the reverse pass, in one launch (of twice
    the programs), rather than after it: where one pass's `programs` are no more than the GPU's multiprocessors, each
    program is a chain of steps waiting on one another and most of the GPU idles, so the two passes take little more
    than the longer one. On an H100, the long single sequence (1 x 32768 x 8 heads, 32 programs a pass) took 0.65x the
    time of the two launches; 4 x 8192 x 16 heads (256 programs a pass) 1.18x, where the two filled the GPU already
    (benchmarks/results/2026-12-06-session5-h100.md)."""
    return programs <= multiprocessors
