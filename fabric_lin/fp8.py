"""FP8 training of the model's Linear layers through torchao (`pip install 'fabric-lin[fp8]'`), or, with the recipe
"fused", inside the fused ops that make the projections (fabric_lin/ops/fp8_matmul.py; no torchao, no conversion).

The weights and the optimizer state stay in their usual precision; the products of the converted layers run in FP8
with dynamic scaling (torchao's Float8Linear, recipe "tensorwise": e4m3 inputs and weights, e5m2 gradients, one
scale per tensor). Converted: the projections of every attention and MLP (q, k, v, the output gate, o, gate, up,
down). Kept in bf16: the embedding; the output head, whose product the chunked cross-entropy makes itself, never
holding the whole logits; and the small gate projections, GLA's low-rank forget gate and GDN's a/b
(`gate_projections` converts those whose widths allow): their products are a sliver of the step and FP8 would cost
them precision for little. A converted layer keeps its parameter names and plain tensors, so checkpoints and exports
stay as they are, and a run can resume an FP8 checkpoint in bf16 and the reverse. Sharded (FSDP2), the converted
layers' weights are all-gathered in the precision of the run (bf16 under bf16-mixed), or, with `all_gather`
(tensorwise only), cast to FP8 on their shards and gathered in FP8 (torchao's `enable_fsdp_float8_all_gather`): half
the bytes of a bf16 gather, and the cast that the product needs is already done.

The model must be built with `GPT(config, fused=..., float8=True)`, which calls its Linear layers as modules
(the fused kernels otherwise read their weights directly), and converted after its weights are set
(`convert_to_fp8`), before Fabric wraps it.
"""
import dataclasses
from typing import List

import torch
import torch.nn as nn

from fabric_lin.errors import InvalidValue, MissingPackage

RECIPES = ("none", "tensorwise", "fused")
MIN_TORCHAO = (0, 10)  # Float8LinearConfig.from_recipe_name
SMALL_GATE_PROJECTIONS = ("gk_proj", "a_proj", "b_proj")


@dataclasses.dataclass
class FP8Args:
    """FP8 training of the projections (Hopper or newer: compute capability 8.9+), in the fused ops or through torchao."""

    recipe: str = "none"
    """none: bf16 products; tensorwise: FP8 with one dynamic scale per tensor, through torchao's layers; fused: FP8
    products with one scale per row made inside the fused ops themselves (the forward and input-gradient products; the
    weight gradient in bf16), keeping what bf16 keeps. Measured on an H100 (benchmarks/results/2026-12-06-fp8-*),
    neither reaches 1.2x bf16's tokens/s.
    tensorwise pays at gla-1.3B where memory is to spare: 1.10x bf16's tokens/s at 1.09x its peak memory there, 0.87x at
    gla-340M; its layers keep 1.47x bf16's activation memory.
    fused pays at gla-1.3B and stays within bf16's memory: 1.08x bf16's tokens/s at 0.985x its peak memory there, 0.91x
    at gla-340M; its loss within 0.75% (median) of bf16's over 300 steps at gla-340M (the long-document corpus)"""
    gate_projections: bool = False
    """tensorwise (torchao's layers): also the small gate projections (GLA's low-rank forget gate, GDN's a and b)
    where their widths allow (fused keeps them in bf16)"""
    all_gather: bool = False
    """Sharded runs (several GPUs, parallelism.data_parallel fsdp) with recipe tensorwise: FSDP gathers the converted
    layers' weights in FP8 instead of bf16"""

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    @property
    def torchao(self) -> bool:
        """Whether the Linear layers are swapped for torchao's (every recipe but "fused", whose products the
        fused ops make themselves: fabric_lin/ops/fp8_matmul.py)."""
        return self.enabled and self.recipe != "fused"


# what each recipe was measured to gain and cost, told in one line to whoever turns it on (the records:
# benchmarks/results/2026-12-06-fp8-*; tests/test_fp8.py ties each figure to its record)
FUSED_NOTE = ("FP8 (fused): the fused ops' projections in FP8, each row scaled, keeping what bf16 keeps; measured on an "
              "H100: 1.08x bf16's tokens/s at 0.985x its peak memory for gla-1.3B's real loop, 0.91x at gla-340M, whose "
              "products are too small to pay for the casts; at gla-340M its loss stayed within 0.75% (median) of bf16's "
              "over 300 steps, lower on 86% of the steps (tutorials/performance.md)")
TENSORWISE_NOTE = ("Measured on an H100: 1.10x bf16's tokens/s at 1.09x its peak memory for gla-1.3B's real loop, 0.87x at "
                   "gla-340M, whose products are too small to pay for the casts; its layers keep their bf16 inputs for the "
                   "backward pass (1.47x bf16's activation memory at gla-340M and gla-1.3B): where memory is short, fused "
                   "stays within bf16's (tutorials/performance.md)")


