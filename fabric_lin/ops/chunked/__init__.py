"""The chunked-recurrence core: what every linear-attention family's chunked form runs on, whatever its math.

    layout.py       CHUNK_SIZE (64 rows, every family and path); where the chunks of a batch or of packed
                    documents lie (`chunk_layout`; read once for all layers from a model's `private_offsets`), the
                    grid of a chunk-parallel launch, dtypes of dots and states
    chunk_index.py  inside the kernels: where a chunk's or a sequence's rows are (varlen included), and the tile,
                    gate and per-head loads that mask the rows past a sequence's end
    varlen.py       documents packed along T for the PyTorch paths and the oracles
    checks.py       every family's input checks (chunked ops and decoding steps), errors alike
    autograd.py     the autograd Function around a family's forward and backward kernel ops, and the call that
                    hands it the inputs as the kernels take them

A family (`fabric_lin/ops/gla/`, `fabric_lin/ops/gdn/`) holds its math: the naive oracle, the chunked PyTorch
path, its Triton kernels (the intra-chunk part and its inter-chunk state passes), its two kernel ops and its launch
settings (a `fabric_lin.ops.launch.LaunchBundle`). The custom-op plumbing every op uses is
`fabric_lin/ops/custom_op.py`.
"""
