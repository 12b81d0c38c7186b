"""The autograd wiring of a family's chunked Triton path, written once: a family gives its forward and backward
kernel ops (`fabric_lin.ops.custom_op.kernel_op`) and says which tensors its backward reads; `chunked_function`
makes the torch.autograd.Function, and `apply_chunked` calls it with the inputs as the kernels take them.

The ops' contract, the same for every family (inputs: its differentiable per-token tensors, q, k, v first;
settings: plain values, the launch settings' JSON text last):

    forward_op(*inputs, initial_state, cu_seqlens, *settings)  -> (o, final state, *outputs kept for backward)
    backward_op(*kept, initial_state, cu_seqlens, do, dht, *settings)
                                                                -> (*the inputs' gradients, dh0)

with kept = keep(inputs, outputs kept, settings), the tensors the backward pass reads (inputs or forward outputs;
None where a setting leaves one out), dht None where no final state's gradient flows, and dh0 an empty tensor
without an initial state (a custom op returns tensors, never None). The gradients reach autograd in their inputs'
dtypes (a gate kept as its fp32 cumulative sum gets its gradient in the gate's own dtype). An input may be None (the
delta rule without its gate): the ops take None for it, and its gradient (an empty tensor from the backward op) is
None.
"""
from typing import Callable, Optional, Sequence, Tuple, Type

import torch

from fabric_lin.ops.chunked.layout import chunk_layout
from fabric_lin.ops.custom_op import refuse_second_derivative


def chunked_function(name: str, forward_op: Callable, backward_op: Callable, keep: Callable) -> Type[torch.autograd.Function]:
    """The autograd.Function of a family's chunked path, named `name`; see the module for the ops' contract."""

    class ChunkedFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, initial_state, cu_seqlens, output_final_state, settings, *inputs):
            o, final_state, *outputs = forward_op(*inputs, initial_state, cu_seqlens, *settings)
            ctx.save_for_backward(initial_state, cu_seqlens, *keep(inputs, outputs, settings))
            ctx.settings, ctx.output_final_state = settings, output_final_state
            ctx.dtypes = tuple(None if x is None else x.dtype for x in inputs)
            return o, final_state

        @staticmethod
        def backward(ctx, do, dht):
            refuse_second_derivative(name)
            initial_state, cu_seqlens, *kept = ctx.saved_tensors
            dht = dht.contiguous() if ctx.output_final_state and dht is not None else None
            *grads, dh0 = backward_op(*kept, initial_state, cu_seqlens, do.contiguous(), dht, *ctx.settings)
            grads = [None if dtype is None else grad.to(dtype) for grad, dtype in zip(grads, ctx.dtypes)]
            return (dh0 if initial_state is not None else None, None, None, None, *grads)

    ChunkedFunction.__name__ = ChunkedFunction.__qualname__ = name
    return ChunkedFunction


def apply_chunked(function: Type[torch.autograd.Function], inputs: Sequence[torch.Tensor], scale: Optional[float],
                  initial_state: Optional[torch.Tensor], output_final_state: bool, cu_seqlens: Optional[torch.Tensor],
                  *settings) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(o, final state or None) of `function` (a chunked_function) on inputs checked by the caller
    (`checks.check_inputs`), taken as the kernels take them: contiguous, scale a float (K^-0.5 by default) put
    first among the settings, cu_seqlens int32. No tokens (T = 0) launch nothing: no output rows, and the final state
    is the initial one."""
    q, v = inputs[0], inputs[2]
    B, T, H, K = q.shape
    if T == 0:  # no token: nothing for the kernels to read (a state pass would load a row before the first)
        N = chunk_layout(cu_seqlens, B, T).sequences
        final_state = initial_state.float().clone() if initial_state is not None else \
            q.new_zeros(N, H, K, v.shape[-1], dtype=torch.float32)
        return q.new_empty(B, 0, H, v.shape[-1]), (final_state if output_final_state else None)
    scale = K ** -0.5 if scale is None else float(scale)
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(torch.int32).contiguous()
    o, final_state = function.apply(initial_state, cu_seqlens, output_final_state, (scale, *settings),
                                    *(None if x is None else x.contiguous() for x in inputs))
    return o, (final_state if output_final_state else None)