def check_fp8(args: FP8Args, device: torch.device, sharded: bool = False) -> None:
    """Refuse an FP8 setup that cannot run, before anything is built: the recipe, the device, torchao, and
    `all_gather` where the run is not sharded (`sharded`: FSDP2 over several processes)."""
    if args.recipe not in RECIPES:
        raise InvalidValue(f"fp8.recipe must be one of {RECIPES}, got {args.recipe!r}")
    if args.all_gather and args.recipe != "tensorwise":
        raise InvalidValue(
            f"fp8.all_gather gathers weights cast to FP8 with one scale per tensor: it needs fp8.recipe 'tensorwise', "
            f"got {args.recipe!r}"
        )
    if args.gate_projections and not args.torchao:
        raise InvalidValue(
            f"fp8.gate_projections converts the small gate projections with torchao's layers (fp8.recipe tensorwise); "
            f"with fp8.recipe {args.recipe!r} it would do nothing: leave it false"
            + (" (fused makes every product 16 or more wide in FP8, GLA's low-rank gate among them)"
               if args.recipe == "fused" else "")
        )
    if not args.enabled:
        return
    if device.type != "cuda":
        raise InvalidValue(
            f"fp8.recipe {args.recipe!r} needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); this run is "
            f"on the {device.type.upper()}: leave fp8.recipe at 'none'"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise InvalidValue(
            f"fp8.recipe {args.recipe!r} needs a GPU of compute capability 8.9 or newer; "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: leave fp8.recipe at 'none'"
        )
    if args.all_gather and not sharded:
        raise InvalidValue(
            "fp8.all_gather changes how FSDP gathers the weights: it needs a sharded run (several GPUs with "
            "parallelism.data_parallel fsdp); this run is on one GPU or DDP, leave fp8.all_gather false"
        )
    if args.torchao:
        torchao_version()


def torchao_version() -> tuple:
    """torchao's (major, minor), or an error that says how to install it."""
    try:
        import torchao
    except ImportError:
        raise MissingPackage(
            "fp8.recipe needs torchao, which is not installed: pip install 'fabric-lin[fp8]' (or pip install torchao)"
        ) from None
    version = tuple(int(part) for part in torchao.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCHAO:
        raise MissingPackage(
            f"fp8.recipe needs torchao {'.'.join(map(str, MIN_TORCHAO))} or newer, found {torchao.__version__}: "
            "pip install -U 'fabric-lin[fp8]'"
        )
    return version


def fp8_layers(model: nn.Module, args: FP8Args) -> List[str]:
    """The names of the Linear layers `convert_to_fp8` converts."""
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if name == "lm_head":
            continue
        if any(part in SMALL_GATE_PROJECTIONS for part in name.split(".")):
            if not (args.gate_projections and _fp8_widths(module)):
                continue
        names.append(name)
    return names


def _fp8_widths(module: nn.Linear) -> bool:
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def check_fp8_shapes(model: nn.Module, args: FP8Args) -> None:
    """FP8 products need both widths of a weight to be multiples of 16; name every layer to convert that is not."""
    converted = set(fp8_layers(model, args))
    bad = [f"{name} ({module.out_features} x {module.in_features})" for name, module in model.named_modules()
           if name in converted and not _fp8_widths(module)]
    if bad:
        raise InvalidValue(
            f"fp8.recipe {args.recipe!r}: FP8 products need weights whose widths are multiples of 16; these are not: "
            f"{', '.join(bad[:6])}{' ...' if len(bad) > 6 else ''}. Choose widths that are, or leave fp8.recipe at 'none'"
        )


def convert_to_fp8(model: nn.Module, args: FP8Args, emulate: bool = False) -> List[str]:
    """Swap the Linear layers `fp8_layers` names for torchao's Float8Linear, in place, and return their names.
    The new layers keep their parameters (the same tensors) and the model's init (`reset_parameters`, which a
    model built on the meta device is materialised with). emulate: FP8 products emulated in higher precision
    (torchao's emulate), e.g. on a CPU, for tests. With `args.all_gather` the weights are torchao's tensors that
    FSDP2 gathers in FP8; the model must then be sharded with `fully_shard` (fabric_lin.parallelism)."""
    torchao_version()
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    if getattr(model, "fused", False) and not getattr(model, "float8", False):
        raise InvalidValue("convert_to_fp8: build the model with GPT(config, fused=..., float8=True), whose Linear layers "
                         "are called as modules; the fused kernels read the weights themselves")
    check_fp8_shapes(model, args)
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(args.recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=args.all_gather)

    class Float8Projection(Float8Linear):
        """torchao's Float8Linear, initialised as the model's Linear layers are: N(0, std), zero bias."""

        std = 0.02  # the converted layer's own, set below (this one serves the construction's first init)

        def reset_parameters(self) -> None:
            nn.init.normal_(self.weight, mean=0.0, std=self.std)
            if self.bias is not None:
                nn.init.zeros_(self.bias)

    names = fp8_layers(model, args)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
        new = Float8Projection.from_float(old, config=config)
        new.std = getattr(old, "std", 0.02)
        setattr(parent, child, new)
    return names
