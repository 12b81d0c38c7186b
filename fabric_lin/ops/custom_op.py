"""How every kernel's host function meets torch.compile, written once: `kernel_op` makes a torch.library custom op
(fabric_lin::<name>) from the function.

    @kernel_op("chunk_gla_fwd")
    def chunk_gla_fwd(q: torch.Tensor, ...) -> Tuple[torch.Tensor, ...]: ...   # launches the kernels

    @chunk_gla_fwd.register_fake
    def _(q, ...): ...                                                          # the outputs' shapes and dtypes

A call goes to the op while torch.compile traces, where the kernels must be one opaque node of the graph (its
outputs shaped by the fake function), and to the function itself in eager mode, where the dispatcher would cost
~10 us a call (a gla-340M training step makes hundreds). Ops take tensors, numbers, strings and dtypes, not
Python objects: launch settings travel as their JSON text (`LaunchBundle.as_json`), which torch.compile bakes
into the graph as a constant.
"""
from typing import Callable

import torch


class KernelOp:
    """A host function that launches kernels, and the custom op made from it."""

    def __init__(self, name: str, fn: Callable):
        self.name, self.fn = name, fn
        self.op = torch.library.custom_op(f"fabric_lin::{name}", mutates_args=())(fn)

    def register_fake(self, fake: Callable) -> Callable:
        """Register `fake` (same arguments, empty outputs of the right shapes) for tracing; a decorator."""
        self.op.register_fake(fake)
        return fake

    def __call__(self, *args):
        return (self.op if torch.compiler.is_compiling() else self.fn)(*args)


def kernel_op(name: str) -> Callable[[Callable], KernelOp]:
    """Decorator: the function as the KernelOp fabric_lin::<name>."""
    return lambda fn: KernelOp(name, fn)


def refuse_second_derivative(op: str) -> None:
    """Called first in the backward pass of an autograd Function around kernels. Autograd runs a backward pass with
    gradients on only where it is asked to make it differentiable (create_graph=True: a gradient penalty, a
    Hessian-vector product); the kernels' backward is no autograd graph, so the second derivative would lack this op's
    part, silently. torch.compile traces the backward apart and refuses double backward itself."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"{op}: the Triton kernels have no second derivative (this backward pass was asked for one, "
            "create_graph=True); run the op with backend='torch' (a model: GPT(config, fused=False)), whose "
            "gradients autograd differentiates"
        )
