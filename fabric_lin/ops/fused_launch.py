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
    """How the convolution's kernels (fabric_lin/ops/short_conv_triton.py) are launched: each program of the forward
    and backward walks `rows` rows of `channels` channels of one sequence, `rows_per_load` rows loaded at a time.
    Timed on an H100 (benchmarks/short_conv.py: bf16, 16 x 2048 rows, W = 4). ptxas's registers a thread for sm_90
    with Triton 3.8 at gdn-340M's shapes (tests/test_short_conv.py prints them): forward 64 (80 with cu_seqlens),
    backward 128, with or without cu_seqlens (134 and 150 with q, k and v side by side)."""

    channels: int = 512
    """Channels per program (a power of two): a row of them is one load per thread, 4 channels (8 bytes of bf16)
    each at 4 warps. gdn-340M convolves q, k and v side by side, 2048 channels: forward+backward 0.269 ms on 512
    channels a program against 0.316 on 256 (256 is faster at 512 channels alone: 0.095 against 0.105 ms)."""
    rows: int = 128
    """Rows per program, a multiple of rows_per_load: each block also reads the W - 1 rows before it (and, backward,
    after it) and writes one dweight partial sum."""
    rows_per_load: int = 8
    """Rows loaded at once, all in flight before their arithmetic (they cost the backward's registers: 4 rows took 56
    a thread at 256 channels, 16 rows 190 at 512)."""
    step_channels: int = 128
    """Channels per program of the decoding step."""
    warps: int = 4
    """Warps of every kernel."""

    def __post_init__(self):
        super().__post_init__()
        if self.channels < 1 or self.channels & (self.channels - 1):
            raise ValueError(f"ShortConvLaunch.channels must be a power of two, got {self.channels}")
        if self.rows_per_load < 1 or self.rows % self.rows_per_load:
            raise ValueError(f"ShortConvLaunch.rows must be a multiple of rows_per_load (at least 1), got {self.rows} "
                             f"and {self.rows_per_load}")


SHIPPED_SHORT_CONV = ShortConvLaunch()


@dataclass(frozen=True)
class CrossEntropyLaunch(LaunchBundle):
    """How the loss kernel (one program per row of logits) is launched."""

    vocab_tile: int = 4096
    """Logits per step of a row's loops (the vocabulary's next power of two where that is smaller)."""
    warps: int = 8


SHIPPED_CROSS_ENTROPY = CrossEntropyLaunch()
