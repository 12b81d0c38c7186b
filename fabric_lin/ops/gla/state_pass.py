"""The inter-chunk state pass of chunked linear attention with a per-key-column decay, forwards and backwards.

Per head, with b = the in-chunk cumulative log gate (`cumsum.py`) and b_last its value at a chunk's last row,
the state entering chunk n + 1 is

    S_{n+1} = exp(b_last) * S_n + (k * exp(b_last - b))^T v        (rows of chunk n; all exponents <= 0)

and, backwards, the gradient of the state leaving chunk n is dS_{n-1} = exp(b_last) * dS_n + (q scale exp(b))^T do.
Two ways to run it, chosen by how many programs the sequential form would have (`split_states`):

* sequential: one program per (key tile, value tile, sequence, head) loops over the chunks with the
  products inside, issuing chunk n + 1's loads before chunk n's products. The backward's two passes (the
  states recomputed forwards, their gradients backwards) are independent and share one launch.
* split, for long sequences with few heads (fewer programs than half the multiprocessors): each chunk's own
  term by a chunk-parallel kernel, then an elementwise scan over the chunks carried in fp32.

The decayed keys k * exp(b_last - b), which the backward's state recomputation and GLA's dv kernel both
read, reach the sequential pass in one of three forms (KD_FORM, KD_WRITE, KD_READ: formed from k and gc,
formed and written to kd, read from kd).
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from fabric_lin.ops.chunked.chunk_index import (
    chunk_start,
    chunk_state_offset,
    load_gate,
    load_gate_row,
    load_tile,
    sequence_state_offset,
    state_pass_start,
)
from fabric_lin.ops.chunked.layout import chunk_grid, dot_precision, state_dtype
from fabric_lin.ops.gla.cumsum import gate_cumsum
from fabric_lin.ops.gla.launch import GLALaunch
from fabric_lin.ops import launch as launch_helpers
from fabric_lin.ops.launch import KernelLaunch, cdiv, tile_width

KD_FORM, KD_WRITE, KD_READ = 0, 1, 2


@triton.jit
def _step_inputs(x, gate, y, i_t, bos, T, o_t, o_k, m_k, o_v, m_v, H: tl.constexpr, K: tl.constexpr,
                 V: tl.constexpr, BT: tl.constexpr, LAST_ONLY: tl.constexpr):
    """Chunk i_t's tiles for one step of a state pass, as loaded: x [BT, BK] and y [BT, BV] in their dtype, the
    cumulative gate [BT, BK] and its last row [BK]. LAST_ONLY: the gate's last row alone is read (x holds the
    decayed keys), the gate tile returned is zeros."""
    row0 = bos + i_t * BT
    n_rows = T - i_t * BT
    m_x = (o_t < n_rows)[:, None] & m_k[None, :]
    b_x = tl.load(x + (row0 + o_t[:, None]) * (H * K) + o_k[None, :], mask=m_x, other=0.0)
    if LAST_ONLY:
        b_gate = tl.zeros_like(b_x).to(tl.float32)
        b_last = load_gate_row(gate, row0, BT - 1, n_rows, H * K, o_k, m_k)
    else:
        b_gate = load_gate(gate, row0, o_t, n_rows, H * K, o_k, m_k)
        b_last = load_gate_row(gate, row0, BT - 1, n_rows, H * K, o_k, m_k)
    b_y = tl.load(y + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], mask=(o_t < n_rows)[:, None] & m_v[None, :], other=0.0)
    return b_x, b_gate, b_last, b_y


@triton.jit
def _state_pass(i_k, i_v, i_nh, k, v, gc, kd, h, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
                KD_MODE: tl.constexpr):
    """h[chunk n] = the state entering chunk n; ht = the state after the last chunk (fp32). The decayed keys
    k * exp(b_last - b) ([B*T, H, K], k's dtype): KD_MODE 0 forms them from k and gc, 1 forms them and writes
    them to kd (first value tile's programs), 2 reads them from kd (and of gc only each chunk's last row)."""
    i_h, bos, T, boh, NT, o_k, o_v, m_k, m_v, m_kv, state_offs, S = state_pass_start(
        i_k, i_v, i_nh, h0, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV, USE_H0, IS_VARLEN)
    o_t = tl.arange(0, BT)
    k += i_h * K
    gc += i_h * K
    v += i_h * V
    if KD_MODE == 2:
        keys = kd + i_h * K
    else:
        keys = k
    LAST_ONLY: tl.constexpr = KD_MODE == 2
    # the loads of chunk i_t + 1 are issued before chunk i_t's products, so they overlap them
    n_k, n_gate, n_last, n_v = _step_inputs(keys, gc, v, 0, bos, T, o_t, o_k, m_k, o_v, m_v, H, K, V, BT, LAST_ONLY)
    for i_t in range(NT):
        b_k, b_g, b_last, b_v = n_k, n_gate, n_last, n_v
        n_k, n_gate, n_last, n_v = _step_inputs(keys, gc, v, tl.minimum(i_t + 1, NT - 1), bos, T, o_t, o_k, m_k,
                                                o_v, m_v, H, K, V, BT, LAST_ONLY)
        tl.store(h + chunk_state_offset(boh + i_t, i_h, H, K, V) + state_offs, S.to(h.dtype.element_ty), mask=m_kv)
        if KD_MODE == 2:
            k_end = b_k.to(b_v.dtype)
        else:
            k_end = (b_k.to(tl.float32) * tl.exp(tl.minimum(b_last[None, :] - b_g, 0.0))).to(b_v.dtype)
            if KD_MODE == 1:
                if i_v == 0:
                    kd_offs = i_h * K + (bos + i_t * BT + o_t[:, None]) * (H * K) + o_k[None, :]
                    tl.store(kd + kd_offs, k_end.to(kd.dtype.element_ty), mask=(o_t < T - i_t * BT)[:, None] & m_k[None, :])
        S = S * tl.exp(b_last)[:, None] + tl.dot(tl.trans(k_end), b_v, input_precision=DOT_PREC)
    if STORE_HT:
        tl.store(ht + sequence_state_offset(i_nh, K, V) + state_offs, S, mask=m_kv)


@triton.jit
def _fwd_state_kernel(k, v, gc, h, h0, ht, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    _state_pass(tl.program_id(0), tl.program_id(1), tl.program_id(2), k, v, gc, k, h, h0, ht, cu_seqlens,
                chunk_offsets, T, H, K, V, BT, BK, BV, USE_H0, True, IS_VARLEN, DOT_PREC, 0)


@triton.jit
def _dstate_pass(i_k, i_v, i_nh, q, gc, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                 USE_DHT: tl.constexpr, USE_H0: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr):
    """dh[chunk n] = gradient of the state leaving chunk n; dh0 = gradient of the initial state."""
    i_h, bos, T, boh, NT, o_k, o_v, m_k, m_v, m_kv, state_offs, dS = state_pass_start(
        i_k, i_v, i_nh, dht, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV, USE_DHT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    q += i_h * K
    gc += i_h * K
    do += i_h * V
    # as in _state_pass, chunk i_t - 1's loads overlap chunk i_t's products
    n_q, n_g, n_last, n_do = _step_inputs(q, gc, do, NT - 1, bos, T, o_t, o_k, m_k, o_v, m_v, H, K, V, BT, False)
    for i in range(NT):
        i_t = NT - 1 - i
        b_q, b_g, b_last, b_do = n_q, n_g, n_last, n_do
        n_q, n_g, n_last, n_do = _step_inputs(q, gc, do, tl.maximum(i_t - 1, 0), bos, T, o_t, o_k, m_k, o_v, m_v,
                                              H, K, V, BT, False)
        tl.store(dh + chunk_state_offset(boh + i_t, i_h, H, K, V) + state_offs, dS.to(dh.dtype.element_ty), mask=m_kv)
        q_dec = (b_q.to(tl.float32) * (tl.exp(b_g) * scale)).to(b_do.dtype)
        dS = dS * tl.exp(b_last)[:, None] + tl.dot(tl.trans(q_dec), b_do, input_precision=DOT_PREC)
    if USE_H0:
        tl.store(dh0 + sequence_state_offset(i_nh, K, V) + state_offs, dS, mask=m_kv)


@triton.jit
def _bwd_both_states_kernel(q, k, v, gc, kd, do, h, dh, h0, dht, dh0, cu_seqlens, chunk_offsets, scale, T, NH,
                            H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                            BV: tl.constexpr, USE_H0: tl.constexpr, USE_DHT: tl.constexpr, IS_VARLEN: tl.constexpr,
                            DOT_PREC: tl.constexpr, KD_MODE: tl.constexpr):
    """The backward pass's two sequential passes in one launch: programs i_p < NH recompute the states h
    (forward over the chunks; the decayed keys as KD_MODE says, see _state_pass), the others the state
    gradients dh (backward over the chunks). They are independent, so each fills the multiprocessors while
    the other waits on its loads."""
    i_k, i_v, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if i_p < NH:
        _state_pass(i_k, i_v, i_p, k, v, gc, kd, h, h0, h0, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV,
                    USE_H0, False, IS_VARLEN, DOT_PREC, KD_MODE)
    else:
        _dstate_pass(i_k, i_v, i_p - NH, q, gc, do, dh, dht, dh0, cu_seqlens, chunk_offsets, scale, T, H, K, V,
                     BT, BK, BV, USE_DHT, USE_H0, IS_VARLEN, DOT_PREC)


@triton.jit
def _chunk_update_kernel(x, y, g, gc, u, cu_seqlens, chunk_indices, scale, T, H: tl.constexpr, K: tl.constexpr,
                         V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         REVERSE: tl.constexpr, STORE_GC: tl.constexpr, IS_VARLEN: tl.constexpr,
                         DOT_PREC: tl.constexpr):
    """One chunk's own term of the state recurrence (fp32 products, stored in u's dtype) into u[chunk]:
    forward (x=k, y=v):  (k * exp(b_last - b))^T v;   reverse (x=q, y=do):  (q * scale * exp(b))^T do.
    With STORE_GC, gc is computed from g here (by the programs of the first value tile)."""
    i_kv, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_k, i_v = i_kv // tl.cdiv(V, BV), i_kv % tl.cdiv(V, BV)
    i_h = i_bh % H
    row0, n_rows, i_tg = chunk_start(i_c, i_bh, cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)
    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    x += i_h * K
    gc += i_h * K
    y += i_h * V
    b_x = load_tile(x, row0, o_t, n_rows, H * K, o_k, m_k)
    if STORE_GC:
        g += i_h * K
        b_graw = load_tile(g, row0, o_t, n_rows, H * K, o_k, m_k)
        b_g = tl.cumsum(b_graw, axis=0)
        b_last = tl.sum(b_graw, axis=0)
        if i_v == 0:
            tl.store(gc + (row0 + o_t[:, None]) * (H * K) + o_k[None, :], b_g, mask=(o_t < n_rows)[:, None] & m_k[None, :])
    else:
        b_g = load_gate(gc, row0, o_t, n_rows, H * K, o_k, m_k)
        b_last = load_gate_row(gc, row0, BT - 1, n_rows, H * K, o_k, m_k)
    b_y = tl.load(y + (row0 + o_t[:, None]) * (H * V) + o_v[None, :], mask=(o_t < n_rows)[:, None] & m_v[None, :], other=0.0)
    if REVERSE:
        b_x = b_x * (tl.exp(b_g) * scale)
    else:
        b_x = b_x * tl.exp(tl.minimum(b_last[None, :] - b_g, 0.0))
    b_u = tl.dot(tl.trans(b_x.to(b_y.dtype)), b_y, input_precision=DOT_PREC)
    tl.store(u + chunk_state_offset(i_tg, i_h, H, K, V) + o_k[:, None] * V + o_v[None, :],
             b_u.to(u.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _scan_load(hu, gc, idx, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Step idx of the scan: (u of its chunk, b_last of its chunk, offsets into hu, whether idx < NT)."""
    ok = idx < NT
    if REVERSE:
        i_t = NT - 1 - idx
    else:
        i_t = idx
    offs = chunk_state_offset(boh + i_t, 0, H, K, V) + state_offs  # hu is at the program's head
    b_u = tl.load(hu + offs, mask=m_kv & ok, other=0.0).to(tl.float32)
    last_row = bos + i_t * BT + tl.minimum(BT, T - i_t * BT) - 1
    b_last = tl.load(gc + last_row * (H * K) + o_k, mask=m_k & ok, other=0.0)
    return b_u, b_last, offs, ok


