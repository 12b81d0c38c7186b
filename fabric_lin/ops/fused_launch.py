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
    """How the convolution's kernels are launched: which design (fabric_lin/ops/short_conv_triton.py) and its tiles
    of rows and channels, from ptxas's report for sm_90 at gdn-340M's shapes (bf16, W = 4, D = 512 and 1024;
    tests/test_short_conv.py prints it): the forward's [64 rows, 64 channels] takes 84 registers a thread (6
    programs of 4 warps per SM); on [32, 64] the backward's dz kernel takes 128 (4 programs per SM) and its dx
    kernel 68 (76 with cu_seqlens). The one-pass kernels on 256 channels, 8 rows a step: 37 (forward) and 72
    (backward; 64 and 96 with cu_seqlens) with Triton 3.6."""

    fwd_design: str = "tiles"
    """The forward's kernel: "tiles" (W shifted loads of each [fwd_rows, fwd_channels] tile of x) or "one_pass" (each
    block of rows walked in order, every input loaded once; on the one_pass_ settings)."""
    fwd_channels: int = 64
    """Channels per forward tile: 128 contiguous bytes of a bf16 row."""
    fwd_rows: int = 64
    bwd_channels: int = 64
    """Channels per tile of both backward kernels."""
    bwd_rows: int = 32
    bwd_row_tiles: int = 8
    """Row tiles per program of the backward's dz kernel: fewer dweight partial sums to write and add up."""
    bwd_design: str = "two_pass"
    """The backward's kernels: "two_pass" (the dz kernel, then the dx kernel, on the bwd_ tiles) or "one_pass" (one
    kernel walking each block of rows in order: x and dy read once, dx written once, nothing else in memory but
    the dweight partial sums; on the one_pass_ settings)."""
    one_pass_channels: int = 256
    """Channels per program of the one-pass kernels (a power of two): a row of them is one load per thread, 2
    channels (4 bytes of bf16) each at 256 channels and 4 warps. The backward took 168 registers at 512 channels
    (4 each, 8 rows a step)."""
    one_pass_rows: int = 128
    """Rows per program of the one-pass kernels, a multiple of one_pass_step: each block also reads the W - 1 rows
    before it (and, backward, after it) and writes one dweight partial sum."""
    one_pass_step: int = 8
    """Rows loaded at once by the one-pass kernels, all in flight before their arithmetic (the backward's registers:
    4 rows took 64 a thread at 256 channels, 16 rows 195 at 512)."""
    step_channels: int = 128
    """Channels per program of the decoding step."""
    warps: int = 4
    """Warps of every kernel."""

    def __post_init__(self):
        super().__post_init__()
        if self.fwd_design not in ("tiles", "one_pass"):
            raise ValueError(f"ShortConvLaunch.fwd_design must be 'tiles' or 'one_pass', got {self.fwd_design!r}")
        if self.bwd_design not in ("two_pass", "one_pass"):
            raise ValueError(f"ShortConvLaunch.bwd_design must be 'two_pass' or 'one_pass', got {self.bwd_design!r}")
        if self.one_pass_channels < 1 or self.one_pass_channels & (self.one_pass_channels - 1):
            raise ValueError(f"ShortConvLaunch.one_pass_channels must be a power of two, got {self.one_pass_channels}")
        if self.one_pass_step < 1 or self.one_pass_rows % self.one_pass_step:
            raise ValueError(f"ShortConvLaunch.one_pass_rows must be a multiple of one_pass_step (at least 1), got "
                             f"{self.one_pass_rows} and {self.one_pass_step}")


SHIPPED_SHORT_CONV = ShortConvLaunch()


@dataclass(frozen=True)
class CrossEntropyLaunch(LaunchBundle):
    """How the loss kernel (one program per row of logits) is launched."""

    vocab_tile: int = 4096
    """Logits per step of a row's loops (the vocabulary's next power of two where that is smaller)."""
    warps: int = 8


SHIPPED_CROSS_ENTROPY = CrossEntropyLaunch()
