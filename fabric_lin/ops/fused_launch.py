"""The launch settings of the fused single-kernel ops - the norms, SwiGLU, the short convolution and the
cross-entropy - as the recurrences' are in gla/launch.py and gdn/launch.py: frozen objects passed from the model
(`fabric_lin.model.Launches`), their defaults the shipped settings. Apart from the ops, so that both an op's
dispatch module and its Triton module read them."""
from dataclasses import dataclass

from fabric_lin.ops.launch import LaunchBundle


@dataclass(frozen=True)
class NormLaunch(LaunchBundle):
    """How the norm kernels are launched (one rule for every norm kernel, forward and backward)."""

    tile_elements: int = 1024
    """Elements per tile (rows of D elements, R = tile_elements // D of them, at least one), so that a program
    has several rows' loads in flight when rows are short (one 256-wide row per 1-warp program, GLA's
    per-head norm, left the backward pass at about half the memory bandwidth on an H200)."""
    elements_per_thread: int = 8
    """Of a tile (warps = tile_elements / (32 * elements_per_thread), 1 to 16): fewer hold fewer registers, so
    more programs fit on a multiprocessor."""
    bwd_programs_per_sm: int = 16
    """The backward's programs per multiprocessor, each looping over tiles and summing its rows' part of the
    weight's gradient once, at the end."""


SHIPPED_NORM = NormLaunch()


@dataclass(frozen=True)
class SwiGLULaunch(LaunchBundle):
    """How the SwiGLU kernels (forward and backward, elementwise) are launched."""

    block: int = 1024
    """Columns per program (one row's block)."""
    warps: int = 4


SHIPPED_SWIGLU = SwiGLULaunch()


@dataclass(frozen=True)
class ShortConvLaunch(LaunchBundle):
    """How the convolution's kernels are launched: tiles of rows and channels, from ptxas's report for sm_90 at
    gdn-340M's shapes (bf16, W = 4, D = 512 and 1024; tests/test_short_conv.py prints it): the
    forward's [64 rows, 64 channels] takes 84 registers a thread (6 programs of 4 warps per SM); on [32, 64] the
    backward's dz kernel takes 128 (4 programs per SM) and its dx kernel 68 (76 with cu_seqlens)."""

    fwd_channels: int = 64
    """Channels per forward tile: 128 contiguous bytes of a bf16 row."""
    fwd_rows: int = 64
    bwd_channels: int = 64
    """Channels per tile of both backward kernels."""
    bwd_rows: int = 32
    bwd_row_tiles: int = 8
    """Row tiles per program of the backward's dz kernel: fewer dweight partial sums to write and add up."""
    step_channels: int = 128
    """Channels per program of the decoding step."""
    warps: int = 4
    """Warps of every kernel."""


SHIPPED_SHORT_CONV = ShortConvLaunch()


@dataclass(frozen=True)
class CrossEntropyLaunch(LaunchBundle):
    """How the loss kernel (one program per row of logits) is launched."""

    vocab_tile: int = 4096
    """Logits per step of a row's loops (the vocabulary's next power of two where that is smaller)."""
    warps: int = 8


SHIPPED_CROSS_ENTROPY = CrossEntropyLaunch()