@triton.jit
def _scan_load4(hu, gc, i0, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr):
    """_scan_load of steps i0 .. i0 + 3, their loads issued together."""
    u0, d0, offs0, ok0 = _scan_load(hu, gc, i0, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    u1, d1, offs1, ok1 = _scan_load(hu, gc, i0 + 1, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    u2, d2, offs2, ok2 = _scan_load(hu, gc, i0 + 2, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    u3, d3, offs3, ok3 = _scan_load(hu, gc, i0 + 3, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    return u0, d0, offs0, ok0, u1, d1, offs1, ok1, u2, d2, offs2, ok2, u3, d3, offs3, ok3


@triton.jit
def _state_scan_kernel(hu, gc, s0, s_final, cu_seqlens, chunk_offsets, T, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BT: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr,
                       USE_S0: tl.constexpr, STORE_FINAL: tl.constexpr, REVERSE: tl.constexpr,
                       IS_VARLEN: tl.constexpr):
    """In place over hu [chunks, H, K, V] (fp32, or the inputs' dtype: the state is carried in fp32 either
    way): reads chunk n's own term u_n, writes the state S that chunk n sees, S <- exp(b_last,n) * S + u_n.
    Forward S starts at s0 (h0) and runs over the chunks in order; REVERSE starts at dht and runs backwards
    (then hu[n] is the gradient of the state after chunk n). s_final gets the last S (final state, or dh0)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, bos, T, boh, NT, o_k, o_v, m_k, m_v, m_kv, state_offs, S = state_pass_start(
        i_k, i_v, i_nh, s0, cu_seqlens, chunk_offsets, T, H, K, V, BT, SK, SV,
        USE_S0, IS_VARLEN)
    gc += i_h * K
    hu += i_h * K * V  # int32 fits: one chunk's states, H * K * V <= 2^24
    # four chunks per step, whose loads are issued together and one step ahead: before the stores of the
    # step in hand, which write the same buffer and would otherwise keep each load waiting for them (eight
    # loads in flight); past the end they read as zero
    (n_u0, n_d0, n_offs0, n_ok0, n_u1, n_d1, n_offs1, n_ok1, n_u2, n_d2, n_offs2, n_ok2,
     n_u3, n_d3, n_offs3, n_ok3) = _scan_load4(hu, gc, 0, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V, BT, REVERSE)
    for i0 in range(0, NT, 4):
        u0, d0, offs0, ok0 = n_u0, n_d0, n_offs0, n_ok0
        u1, d1, offs1, ok1 = n_u1, n_d1, n_offs1, n_ok1
        u2, d2, offs2, ok2 = n_u2, n_d2, n_offs2, n_ok2
        u3, d3, offs3, ok3 = n_u3, n_d3, n_offs3, n_ok3
        (n_u0, n_d0, n_offs0, n_ok0, n_u1, n_d1, n_offs1, n_ok1, n_u2, n_d2, n_offs2, n_ok2,
         n_u3, n_d3, n_offs3, n_ok3) = _scan_load4(hu, gc, i0 + 4, NT, boh, bos, T, state_offs, m_kv, o_k, m_k, H, K, V,
                                                   BT, REVERSE)
        tl.store(hu + offs0, S.to(hu.dtype.element_ty), mask=m_kv & ok0)
        S = S * tl.exp(d0)[:, None] + u0
        tl.store(hu + offs1, S.to(hu.dtype.element_ty), mask=m_kv & ok1)
        S = S * tl.exp(d1)[:, None] + u1
        tl.store(hu + offs2, S.to(hu.dtype.element_ty), mask=m_kv & ok2)
        S = S * tl.exp(d2)[:, None] + u2
        tl.store(hu + offs3, S.to(hu.dtype.element_ty), mask=m_kv & ok3)
        S = S * tl.exp(d3)[:, None] + u3
    if STORE_FINAL:
        tl.store(s_final + sequence_state_offset(i_nh, K, V) + state_offs, S, mask=m_kv)


# ------------------------------------------------------------------------------------------ host side


def sequential_programs(K: int, V: int, N: int, H: int, state: KernelLaunch) -> int:
    """Programs of one sequential state pass: one per (key tile, value tile, sequence, head)."""
    return cdiv(K, tile_width(state.BK, K)) * cdiv(V, tile_width(state.BV, V)) * N * H


def split_states(K: int, V: int, N: int, H: int, device: torch.device, state: KernelLaunch) -> bool:
    """Whether the pass runs as chunk-parallel updates and a scan: where the sequential form would leave more
    than half the multiprocessors idle (never in the interpreter, which counts one)."""
    return 2 * sequential_programs(K, V, N, H, state) < launch_helpers.multiprocessors(device)


def state_warps(K: int, V: int, N: int, H: int, device: torch.device, state: KernelLaunch, passes: int = 1) -> int:
    """Warps of a sequential launch of `passes` passes: state.warps, or where that is None 8 when the launch
    has no more programs than the GPU has multiprocessors (one program per SM: twice the threads to keep its
    loads and products going), else 4 (two programs per SM)."""
    if state.warps is not None:
        return state.warps
    return 8 if passes * sequential_programs(K, V, N, H, state) <= launch_helpers.multiprocessors(device) else 4


def takes_decayed_keys(K: int, V: int, N: int, H: int, device: torch.device, state: KernelLaunch) -> bool:
    """Whether the decayed keys may be written once and read (by the state passes and GLA's dv kernel): only
    for the sequential pass over value tiles at least 64 wide. Over 32-wide ones (V = 32) the forms that
    write or read them gave infinite gradients or an illegal memory access on an H200 (Triton 3.6, bf16),
    where each kernel forming them from k and gc is right."""
    return tile_width(state.BV, V) >= 64 and not split_states(K, V, N, H, device, state)


def _scan(hu, gc, s0, s_final, cu_seqlens, layout, T, BT, reverse, scan: KernelLaunch):
    N, chunk_offsets = layout.sequences, layout.chunk_offsets
    H, K, V = hu.shape[1:]
    SK, SV = tile_width(scan.BK, K), tile_width(scan.BV, V)
    _state_scan_kernel[(cdiv(K, SK), cdiv(V, SV), N * H)](
        hu, gc, s0, s_final, cu_seqlens, chunk_offsets, T, H, K, V, BT, SK, SV,
        USE_S0=s0 is not None, STORE_FINAL=s_final is not None, REVERSE=reverse, IS_VARLEN=cu_seqlens is not None,
        **scan.options(),
    )


def _chunk_updates(x, y, g, gc, scale, cu_seqlens, layout, BT, reverse, dtype, state: KernelLaunch, warps: int):
    """[chunks, H, K, V] in `dtype`: each chunk's own term of the (reverse) state recurrence, in the tiles of the
    sequential pass it stands for (`state`), on `warps` warps."""
    B, T, H, K = x.shape
    V = y.shape[-1]
    NC, chunk_indices = layout.chunks, layout.chunk_indices
    BK, BV = tile_width(state.BK, K), tile_width(state.BV, V)
    u = x.new_empty(NC, H, K, V, dtype=dtype)
    grid = (cdiv(K, BK) * cdiv(V, BV),) + chunk_grid(cu_seqlens, layout, T, B, H, BT)
    _chunk_update_kernel[grid](
        x, y, g, gc, u, cu_seqlens, chunk_indices, scale, T, H, K, V, BT, BK, BV,
        REVERSE=reverse, STORE_GC=g is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(x.dtype), num_warps=warps, num_stages=1,
    )
    return u


def states(k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], gc: torch.Tensor,
           initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], layout, BT: int,
           launch: GLALaunch):
    """(per-chunk states h [chunks, H, K, V], the state entering each chunk; final state [N, H, K, V] fp32).
    With g given (the per-row log gate), gc is filled from it first (by the chunk-parallel updates where the
    pass is split, else by the gate cumsum's own launch); without, gc is read."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    N, NC, _, chunk_offsets = layout
    state = launch.state
    ht = k.new_empty(N, H, K, V, dtype=torch.float32)
    if split_states(K, V, N, H, k.device, state):
        h = _chunk_updates(k, v, g, gc, 1.0, cu_seqlens, layout, BT, False, state_dtype(k, initial_state is not None),
                           state, launch.updates_warps)
        _scan(h, gc, initial_state, ht, cu_seqlens, layout, T, BT, False, launch.scan)
        return h, ht
    if g is not None:
        # inside the sequential pass the cumsum would add its latency to every one of the pass's steps
        gate_cumsum(g, gc, cu_seqlens, layout, BT, launch.cumsum)
    BK, BV = tile_width(state.BK, K), tile_width(state.BV, V)
    h = k.new_empty(NC, H, K, V, dtype=state_dtype(k, initial_state is not None))
    _fwd_state_kernel[(cdiv(K, BK), cdiv(V, BV), N * H)](
        k, v, gc, h, initial_state, ht, cu_seqlens, chunk_offsets, T, H, K, V, BT, BK, BV,
        USE_H0=initial_state is not None, IS_VARLEN=cu_seqlens is not None, DOT_PREC=dot_precision(k.dtype),
        **state.options(state_warps(K, V, N, H, k.device, state)),
    )
    return h, ht


def split_state_grads(q, gc, do, dht, initial_state, scale, cu_seqlens, layout, BT, launch: GLALaunch):
    """The split form's state gradients: dh [chunks, H, K, V] (gradient of the state leaving each chunk) and
    dh0 (or None)."""
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    dh = _chunk_updates(q, do, None, gc, scale, cu_seqlens, layout, BT, True,
                        state_dtype(q, initial_state is not None or dht is not None), launch.state, launch.updates_warps)
    _scan(dh, gc, dht, dh0, cu_seqlens, layout, q.shape[1], BT, True, launch.scan)
    return dh, dh0


def sequential_states_and_grads(q, k, v, gc, do, dht, initial_state, scale, cu_seqlens, layout, BT,
                                state: KernelLaunch, kd=None, kd_mode=KD_FORM):
    """The sequential form's states (without the final state) and state gradients, as one launch of the two
    passes: (h, dh, dh0 or None). kd, kd_mode: the decayed keys formed, written or read (see the module)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    N, NC, _, chunk_offsets = layout
    BK, BV = tile_width(state.BK, K), tile_width(state.BV, V)
    h = k.new_empty(NC, H, K, V, dtype=state_dtype(k, initial_state is not None))
    dh = q.new_empty(NC, H, K, V, dtype=state_dtype(q, initial_state is not None or dht is not None))
    dh0 = torch.empty_like(initial_state, dtype=torch.float32) if initial_state is not None else None
    _bwd_both_states_kernel[(cdiv(K, BK), cdiv(V, BV), 2 * N * H)](
        q, k, v, gc, kd, do, h, dh, initial_state, dht, dh0, cu_seqlens, chunk_offsets, scale, T, N * H, H, K, V, BT,
        BK, BV, USE_H0=initial_state is not None, USE_DHT=dht is not None, IS_VARLEN=cu_seqlens is not None,
        DOT_PREC=dot_precision(q.dtype), KD_MODE=kd_mode,
        **state.options(state_warps(K, V, N, H, q.device, state, passes=2)),
    )
    return h, dh, dh0
