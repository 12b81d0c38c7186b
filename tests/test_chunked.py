"""The chunked-recurrence core (fabric_lin/ops/chunked/): the chunk layout and the input checks that every family's
ops share, asked of both families."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as the kernel tests set it, before any kernel is defined

import pytest  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fabric_lin.ops.chunked.chunk_index import chunk_state_offset, sequence_state_offset  # noqa: E402
from fabric_lin.ops.chunked.layout import CHUNK_SIZE, chunk_layout, private_offsets  # noqa: E402
from fabric_lin.ops.gdn import (  # noqa: E402
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule_step,
    naive_recurrent_gated_delta_rule,
)
from fabric_lin.ops.gla import (  # noqa: E402
    chunk_gla,
    chunk_gla_from_logits,
    fused_recurrent_gla_step,
    log_decay,
    naive_recurrent_gla,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter runs kernels on CPU tensors


def test_chunk_layout_of_documents():
    # documents of 1, 64, 65 and 0 rows: one chunk, one, two and none; each chunk numbered over all documents
    cu = torch.tensor([0, 1, 65, 130, 130], dtype=torch.int32)
    layout = chunk_layout(cu, 1, 130)
    assert CHUNK_SIZE == 64
    assert (layout.sequences, layout.chunks) == (4, 4)
    assert layout.chunk_indices.tolist() == [0, 0, 1, 0, 2, 0, 2, 1]  # (document, chunk in it) pairs
    assert layout.chunk_offsets.tolist() == [0, 1, 2, 4, 4]
    assert chunk_layout(None, 3, 130) == (3, 9, None, None)  # 3 sequences of 3 chunks, no index tensors


def test_chunk_layout_of_private_offsets_met_again_is_read_once_and_again_after_they_are_written(monkeypatch):
    """Every layer passes the same offsets, the model's private copy: they are read from the device once; offsets
    written in place since (their version moved) or other offsets are read anew."""
    from fabric_lin.ops.chunked import layout as layout_module

    reads = []
    read = layout_module.documents_layout
    monkeypatch.setattr(layout_module, "documents_layout", lambda cu, T, BT: reads.append(cu.tolist()) or read(cu, T, BT))
    cu = private_offsets(torch.tensor([0, 1, 65, 130]))
    assert cu.dtype == torch.int32
    first = chunk_layout(cu, 1, 130)
    assert all(chunk_layout(cu, 1, 130) is first for _ in range(3)) and reads == [[0, 1, 65, 130]]
    cu[1:3] = torch.tensor([64, 128])  # written in place: documents of 64, 64 and 2 rows
    again = chunk_layout(cu, 1, 130)
    assert again.chunk_indices.tolist() == [0, 0, 1, 0, 2, 0] and again.chunk_offsets.tolist() == [0, 1, 2, 3]
    other = private_offsets(torch.tensor([0, 130], dtype=torch.int32))
    assert chunk_layout(other, 1, 130).chunk_offsets.tolist() == [0, 3]
    assert chunk_layout(cu, 1, 130) is again  # still among the recent ones
    assert reads == [[0, 1, 65, 130], [0, 64, 128, 130], [0, 130]]


def test_offsets_the_caller_holds_are_read_at_every_call(monkeypatch):
    """A caller's offsets may be written between two calls without moving their version (through .data, or a NumPy
    view): a layout made of them before would send the kernels past the documents' ends. (Kept by identity and
    version, the layout of the first offsets was used for the second.)"""
    cu = torch.tensor([0, 65, 130], dtype=torch.int32)  # documents of 65 and 65 rows: chunks (0, 0), (0, 1), (1, 0), (1, 1)
    assert chunk_layout(cu, 1, 130).chunk_indices.tolist() == [0, 0, 0, 1, 1, 0, 1, 1]
    cu.data.copy_(torch.tensor([0, 1, 130]))  # 1 and 129 rows: (0, 0), (1, 0), (1, 1), (1, 2)
    assert chunk_layout(cu, 1, 130).chunk_indices.tolist() == [0, 0, 1, 0, 1, 1, 1, 2]
    cu.numpy()[1] = 129  # 129 and 1 rows
    assert chunk_layout(cu, 1, 130).chunk_indices.tolist() == [0, 0, 0, 1, 0, 2, 1, 0]


def test_chunk_gla_follows_offsets_rewritten_through_data():
    """The op on a caller's cu_seqlens buffer, filled anew through .data between two calls, against the fp64
    recurrence on the new offsets (with the first call's layout the kernels wrote outside the output: a corrupted heap)."""
    from conftest import gated_linear_attention_fp64, gla_inputs

    q, k, v, gk, _ = gla_inputs(1, 130, 1, 16, 16)
    cu = torch.tensor([0, 65, 130], dtype=torch.int32)
    first, _ = chunk_gla(q, k, v, gk, cu_seqlens=cu, backend="triton")
    cu.data.copy_(torch.tensor([0, 1, 130]))
    second, _ = chunk_gla(q, k, v, gk, cu_seqlens=cu, backend="triton")
    reference, _ = gated_linear_attention_fp64(q, k, v, gk, cu_seqlens=cu)
    torch.testing.assert_close(second.double(), reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(first, second)


def test_chunk_layout_of_a_tensor_met_again_with_another_length_or_chunk_size_is_made_anew():
    # documents of 1, 64 and 65 rows: in chunks of 32 rows one, two and three chunks; the same offsets are no
    # sequence of 100 rows (the length they end at is checked again)
    cu = torch.tensor([0, 1, 65, 130], dtype=torch.int32)
    assert chunk_layout(cu, 1, 130).chunk_offsets.tolist() == [0, 1, 2, 4]
    assert chunk_layout(cu, 1, 130, BT=32).chunk_offsets.tolist() == [0, 1, 3, 6]
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to T = 100"):
        chunk_layout(cu, 1, 100)


def test_chunk_layout_keeps_the_layouts_of_the_last_few_private_offsets(monkeypatch):
    """The layouts of the most recent private offsets are kept; the oldest are dropped for new ones (the cache holds
    each tensor, so it must not grow with every batch's cu_seqlens)."""
    from fabric_lin.ops.chunked import layout as layout_module

    monkeypatch.setattr(layout_module, "_RECENT_LAYOUTS", [])
    reads = []
    read = layout_module.documents_layout
    monkeypatch.setattr(layout_module, "documents_layout", lambda cu, T, BT: reads.append(cu.tolist()) or read(cu, T, BT))
    kept = layout_module._RECENT_KEPT
    tensors = [private_offsets(torch.tensor([0, n + 1, 130])) for n in range(kept)]
    for cu in tensors * 2:
        chunk_layout(cu, 1, 130)
    assert len(reads) == kept  # as many as are kept: each read once
    newest = private_offsets(torch.tensor([0, kept + 1, 130]))
    chunk_layout(newest, 1, 130)
    chunk_layout(newest, 1, 130)
    assert len(reads) == kept + 1  # the newest is kept
    chunk_layout(tensors[0], 1, 130)
    assert reads[-1] == [0, 1, 130] and len(reads) == kept + 2  # the oldest was dropped for it


@pytest.mark.parametrize("bounds", [[0, 4, 9], [1, 10], [0, 6, 4, 10], [0, 5, 4, 10]])  # the last falls by one row
def test_chunk_layout_refuses_offsets_that_do_not_rise_from_0_to_T(bounds):
    with pytest.raises(ValueError, match=rf"cu_seqlens must rise from 0 to T = 10 without falling, got \[{bounds[0]}, "):
        chunk_layout(torch.tensor(bounds), 1, 10)


# ------------------------------------------------------------------------------------ the kernels' state offsets


@triton.jit
def _state_offsets_kernel(indices, offsets, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """offsets[2 i], offsets[2 i + 1] <- the chunk and sequence state offsets of (chunk or sequence, head)
    indices[2 i], indices[2 i + 1], loaded as the kernels have them: int32."""
    i = tl.program_id(0)
    index, i_h = tl.load(indices + 2 * i), tl.load(indices + 2 * i + 1)
    tl.store(offsets + 2 * i, chunk_state_offset(index, i_h, H, K, V))
    tl.store(offsets + 2 * i + 1, sequence_state_offset(index * H + i_h, K, V))


@pytest.mark.parametrize("H, K, V, pairs", [
    (32, 128, 256, [(3, 1), (2047, 31), (2048, 0), (2100, 5)]),  # chunk 2048 (past 131,072 tokens) starts at 2^31
    (64, 512, 512, [(16383, 63), (8192, 17)]),  # the last chunk and head of 1M tokens (or of 16,384 documents)
])
def test_state_offsets_past_2_to_the_31_are_exact(H, K, V, pairs):
    """Per-chunk states [chunks, H, K, V] and initial or final states [N, H, K, V] pass 2^31 elements at sizes trained
    at; their offsets, from int32 indices, are exact (as int32 products they wrap and address other memory)."""
    indices = torch.tensor(pairs, dtype=torch.int32, device=DEVICE).view(-1)
    offsets = torch.zeros(2 * len(pairs), dtype=torch.int64, device=DEVICE)
    _state_offsets_kernel[(len(pairs),)](indices, offsets, H, K, V)
    expected = [(c * H + h) * K * V for c, h in pairs for _ in ("chunk", "sequence")]
    assert offsets.tolist() == expected


# ------------------------------------------------------------------------------------ input checks


def inputs(B=2, T=10, H=2, K=8, V=6):
    return dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, V))


def call(family, backend, q, k, v, gate=None, initial_state=None, cu_seqlens=None, output_final_state=False, beta=None):
    B, T, H, K = q.shape if q.dim() == 4 else (2, 10, 2, 8)
    kwargs = dict(initial_state=initial_state, cu_seqlens=cu_seqlens, output_final_state=output_final_state,
                  backend=backend)
    if family == "gla":
        gk = -torch.rand(B, T, H, K) if gate is None else gate
        return chunk_gla(q, k, v, gk, **kwargs)
    if family == "gla_from_logits":
        return chunk_gla_from_logits(q, k, v, torch.randn(B, T, H, K) if gate is None else gate, **kwargs)
    g = -torch.rand(B, T, H) if gate is None else gate
    return chunk_gated_delta_rule(q, k, v, g, torch.rand(B, T, H) if beta is None else beta, **kwargs)


OPS = {"gla": "chunk_gla", "gla_from_logits": "chunk_gla_from_logits", "gdn": "chunk_gated_delta_rule"}
GATES = {"gla": "gk", "gla_from_logits": "gate_logits", "gdn": "g"}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["gla", "gla_from_logits", "gdn"])
def test_both_families_name_the_same_mistakes_alike(family, backend):
    # each message: the op, the tensor, the shape (or dtype) given and the one expected; checked before either path
    # runs, so the kernels never see them
    op, x = OPS[family], inputs()
    cases = [
        (dict(x, q=torch.randn(2, 10, 16)), r"q must be \[B, T, H, K\], got shape \(2, 10, 16\)"),
        (dict(x, k=torch.randn(2, 10, 2, 9)), r"k must be \[B, T, H, K\] = \(2, 10, 2, 8\) like q, got shape \(2, 10, 2, 9\)"),
        (dict(x, v=torch.randn(2, 11, 2, 6)), r"v must be \[B, T, H, V\] with \[B, T, H\] = \(2, 10, 2\), got shape \(2, 11, 2, 6\)"),
        (dict(x, v=torch.randn(2, 10, 2, 6).double()), r"q, k and v must share a dtype, got torch.float32, torch.float32, torch.float64"),
        (dict(x, k=torch.ones(2, 10, 2, 8, dtype=torch.int64)), r"k must be a floating-point tensor, got torch.int64"),
        (dict(x, initial_state=torch.zeros(2, 2, 6, 8)), r"initial_state must be \[N, H, K, V\] = \(2, 2, 8, 6\) \(N = batch size\), got shape \(2, 2, 6, 8\)"),
        (dict(x, initial_state=torch.zeros(2, 2, 8, 6).bfloat16()), r"initial_state must be float32 \(the state is carried in fp32\), got torch.bfloat16"),
        (dict(x, cu_seqlens=torch.tensor([0, 4, 10])), r"cu_seqlens needs batch size 1 \(documents packed along T\), got B = 2"),
        (dict(inputs(B=1), cu_seqlens=torch.tensor([0.0, 10.0])), r"cu_seqlens must be a 1-D integer tensor of N\+1 >= 2 document offsets, got torch.float32 of shape \(2,\)"),
        (dict(inputs(B=1), cu_seqlens=torch.tensor([0, 1, 1], dtype=torch.bool)), r"cu_seqlens must be a 1-D integer tensor of N\+1 >= 2 document offsets, got torch.bool of shape \(3,\)"),
        (dict(inputs(B=1), cu_seqlens=[0, 4, 10]), r"cu_seqlens must be a 1-D integer tensor of N\+1 >= 2 document offsets, got a list"),
        (dict(inputs(B=1), cu_seqlens=torch.tensor([0, 2, 5, 10]), initial_state=torch.zeros(1, 2, 8, 6)),
         r"initial_state must be \[N, H, K, V\] = \(3, 2, 8, 6\) \(N = documents in cu_seqlens\), got shape \(1, 2, 8, 6\)"),
    ]
    gate_shape = "[B, T, H, K] = (2, 10, 2, 8) like q (one value per key column)" if family != "gdn" else \
        "[B, T, H] = (2, 10, 2) (one value per head and token)"
    cases.append((dict(x, gate=torch.randn(2, 10, 2, 8, 1)),
                  rf"{GATES[family]} must be {gate_shape}".replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                  .replace(")", r"\)") + r", got shape \(2, 10, 2, 8, 1\)"))
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=f"^{op}: {message}$"):
            call(family, backend, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["gla", "gdn"])
