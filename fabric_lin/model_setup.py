"""The model a pretraining run trains and its optimizer, as Fabric sets them up. `build_model`: built empty and
initialised in place (or with --initial_checkpoint_dir's weights), FP8 layers swapped in, activation checkpointing,
each Block compiled, then wrapped or sharded by `fabric.setup`; `make_optimizer`: AdamW, without weight decay for
norms and biases; `tune_gla_kernels` (compile.kernel_autotune): the GLA kernels' launch settings, searched on rank 0
before the model is built."""
from pathlib import Path
from typing import Any, Dict, Optional

import lightning_fabric as L
import torch
from lightning_fabric.strategies import ModelParallelStrategy

from fabric_lin.args import CompileArgs, OptimizerArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.fp8 import FUSED_NOTE as FP8_FUSED_NOTE, TENSORWISE_NOTE as FP8_TENSORWISE_NOTE, FP8Args, convert_to_fp8
from fabric_lin.model import GPT, Block, Launches, RMSNorm
from fabric_lin.ops.gla.launch import GLALaunch
from fabric_lin.run_start import load_initial_weights
from fabric_lin.weights import canonical_name

COMPILE_CACHE_DIR = "compile_cache"  # in out_dir: Triton's and torch.compile's caches, the searched GLA launch settings


def build_model(
    fabric: L.Fabric, config: Config, seed: int, initial_checkpoint_dir: Optional[Path] = None,
    activation_checkpointing: bool = False, compile: CompileArgs = CompileArgs(enabled=False),
    gla_launch: Optional[GLALaunch] = None, fp8: FP8Args = FP8Args(),
):
    """The model set up by Fabric, and the names of the parameters without weight decay. On CUDA it runs
    the fused Triton kernels (GLA ones launched with `gla_launch`, None: the shipped settings), elsewhere
    their PyTorch references; with fp8, its Linear layers are swapped for FP8 ones once their weights are set.

    Built empty and then initialised in place, `reset_parameters()` after re-seeding: the same weights as an
    eager `GPT(config)` with this seed. Sharded (FSDP2), it is built on the meta device and Fabric's
    `parallelize` materialises and initialises it shard by shard, to the same weights."""
    sharded = isinstance(fabric.strategy, ModelParallelStrategy)
    with fabric.init_module(empty_init=True):
        model = GPT(config, **gpt_options(fabric.device, fp8, gla_launch))
    fabric.seed_everything(seed, verbose=False)
    if not sharded:
        model.reset_parameters()
        if initial_checkpoint_dir is not None:
            model.load_state_dict(load_initial_weights(initial_checkpoint_dir, config, fabric.print))
    if fp8.torchao:  # the converted layers keep the parameters, and under FSDP materialise with the model's init
        fabric.print(f"FP8 ({fp8.recipe}): {len(convert_to_fp8(model, fp8))} Linear layers. {FP8_TENSORWISE_NOTE}")
    elif fp8.enabled:
        fabric.print(FP8_FUSED_NOTE)
    if activation_checkpointing:  # before compiling and sharding, as torchtitan orders them: each wraps the last
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    no_decay = no_decay_parameter_names(model)
    fabric.print(f"{config.name or 'model'}: {sum(p.numel() for p in model.parameters()):,} parameters")
    if compile.enabled:
        # Regional compilation: each Block is compiled in place. The blocks share one code object, so
        # Dynamo compiles once and reuses the graph for every layer (start-up of one block, not 24),
        # and parameter names keep no `_orig_mod.` prefix. Sharded, the compiled Blocks are then wrapped by
        # fully_shard (in fabric.setup), whose hooks gather each Block's weights before it runs.
        on_the_cpu = ("; on the CPU Inductor first builds C++ code for it: minutes before the first step (compile.enabled "
                      "null or false runs eagerly, the CPU's default)" if fabric.device.type == "cpu" else "")
        graphs = ": CUDA graphs" if compile.cuda_graphs else ""
        fabric.print(f"compiling each Block (mode {compile.mode}{graphs}){on_the_cpu}")
        for block in model.layers:
            block.compile(mode=None if compile.mode == "default" else compile.mode)
        model.dynamic_shapes = compile.dynamic
    model = fabric.setup(model)
    if sharded and initial_checkpoint_dir is not None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        set_model_state_dict(
            model._forward_module, load_initial_weights(initial_checkpoint_dir, config, fabric.print),
            options=StateDictOptions(full_state_dict=True, strict=True),
        )
    return model, no_decay


def gpt_options(device: torch.device, fp8: FP8Args, gla_launch: Optional[GLALaunch]) -> Dict[str, Any]:
    """GPT's arguments other than the config for a run on `device` (build_model's model and the precompile's copy)."""
    return dict(fused=device.type == "cuda", float8=fp8.torchao, fp8_products=fp8.recipe == "fused",
                launch=Launches() if gla_launch is None else Launches(gla=gla_launch))


def no_decay_parameter_names(model: torch.nn.Module) -> set:
    """Norm weights, biases, and the parameters a module names in its `no_weight_decay` (GDN's A_log and
    dt_bias): no weight decay."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if isinstance(module, RMSNorm) or param_name == "bias" or param_name in getattr(module, "no_weight_decay", ()):
                names.add(canonical_name(f"{module_name}.{param_name}" if module_name else param_name))
    return names


def make_optimizer(model: torch.nn.Module, no_decay: set, args: OptimizerArgs) -> torch.optim.AdamW:
    """AdamW over two groups: the parameters with weight decay (in the model's order), then those named in `no_decay`
    without. A one-file checkpoint's optimizer state numbers the parameters in this order."""
    groups = [
        {"params": [p for n, p in model.named_parameters() if canonical_name(n) not in no_decay], "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if canonical_name(n) in no_decay], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps,
        fused=True,  # also on the CPU: the loop skips non-finite updates through its found_inf
    )


def tune_gla_kernels(fabric: L.Fabric, config: Config, train: TrainArgs, precision: str, out_dir: Path) -> GLALaunch:
    """compile.kernel_autotune: the GLA launch settings for this layer shape, from out_dir's cache or searched
    by rank 0 and sent to every process, so that all of them (and a resumed run) use the same kernels."""
    from fabric_lin.ops.gla.tune import tuned_launch

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else torch.float32
    launch = None
    if fabric.global_rank == 0:
        launch = tuned_launch(
            train.micro_batch_size, train.max_seq_length, config.num_heads, config.head_k_dim, config.head_v_dim, dtype,
            cache_file=out_dir / COMPILE_CACHE_DIR / "gla_launch.json", log=fabric.print,
        )
    return fabric.broadcast(launch, src=0)
