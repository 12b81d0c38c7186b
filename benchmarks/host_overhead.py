"""The host's share of a training step: what Python, autograd and the kernels' wrappers cost per
forward+backward, with the GPU taken out. Runs on the CPU: the model is built with its fused Triton
ops (`GPT(config, fused=True)`, the CUDA path), every Triton launch is replaced by a counter and every
torch.matmul by an empty tensor of the product's shape, and the widths are gla-debug's, so that what
remains is the host's work. Where a GPU finishes a layer's kernels faster than the host launches them,
this is the step's floor.

    python benchmarks/host_overhead.py                 # 24 layers (gla-340M's depth), one JSON object
    python benchmarks/host_overhead.py --profile 25    # and cProfile's top 25 functions by own time

Triton's own launch cost (binding the arguments, the driver call) and CUDA's are not in the figure: the
launches never reach Triton's runtime. `launches_per_step` counts them by kernel.
"""
import argparse
import cProfile
import io
import os
import pstats
import time
from collections import Counter

# The fused ops accept CPU tensors only where Triton's interpreter would run them; it never does here (the
# launches are counters), but it must be on before Triton is imported for the model to build its fused path.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.jit as triton_jit  # noqa: E402

from common import out_arg, positive_int, write_result  # noqa: E402
from fabric_lin.config import Config  # noqa: E402
from fabric_lin.model import GPT  # noqa: E402


def take_the_gpu_out(launches: Counter) -> None:
    """No-op kernel launches, counted by kernel, and matmuls that only allocate their output."""

    def counted_launch(kernel, grid):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", repr(kernel))

        def launch(*args, **kwargs):
            launches[name] += 1

        return launch

    def empty_matmul(a, b):  # the [..., n, k] @ [..., k, m] products of the wrappers, without the arithmetic
        return a.new_empty(*a.shape[:-1], b.shape[-1])

    triton_jit.KernelInterface.__getitem__ = counted_launch
    torch.matmul = empty_matmul


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive_int, default=24)
    parser.add_argument("--tokens", type=positive_int, default=16, help="sequence length (batch 1)")
    parser.add_argument("--steps", type=positive_int, default=10, help="forward+backward passes per repeat")
    parser.add_argument("--repeats", type=positive_int, default=7, help="the fastest repeat is reported")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="also cProfile's top N functions")
    parser.add_argument("--out", type=out_arg, help="also write the JSON document here (with the command, date and machine)")
    args = parser.parse_args()

    launches: Counter = Counter()
    take_the_gpu_out(launches)
    torch.manual_seed(0)
    config = Config.from_name("gla-debug", num_layers=args.layers)
    model = GPT(config, fused=True)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))

    def step():
        model(ids, targets=ids).backward()
        for p in model.parameters():
            p.grad = None

    for _ in range(3):  # warm-up: first-call costs (imports, caches) out of the figure
        step()
    launches.clear()
    best = float("inf")
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        best = min(best, (time.perf_counter() - start) / args.steps)
    per_step = {name: count // (args.repeats * args.steps) for name, count in sorted(launches.items())}
    result = {
        "layers": args.layers,
        "host_ms_per_fwd_bwd": round(best * 1e3, 2),
        "host_ms_per_layer": round(best * 1e3 / args.layers, 3),
        "launches_per_step": per_step,
        "torch": torch.__version__,
    }
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(lambda: [step() for _ in range(args.steps)])
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.profile)
        result["profile"] = text.getvalue().splitlines()
    write_result(result, args.out)


if __name__ == "__main__":
    main()