def test_both_families_read_document_offsets_alike(family, backend):
    # the offsets' values, checked where the op reads them (the chunk layout, the PyTorch path's documents)
    x = inputs(B=1)
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to T = 10 without falling, got \[0, 6, 4, 10\]"):
        call(family, backend, **x, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decoding_steps_name_their_mistakes_alike(backend):
    B, H, K, V = 2, 3, 16, 32
    q, k, v = torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, H, V)
    state = torch.zeros(B, H, K, V)
    with pytest.raises(ValueError, match=r"^fused_recurrent_gla_step: k must be \[B, H, K\] = \(2, 3, 16\) like q, got shape \(2, 3, 8\)$"):
        fused_recurrent_gla_step(q, k[..., :8], v, -torch.rand(B, H, K), state, backend=backend)
    with pytest.raises(ValueError, match=r"^fused_recurrent_gated_delta_rule_step: k must be \[B, H, K\] = \(2, 3, 16\) like q, got shape \(2, 3, 8\)$"):
        fused_recurrent_gated_delta_rule_step(q, k[..., :8], v, -torch.rand(B, H), torch.rand(B, H), state, backend=backend)
    with pytest.raises(ValueError, match=r"^fused_recurrent_gla_step: gk must be \[B, H, K\] = \(2, 3, 16\) like q, got shape \(2, 3\)$"):
        fused_recurrent_gla_step(q, k, v, -torch.rand(B, H), state, backend=backend)
    with pytest.raises(ValueError, match=r"^fused_recurrent_gla_step: state must be \[B, H, K, V\] = \(2, 3, 16, 32\), got shape \(2, 3, 32, 16\)$"):
        fused_recurrent_gla_step(q, k, v, -torch.rand(B, H, K), state.transpose(-1, -2), backend=backend)


