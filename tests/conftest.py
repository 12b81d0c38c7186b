import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. The variable must be set before any
# kernel is defined, and fabric_lin.model imports the fused kernels, so it is set here, before any
# test module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against the reference b, in fp32."""
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def compiled_graph_ops(f, *inputs):
    """Compile f with AOT autograd, run it forward and backward on `inputs` (leaves that need grad; the
    output a scalar) and return (the compiled output, the op names called in the forward graph, those
    in the backward graph): what torch.compile kept as whole ops."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    graphs = {"forward": [], "backward": []}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    out = torch.compile(f, backend=backend, fullgraph=True)(*inputs)
    out.backward()
    names = {
        kind: {str(node.target) for gm in gms for node in gm.graph.nodes if node.op == "call_function"}
        for kind, gms in graphs.items()
    }
    return out, names["forward"], names["backward"]