# ------------------------------------------------------------------------------------ the kernel ops' fake functions


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernels run in the interpreter on CPU tensors")
def test_kernel_ops_fake_functions_give_the_real_outputs_shapes_and_dtypes():
    """torch.compile shapes the ops' outputs by their fake functions alone: each must give what the kernels return.
    float16 inputs (the states stay fp32, the outputs follow the inputs), documents packed with initial states and a
    final state's gradient, so that every output is there and N comes from cu_seqlens."""
    import torch.nn.functional as F

    from fabric_lin.ops.gdn.chunk import chunk_gdn_bwd, chunk_gdn_fwd
    from fabric_lin.ops.gdn.launch import SHIPPED as GDN_SHIPPED
    from fabric_lin.ops.gla.chunk import chunk_gla_bwd, chunk_gla_fwd
    from fabric_lin.ops.gla.launch import SHIPPED as GLA_SHIPPED
    from fabric_lin.ops.launch import launch_json

    def check(kernel_op, *args):
        torch.library.opcheck(kernel_op.op, args, test_utils="test_faketensor")

    T, H, K, V = 40, 1, 16, 32
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, T, H, K, generator=g).half() for _ in range(2))
    v, do = (torch.randn(1, T, H, V, generator=g).half() for _ in range(2))
    cu = torch.tensor([0, 15, T], dtype=torch.int32)
    h0, dht = (torch.randn(2, H, K, V, generator=g) for _ in range(2))
    scale = K**-0.5

    gk = F.logsigmoid(torch.randn(1, T, H, K, generator=g)) / 16
    launch = launch_json(None, GLA_SHIPPED)
    check(chunk_gla_fwd, q, k, v, gk, h0, cu, scale, None, launch)
    _, _, gc, A = chunk_gla_fwd.fn(q, k, v, gk, h0, cu, scale, None, launch)
    check(chunk_gla_bwd, q, k, v, gc, A, h0, cu, do, dht, scale, None, launch)

    gate, beta = -torch.rand(1, T, H, generator=g), torch.rand(1, T, H, generator=g).half()
    launch = launch_json(None, GDN_SHIPPED)
    check(chunk_gdn_fwd, q, k, v, gate, beta, h0, cu, scale, True, launch)
    _, _, b, A_inv, q_n, k_n, q_rstd, k_rstd = chunk_gdn_fwd.fn(q, k, v, gate, beta, h0, cu, scale, True, launch)
    check(chunk_gdn_bwd, q_n, k_n, v, b, beta, A_inv, q_rstd, k_rstd, h0, cu, do, dht, scale, True, launch)


# ------------------------------------------------------------------------------------ edge cases of a library caller


def naive(family, q, k, v, gate, beta=None, **kwargs):
    """The family's naive recurrence (the oracle) on call()'s inputs."""
    if family == "gla":
        return naive_recurrent_gla(q, k, v, gate, **kwargs)
    if family == "gla_from_logits":
        return naive_recurrent_gla(q, k, v, log_decay(gate), **kwargs)
    return naive_recurrent_gated_delta_rule(q, k, v, gate, beta, **kwargs)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("family", ["gla", "gla_from_logits", "gdn"])
def test_no_tokens_give_no_output_and_the_initial_state(family, backend):
    """T = 0: no output rows, and the final state is the initial one, as the naive recurrence gives, with its gradient
    passed through. GLA's PyTorch path raised on stacking no chunks, and its kernels read a row before the first (a
    segmentation fault on the CPU)."""
    x = inputs(B=2, T=0)
    gate, beta = torch.empty(2, 0, 2, 8) if family != "gdn" else torch.empty(2, 0, 2), torch.empty(2, 0, 2)
    h0 = torch.randn(2, 2, 8, 6, requires_grad=True)
    o, ht = call(family, backend, **x, gate=gate, beta=beta, initial_state=h0, output_final_state=True)
    o_ref, ht_ref = naive(family, **x, gate=gate, beta=beta, initial_state=h0.detach(), output_final_state=True)
    assert o.shape == o_ref.shape == (2, 0, 2, 6) and o.dtype == o_ref.dtype
    assert torch.equal(ht, ht_ref)
    ht.pow(2).sum().backward()
    assert torch.equal(h0.grad, 2 * h0.detach())


@pytest.mark.parametrize("family", ["gla", "gla_from_logits", "gdn"])
def test_a_second_derivative_through_the_kernels_is_refused(family):
    """A gradient asked to be differentiable (create_graph=True: a gradient penalty, a Hessian-vector product) is the
    naive recurrence's on the PyTorch path, and refused on the kernels, whose backward pass is no autograd graph (the
    second derivative lacked the op's own part, silently)."""
    x = inputs(B=1, T=10)
    gate, beta = -torch.rand(1, 10, 2, 8) if family != "gdn" else -torch.rand(1, 10, 2), torch.rand(1, 10, 2)
    for backend in ("torch", "triton"):
        q = x["q"].clone().requires_grad_()
        o, _ = call(family, backend, **dict(x, q=q), gate=gate, beta=beta)
        if backend == "triton":
            with pytest.raises(RuntimeError, match=r"^Chunk\w*Function: the Triton kernels have no second derivative"):
                torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
        else:
            (dq,) = torch.autograd.grad(o.pow(2).sum(), q, create_graph=True)
            q_ref = x["q"].clone().requires_grad_()
            (dq_ref,) = torch.autograd.grad(naive(family, **dict(x, q=q_ref), gate=gate, beta=beta)[0].pow(2).sum(), q_ref,
                                            create_graph=True)
            (d2,), (d2_ref,) = torch.autograd.grad(dq.pow(2).sum(), q), torch.autograd.grad(dq_ref.pow(2).sum(), q_ref)
            torch.testing.assert_close(d2, d2_ref, rtol=1e-4, atol=1e-4)
