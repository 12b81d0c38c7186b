"""`fabric-lin pretrain`: pretrain a GLA (or transformer baseline) language model with Lightning Fabric.

Reads top to bottom: `setup()` (the command line: check arguments, build Fabric, launch) ->
`main()` (seed, model, optimizer, data, resume) -> `fit()` (the loop) -> `validate()`;
then the checkpoint helpers (`save_checkpoint`, `find_resume_dir`).

A checkpoint is a directory `out_dir/step-XXXXXXXX/` (the optimizer step) or `out_dir/final/`:
`lit_model.pth` (Fabric's save of model, optimizer, train dataloader state, counters and RNG states;
a directory of shards under FSDP), `hyperparameters.yaml`, `model_config.yaml` and the tokenizer
files. It is written under a `.tmp-` name and renamed last, so any `step-*` directory is complete.
"""
import json
import math
import os
import random
import re
import shutil
import signal
import time
from collections import deque
from dataclasses import fields, is_dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, Iterator, List, Literal, Optional, Tuple, Union

import lightning as L
import numpy as np
import torch
import yaml
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import DDPStrategy, FSDPStrategy
from torch.distributed.fsdp import ShardingStrategy

from fabric_lin.args import EvalArgs, OptimizerArgs, TrainArgs, learning_rate
from fabric_lin.config import Config
from fabric_lin.data import DataModule, SampleCorpus
from fabric_lin.flops import flops_per_token, peak_flops
from fabric_lin.model import GPT, Block, RMSNorm

STEP_DIR_PATTERN = re.compile(r"^step-(\d{8})$")
CHECKPOINT_FILE = "lit_model.pth"
STEP_FILE = "step.json"  # {"step_count": N} in every checkpoint: which one is newest, without loading it
METRICS_FILE = "metrics.jsonl"
COMPILE_CACHE_DIR = "compile_cache"


def process_start_time() -> float:
    """Wall-clock time at which this process started (from /proc on Linux; elsewhere, this import)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


PROCESS_START = process_start_time()

# Data modules are dataclasses, for which jsonargparse disables subclasses by default; `--data SampleCorpus`
# and YAML `data: {class_path: ..., init_args: ...}` need them enabled.
try:
    from jsonargparse import set_parsing_settings

    set_parsing_settings(subclasses_enabled=[DataModule])
except ImportError:  # the loop itself does not need jsonargparse
    pass


def setup(
    model_name: Optional[str] = None,
    model_config: Optional[Config] = None,
    out_dir: Path = Path("out/pretrain"),
    precision: Optional[Literal["bf16-mixed", "bf16-true", "16-mixed", "32-true"]] = None,
    resume: Union[bool, Literal["auto"], Path] = False,
    initial_checkpoint_dir: Optional[Path] = None,
    data: Optional[DataModule] = None,
    train: TrainArgs = TrainArgs(),
    eval: EvalArgs = EvalArgs(),
    optimizer: OptimizerArgs = OptimizerArgs(),
    devices: Union[int, Literal["auto"]] = "auto",
    num_nodes: int = 1,
    seed: int = 42,
    tokenizer_dir: Optional[Path] = None,
    logger_name: Literal["tensorboard", "csv", "wandb"] = "tensorboard",
    compile: Optional[bool] = None,
    compile_cache: bool = True,
    compile_dynamic: bool = True,
    compile_mode: Literal["auto", "default", "reduce-overhead"] = "auto",
    kernel_autotune: bool = False,
    activation_checkpointing: bool = False,
    data_parallel: Literal["fsdp", "ddp"] = "fsdp",
    fsdp_unit: Literal["block", "model"] = "block",
    fsdp_reshard_after_forward: bool = True,
    reset_state_at_doc_boundaries: bool = False,
) -> None:
    """Pretrain a model.

    Arguments:
        model_name: A name from `fabric-lin pretrain list` (mutually exclusive with model_config).
        model_config: A full model configuration (the fields of `fabric_lin.config.Config`).
        out_dir: Directory for checkpoints (step-XXXXXXXX/, final/), logs and metrics.jsonl.
        precision: bf16-mixed, bf16-true, 16-mixed or 32-true. Default: bf16-mixed on GPU, 32-true on CPU.
        resume: false: start fresh. true: resume from the newest checkpoint in out_dir (error if none).
            auto: resume from the newest checkpoint if there is one. A path: resume from that checkpoint directory.
        initial_checkpoint_dir: A model directory (convert_pretrained_checkpoint's output) whose weights
            initialise the model before training (continued pretraining).
        data: The data module. Default: SampleCorpus (a small corpus shipped with the package).
        train: Training schedule, batch sizes and checkpointing.
        eval: Validation.
        optimizer: AdamW settings.
        devices: Devices per node ("auto": every GPU, or one CPU process).
        num_nodes: Number of nodes.
        seed: Random seed (weights; the data order follows the data module's own seed).
        tokenizer_dir: Directory of tokenizer.model. Default: the data module's tokenizer, if it has one.
        logger_name: tensorboard, csv or wandb (needs `pip install wandb`).
        compile: torch.compile the model. Default: on with CUDA, off on CPU.
        compile_cache: Keep Triton's and torch.compile's caches in out_dir/compile_cache (sets
            TRITON_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR), so that a resumed run, or any later run into
            the same out_dir, loads compiled kernels and graphs instead of building them again.
        compile_dynamic: Compile the blocks for any batch size and sequence length (marked dynamic), so
            that a new context length or a smaller batch (validation, a last partial batch) does not
            compile them again. False: shapes are specialised, each new one compiles anew.
        compile_mode: "reduce-overhead" runs each compiled Block's forward and backward pass as a CUDA
            graph: one launch replays its kernels, so the host, which otherwise launches them one by one,
            no longer holds the GPU back (one GPU only: FSDP gathers the weights into new memory each
            step, which a recorded graph cannot follow; not with reset_state_at_doc_boundaries, whose
            shapes change with every batch). "default": kernels launched one by one. "auto":
            "reduce-overhead" where it can run (one CUDA GPU, compile on, no reset_state_at_doc_boundaries),
            "default" elsewhere.
        kernel_autotune: Search the GLA kernels' launch settings (tiles, warps) at this run's layer shape
            before training, about a minute on a GPU, instead of using the shipped table. The result
            is kept in out_dir/compile_cache/gla_launch.json, keyed by GPU, dtype and head dims (not by
            batch size or context), so a resumed run or a new context length does not search again.
        activation_checkpointing: Recompute each Block's activations in the backward pass.
        data_parallel: With several GPUs: "fsdp" shards the weights, gradients and optimizer state over a
            node's GPUs (FSDP HYBRID_SHARD; replicated across nodes); "ddp" keeps all of them on every GPU
            (DistributedDataParallel, 16 bytes per parameter: 6.0 GB at gla-340M) and all-reduces the
            gradients in buckets, with less host work per step than FSDP's hooks around every Block.
            Several CPU processes always use DDP.
        fsdp_unit: With FSDP: what one all-gather gathers. "block": each Block's weights, just before the
            Block runs (least memory: one Block's weights gathered at a time). "model": all weights at
            once, one all-gather and one reduce-scatter per pass instead of one per Block, so FSDP's
            per-unit host work runs once rather than for every Block, at the cost of the whole model's
            compute-dtype weights and full-size gradients on every GPU during the step and of
            communication that no longer overlaps the Blocks' compute (small models on a fast link).
        fsdp_reshard_after_forward: With several GPUs (FSDP HYBRID_SHARD): free each Block's gathered
            weights after its forward pass and gather them again for its backward pass (true: least
            memory). False keeps them until the backward pass and, while gradients accumulate over
            micro-batches, until the optimizer step (ZeRO-2 inside a node: one all-gather of the weights
            per optimizer step instead of two per micro-batch, for the model's weights in the compute
            dtype held on every GPU).
        reset_state_at_doc_boundaries: Reset the recurrent state (and attention) at each EOS token,
            so packed documents do not see each other.
    """
    config = resolve_model_config(model_name, model_config)
    cuda = torch.cuda.is_available()
    accelerator = "cuda" if cuda else "cpu"
    if devices == "auto":
        devices = torch.cuda.device_count() if cuda else 1
    if not isinstance(devices, int) or devices < 1 or num_nodes < 1:
        raise ValueError(f"devices must be a positive integer or 'auto' and num_nodes positive, got devices={devices!r}, num_nodes={num_nodes!r}")
    precision = precision or ("bf16-mixed" if cuda else "32-true")
    compile = cuda if compile is None else compile
    data = SampleCorpus() if data is None else data
    if type(data) is DataModule:  # --data.<option> alone: jsonargparse builds the base class
        raise ValueError(
            "--data.* options need a data module: give --data SampleCorpus, TokenChunks or SlimPajamaStarcoder "
            "(or a config file's data: class_path) before them"
        )
    hparams = capture_hparams(dict(
        model_name=model_name, model_config=model_config, out_dir=out_dir, precision=precision, resume=resume,
        initial_checkpoint_dir=initial_checkpoint_dir, data=data, train=train, eval=eval, optimizer=optimizer,
        devices=devices, num_nodes=num_nodes, seed=seed, tokenizer_dir=tokenizer_dir, logger_name=logger_name,
        compile=compile, compile_cache=compile_cache, compile_dynamic=compile_dynamic, compile_mode=compile_mode,
        kernel_autotune=kernel_autotune,
        activation_checkpointing=activation_checkpointing, data_parallel=data_parallel,
        fsdp_unit=fsdp_unit, fsdp_reshard_after_forward=fsdp_reshard_after_forward,
        reset_state_at_doc_boundaries=reset_state_at_doc_boundaries,
    ))
    # errors that would otherwise appear only after the model and the data are loaded
    accumulation = train.gradient_accumulation_iters(devices, num_nodes)
    max_steps = train.total_steps()
    if train.lr_schedule == "wsd" and not 0.0 < train.wsd_decay_fraction <= 1.0:
        raise ValueError(f"train.wsd_decay_fraction must be in (0, 1], got {train.wsd_decay_fraction}")
    if train.keep_last_n is not None and train.keep_last_n < 1:
        raise ValueError(f"train.keep_last_n must be at least 1 (or None to keep all), got {train.keep_last_n}")
    if not (train.save_interval is None or train.save_interval > 0) or train.log_interval < 1 or eval.interval < 1:
        raise ValueError(
            f"train.save_interval ({train.save_interval}), train.log_interval ({train.log_interval}) and "
            f"eval.interval ({eval.interval}) must be positive"
        )
    if eval.max_iters < 1:
        raise ValueError(f"eval.max_iters must be at least 1 (validation batches per device), got {eval.max_iters}")
    if fsdp_unit not in ("block", "model"):
        raise ValueError(f"fsdp_unit must be 'block' or 'model', got {fsdp_unit!r}")
    if data_parallel not in ("fsdp", "ddp"):
        raise ValueError(f"data_parallel must be 'fsdp' or 'ddp', got {data_parallel!r}")
    if compile_mode not in ("auto", "default", "reduce-overhead"):
        raise ValueError(f"compile_mode must be 'auto', 'default' or 'reduce-overhead', got {compile_mode!r}")
    if compile_mode == "auto":
        compile_mode = auto_compile_mode(cuda, compile, devices * num_nodes, reset_state_at_doc_boundaries)
    if compile_mode == "reduce-overhead" and not (cuda and compile and devices * num_nodes == 1):
        raise ValueError(
            "compile_mode 'reduce-overhead' (CUDA graphs) needs one CUDA GPU and compile on; got "
            f"cuda={cuda}, compile={compile}, devices={devices}, num_nodes={num_nodes}"
        )
    if compile_mode == "reduce-overhead" and reset_state_at_doc_boundaries:
        # each batch's document count changes a tensor shape, and each new shape records another graph
        raise ValueError("compile_mode 'reduce-overhead' (CUDA graphs) cannot be used with reset_state_at_doc_boundaries")
    if initial_checkpoint_dir is not None and not Path(initial_checkpoint_dir).is_dir():
        raise FileNotFoundError(f"--initial_checkpoint_dir {initial_checkpoint_dir} is not a directory (expected a model directory)")
    check_out_dir_writable(Path(out_dir))
    check_free_space(Path(out_dir), config)

    strategy = make_strategy(
        cuda, devices, num_nodes, data_parallel, activation_checkpointing, fsdp_reshard_after_forward, fsdp_unit
    )
    if compile_cache:  # before Fabric starts any process or compiles anything; its processes inherit these
        os.environ["TRITON_CACHE_DIR"] = str((Path(out_dir) / COMPILE_CACHE_DIR / "triton").absolute())
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str((Path(out_dir) / COMPILE_CACHE_DIR / "inductor").absolute())
    logger = make_logger(logger_name, Path(out_dir), hparams)
    fabric = L.Fabric(
        accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy, precision=precision,
        loggers=[logger],
    )
    fabric.launch()
    main(
        fabric, config, Path(out_dir), resume, initial_checkpoint_dir, data, train, eval, optimizer, seed,
        tokenizer_dir, compile, activation_checkpointing, reset_state_at_doc_boundaries, accumulation, max_steps,
        hparams, precision, kernel_autotune, compile_dynamic, compile_mode,
    )


def main(
    fabric: L.Fabric,
    config: Config,
    out_dir: Path,
    resume: Union[bool, str, Path],
    initial_checkpoint_dir: Optional[Path],
    data: DataModule,
    train: TrainArgs,
    eval: EvalArgs,
    optimizer_args: OptimizerArgs,
    seed: int,
    tokenizer_dir: Optional[Path],
    compile: bool,
    activation_checkpointing: bool,
    reset_state_at_doc_boundaries: bool,
    accumulation: int,
    max_steps: int,
    hparams: Dict[str, Any],
    precision: str,
    kernel_autotune: bool = False,
    compile_dynamic: bool = True,
    compile_mode: str = "default",
) -> None:
    startup = {"launched": time.time() - PROCESS_START}  # seconds from process start, for the first-step line
    with StopRequest() as stop:  # SIGTERM/SIGUSR1 from here on: checkpoint at the next step, exit 0
        resume_dir = find_resume_dir(resume, out_dir)  # before any work, so a bad --resume fails fast
        fabric.seed_everything(seed)
        if not isinstance(fabric.logger, CSVLogger):  # Fabric's CSVLogger cannot; hyperparameters.yaml has them
            fabric.logger.log_hyperparams(hparams)

        # data
        if fabric.global_rank == 0:
            data.prepare_data()
        fabric.barrier()
        tokenizer_dir = tokenizer_dir or getattr(data, "tokenizer_dir", None)
        tokenizer = load_tokenizer(tokenizer_dir)
        if tokenizer is None:
            fabric.print(
                f"Warning: no tokenizer (--tokenizer_dir, or a data module that has one): the checkpoints will hold "
                f"no tokenizer files, which generate and convert_to_hf need; {type(data).__name__} reads token ids only"
            )
        if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
            raise ValueError(
                f"the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{config.vocab_size}; use a model config with vocab_size >= {tokenizer.vocab_size}"
            )
        if reset_state_at_doc_boundaries and tokenizer is None:
            raise ValueError("reset_state_at_doc_boundaries needs the EOS id: give --tokenizer_dir")
        eos_id = tokenizer.eos_id if reset_state_at_doc_boundaries else None
        data.connect(
            tokenizer=tokenizer, batch_size=train.micro_batch_size, max_seq_length=train.max_seq_length,
            vocab_size=config.vocab_size,
        )
        data.setup()
        train_dataloader = data.train_dataloader()
        val_dataloader = data.val_dataloader()
        train_dataloader = fabric.setup_dataloaders(train_dataloader)
        if val_dataloader is not None:  # a data module without a validation split returns None
            val_dataloader = fabric.setup_dataloaders(val_dataloader)

        startup["data ready"] = time.time() - PROCESS_START
        model, no_decay = build_model(
            fabric, config, seed, initial_checkpoint_dir, activation_checkpointing, compile, compile_dynamic, compile_mode
        )
        startup["model built"] = time.time() - PROCESS_START
        if kernel_autotune and fabric.device.type == "cuda" and config.block_type == "gla":
            tune_gla_kernels(fabric, config, train, precision, out_dir)
            startup["kernels tuned"] = time.time() - PROCESS_START

        groups = [
            {"params": [p for n, p in model.named_parameters() if canonical_name(n) not in no_decay], "weight_decay": optimizer_args.weight_decay},
            {"params": [p for n, p in model.named_parameters() if canonical_name(n) in no_decay], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups, lr=optimizer_args.lr, betas=tuple(optimizer_args.betas), eps=optimizer_args.eps,
            fused=True,  # also on the CPU: the loop skips non-finite updates through its found_inf
        )
        optimizer = fabric.setup_optimizers(optimizer)

        state = {
            "model": model,
            "optimizer": optimizer,
            "train_dataloader": train_dataloader,
            "iter_num": 0,
            "step_count": 0,
            "skipped_steps": 0,
            "rng_states": {},
        }
        if resume_dir is not None:
            fabric.print(f"Resuming from {resume_dir}")
            try:
                fabric.load(resume_dir / CHECKPOINT_FILE, state)
            except KeyError as e:  # a model directory's lit_model.pth holds the weights alone
                raise ValueError(
                    f"--resume {resume_dir}: {CHECKPOINT_FILE} there is not a training checkpoint ({e}); to start "
                    f"from a model directory's weights, use --initial_checkpoint_dir {resume_dir}"
                ) from None
            except ValueError as e:
                if "parameter group" not in str(e):
                    raise
                # DDP runs of earlier versions put every parameter in the weight-decay group
                raise ValueError(
                    f"--resume {resume_dir}: its optimizer state has other parameter groups than this run's ({e}). "
                    "A DDP run of an earlier version put the norm weights and biases in the weight-decay group; "
                    f"continue from its weights: fabric-lin convert_pretrained_checkpoint {resume_dir} --output_dir "
                    "<DIR>, then --initial_checkpoint_dir <DIR> (AdamW's moments start again)"
                ) from None
            set_rng_states(state["rng_states"])
            startup["checkpoint loaded"] = time.time() - PROCESS_START

        ctx = RunContext(
            out_dir=out_dir, hparams=hparams, config=config, tokenizer_dir=tokenizer_dir, train=train, eval=eval,
            optimizer_args=optimizer_args, accumulation=accumulation, max_steps=max_steps, eos_id=eos_id,
            precision=precision, stop=stop, data=data, compile=compile, startup=startup,
            cuda_graphs=compile and compile_mode == "reduce-overhead",
        )
        status = "failed"
        try:
            fit(fabric, state, val_dataloader, ctx)
            status = "success"
        finally:
            # Fabric's CSV logger writes its file only every 100 logged steps, and at finalize
            for logger in fabric.loggers:
                logger.finalize(status)


def auto_compile_mode(cuda: bool, compile: bool, world_size: int, reset_state_at_doc_boundaries: bool) -> str:
    """compile_mode "auto": CUDA graphs ("reduce-overhead") where they can run, one GPU with compile on and
    shapes that do not change with every batch; on one H200 the gla-340M real loop ran 1.026x faster with
    them (tutorials/performance.md), the host no longer launching each kernel of a layer on its own."""
    graphs_can_run = cuda and compile and world_size == 1 and not reset_state_at_doc_boundaries
    return "reduce-overhead" if graphs_can_run else "default"


def make_strategy(
    cuda: bool, devices: int, num_nodes: int, data_parallel: str = "fsdp", activation_checkpointing: bool = False,
    fsdp_reshard_after_forward: bool = True, fsdp_unit: str = "block",
):
    """Fabric's strategy for this many processes: "auto" for one; with several GPUs FSDP HYBRID_SHARD or
    DDP (`data_parallel`); several CPU processes always use DDP over gloo (Fabric's FSDP refuses the CPU)."""
    if devices * num_nodes == 1:
        return "auto"
    if not cuda:
        return DDPStrategy(process_group_backend="gloo", timeout=timedelta(minutes=30))
    if data_parallel == "ddp":
        # gradients all-reduced in buckets as the backward pass produces them, into views of the buckets
        # (no copy); activation checkpointing, when on, is applied to the Blocks by build_model
        return DDPStrategy(process_group_backend="nccl", gradient_as_bucket_view=True, timeout=timedelta(minutes=30))
    return FSDPStrategy(
        auto_wrap_policy={Block} if fsdp_unit == "block" else None,  # None: the whole model is one unit
        activation_checkpointing_policy={Block} if activation_checkpointing else None,
        # replicated across nodes, sharded inside one; gathered weights freed after each
        # Block's forward (HYBRID_SHARD) or kept until its backward (_HYBRID_SHARD_ZERO2)
        sharding_strategy=(
            ShardingStrategy.HYBRID_SHARD if fsdp_reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
        ),
        # over this run's devices of a node (not every visible GPU)
        device_mesh=(num_nodes, devices),
        state_dict_type="sharded",
        timeout=timedelta(minutes=30),
    )


def build_model(
    fabric: L.Fabric, config: Config, seed: int, initial_checkpoint_dir: Optional[Path] = None,
    activation_checkpointing: bool = False, compile: bool = False, compile_dynamic: bool = True,
    compile_mode: str = "default",
):
    """The model set up by Fabric, and the names of the parameters without weight decay.

    Built empty (on the meta device under FSDP) and then initialised in place: on one device or DDP,
    `reset_parameters()` after re-seeding gives the same weights as an eager `GPT(config)` with this
    seed; under FSDP the wrapping materialises each Block with its modules' `reset_parameters()`."""
    sharded = isinstance(fabric.strategy, FSDPStrategy)
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    if not sharded:
        fabric.seed_everything(seed, verbose=False)
        model.reset_parameters()
        if initial_checkpoint_dir is not None:
            model.load_state_dict(load_initial_weights(initial_checkpoint_dir, config, fabric.print))
        if activation_checkpointing:  # under FSDP the strategy's activation_checkpointing_policy does it
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    no_decay = no_decay_parameter_names(model)
    fabric.print(f"{config.name or 'model'}: {sum(p.numel() for p in model.parameters()):,} parameters")
    if compile:
        # Regional compilation: each Block is compiled in place. The blocks share one code object, so
        # Dynamo compiles once and reuses the graph for every layer (start-up of one block, not 24),
        # and parameter names keep no `_orig_mod.` prefix.
        fabric.print(f"compiling each Block (mode {compile_mode}{': CUDA graphs' if compile_mode == 'reduce-overhead' else ''})")
        for block in model.layers:
            block.compile(mode=None if compile_mode == "default" else compile_mode)
        model.dynamic_shapes = compile_dynamic
    model = fabric.setup(model)
    if sharded and initial_checkpoint_dir is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        wrapped = model._forward_module
        wrapped = getattr(wrapped, "_orig_mod", wrapped)  # under torch.compile, the FSDP module inside
        set_model_state_dict(
            wrapped, load_initial_weights(initial_checkpoint_dir, config, fabric.print),
            options=StateDictOptions(full_state_dict=True, strict=True),
        )
    return model, no_decay


def tune_gla_kernels(fabric: L.Fabric, config: Config, train: TrainArgs, precision: str, out_dir: Path) -> None:
    """kernel_autotune: the GLA launch settings for this layer shape, from out_dir's cache or searched by
    rank 0 and sent to every process, so that all of them (and a resumed run) use the same kernels."""
    from fabric_lin.ops.gla import chunk
    from fabric_lin.ops.gla.tune import tuned_launch

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16 if precision.startswith("16") else torch.float32
    launch = None
    if fabric.global_rank == 0:
        launch = tuned_launch(
            train.micro_batch_size, train.max_seq_length, config.num_heads, config.head_k_dim, config.head_v_dim, dtype,
            cache_file=out_dir / COMPILE_CACHE_DIR / "gla_launch.json", log=fabric.print,
        )
    chunk.LAUNCH.update(fabric.broadcast(launch, src=0))


class RunContext:
    """What fit() needs besides the train state: settings and file locations."""

    def __init__(self, **kwargs: Any):
        self.__dict__.update(kwargs)


def fit(fabric: L.Fabric, state: Dict[str, Any], val_dataloader, ctx: RunContext) -> None:
    model, optimizer, train = state["model"], state["optimizer"], ctx.train
    tokens_per_step = train.global_batch_size * train.max_seq_length
    flops_token = flops_per_token(ctx.config, train.max_seq_length)
    peak = peak_flops(fabric.device, ctx.precision)
    metrics_path = ctx.out_dir / METRICS_FILE
    pending: List[Tuple[int, torch.Tensor, float, torch.Tensor, torch.Tensor]] = []
    start_step = state["step_count"]

    if ctx.eval.initial_validation and start_step == 0:
        val_loss = validate(fabric, model, val_dataloader, ctx.eval.max_iters, ctx.cuda_graphs)
        log_validation(fabric, metrics_path, 0, val_loss)
    if start_step >= ctx.max_steps:
        fabric.print(f"Nothing to train: the checkpoint is at step {start_step}, max_steps is {ctx.max_steps}")
        final = final_checkpoint_step(ctx.out_dir)
        if final is None or final < start_step:  # e.g. stopped by a signal at the last step: finish the run
            finish(fabric, state, val_dataloader, ctx, metrics_path)
        return

    data_path = getattr(ctx.data, "data_path", None)
    data_name = type(ctx.data).__name__ + (f" {data_path}" if data_path is not None else "")
    train_iterator = CycleIterator(state["train_dataloader"], empty_error=(
        f"The training data ({data_name}) yields no full batch of train.micro_batch_size={train.micro_batch_size}"
        f" samples of max_seq_length + 1 = {train.max_seq_length + 1} tokens (train.max_seq_length="
        f"{train.max_seq_length}) in any DataLoader worker of a process: lower train.max_seq_length,"
        " train.micro_batch_size or data.num_workers, or give it more data"
    ))
    fabric.barrier()
    loop_start = time.time() - PROCESS_START
    run_start = window_start = time.perf_counter()
    window_step = start_step
    first_step_time = None
    graphs_at_first_step = 0
    consecutive_nonfinite = 0
    stopped_by_signal = False
    step_flags = StepFlags(fabric)

    while state["step_count"] < ctx.max_steps:
        step = state["step_count"]
        lr = learning_rate(step, ctx.optimizer_args.lr, train.min_lr, train.lr_warmup_steps, ctx.max_steps, train.lr_schedule, train.wsd_decay_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr

        loss_sum = torch.zeros((), device=fabric.device)
        fingerprint = torch.zeros((), dtype=torch.int64, device=fabric.device)
        for micro in range(ctx.accumulation):
            batch = next(train_iterator).long()  # litdata's TokensLoader yields the stored dtype (often int32)
            state["iter_num"] += 1
            fingerprint += batch_fingerprint(batch) * (micro + 1)
            input_ids = batch[:, : train.max_seq_length].contiguous()
            targets = batch[:, 1 : train.max_seq_length + 1].contiguous()
            if ctx.cuda_graphs:  # this micro-batch's graphs may reuse the last one's graph memory
                torch.compiler.cudagraph_mark_step_begin()
            with fabric.no_backward_sync(model, enabled=micro < ctx.accumulation - 1):
                loss = compute_loss(model, input_ids, targets, ctx.eos_id)
                fabric.backward(loss / ctx.accumulation)
            if ctx.cuda_graphs and micro == 0 and ctx.accumulation > 1:
                # autograd took the first micro-batch's weight gradients as the .grad tensors themselves, and
                # they live in the graphs' memory, which the next micro-batch's replay overwrites: give them
                # their own memory before the others are added in (one copy of the gradients per step)
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad = p.grad.clone()
            loss_sum += loss.detach()
        grad_norm = fabric.clip_gradients(
            model, optimizer, max_norm=train.max_norm if train.max_norm else float("inf"), error_if_nonfinite=False
        )
        step_loss = loss_sum / ctx.accumulation
        # A non-finite loss or gradient norm skips the update (the data is consumed and the step counted,
        # as a loss-scaler skip), decided on the device: fused AdamW leaves weights, moments and step
        # counts untouched where found_inf is set. (Under 16-mixed the loss scaler sets found_inf itself,
        # from the gradients.) The host learns of it a step later, without waiting for the GPU.
        nonfinite = ~(torch.isfinite(grad_norm) & torch.isfinite(step_loss))
        optimizer.optimizer.found_inf = step_flags.push(step + 1, nonfinite, ctx.stop.requested)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step_count"] += 1
        step = state["step_count"]
        # the flags that have arrived; all of them where the host stops anyway (logging, saving, the
        # end) or while steps are failing, so that a run of failures stops at the step it should
        log_step = step % train.log_interval == 0 or step == ctx.max_steps
        wait_all = (
            log_step or consecutive_nonfinite > 0 or first_step_time is None
            or (train.save_interval is not None and step % train.save_interval == 0)
        )
        flags = step_flags.pop(wait_all)
        stop_now = any(stop_requested for _, _, stop_requested in flags)
        if stop_now:  # stopping at this step: its checkpoint must count this step's skip too
            flags += step_flags.pop(wait_all=True)
        for flagged_step, skipped, _ in flags:
            if skipped:
                state["skipped_steps"] += 1
                consecutive_nonfinite += 1
                fabric.print(f"step {flagged_step}: non-finite loss or gradient norm, update skipped ({consecutive_nonfinite} in a row)")
            else:
                consecutive_nonfinite = 0
        if first_step_time is None:
            if fabric.device.type == "cuda":
                torch.cuda.synchronize(fabric.device)  # the step done, not only queued
            first_step_time = time.time() - PROCESS_START
            graphs_at_first_step = compiled_graphs()
            # where the start-up went: each phase ends at the time shown (seconds from process start)
            phases = dict(ctx.startup, **{"loop started": loop_start})
            fabric.print(
                f"Time to first optimizer step: {first_step_time:.1f}s (from process start; "
                + ", ".join(f"{name} at {t:.1f}s" for name, t in phases.items())
                + f"); torch.compile graphs so far: {graphs_at_first_step}"
            )
            fabric.log_dict({"time_to_first_step_s": first_step_time}, step=step)
            if fabric.global_rank == 0:
                with open(metrics_path, "a", encoding="utf-8") as f:
                    record = {"step": step, "time_to_first_step_s": first_step_time, "compiled_graphs": graphs_at_first_step,
                              "startup_phases_s": phases}
                    f.write(json.dumps(record) + "\n")
        pending.append((step, step_loss.detach(), lr, grad_norm.detach(), fingerprint))

        if consecutive_nonfinite >= train.max_nonfinite_steps:
            flush_metrics(fabric, metrics_path, pending)
            save_checkpoint(fabric, state, ctx, f"step-{step:08d}")
            raise RuntimeError(
                f"{consecutive_nonfinite} consecutive steps with a non-finite loss or gradient norm "
                f"(train.max_nonfinite_steps={train.max_nonfinite_steps}); the last good weights are saved in "
                f"{ctx.out_dir / f'step-{step:08d}'}. Lower optimizer.lr or check the data."
            )

        if log_step or stop_now:
            losses = flush_metrics(fabric, metrics_path, pending)  # waits for the GPU: the window ends here
            now = time.perf_counter()
            elapsed_window = now - window_start
            tokens_per_sec = (step - window_step) * tokens_per_step / max(elapsed_window, 1e-9)
            metrics = {
                "loss": losses[-1], "lr": lr, "grad_norm": float(grad_norm), "tokens_per_sec": tokens_per_sec,
                "tokens": step * tokens_per_step, "skipped_steps": state["skipped_steps"],
            }
            if peak is not None:
                metrics["mfu"] = flops_token * tokens_per_sec / (peak * fabric.world_size)
            if fabric.device.type == "cuda":
                metrics["max_memory_gb"] = torch.cuda.max_memory_allocated(fabric.device) / 1e9
            if ctx.compile:
                # graphs Dynamo built after the first step: a shape, dtype or mode it had not seen
                # (validation's no_grad is one); each costs seconds to minutes of compilation
                metrics["recompilations"] = compiled_graphs() - graphs_at_first_step
            fabric.log_dict(metrics, step=step)
            if fabric.global_rank == 0:  # the speed figures also go to metrics.jsonl (the losses are there per step)
                with open(metrics_path, "a", encoding="utf-8") as f:
                    speed = {k: v for k, v in metrics.items() if k not in ("loss", "lr", "grad_norm")}
                    f.write(json.dumps({"step": step, **speed}) + "\n")
            seconds_per_step = (now - run_start) / max(step - start_step, 1)
            eta = seconds_per_step * (ctx.max_steps - step)
            fabric.print(progress_line(step, ctx.max_steps, metrics, eta))
            window_start, window_step = now, step

        if stop_now:
            flush_metrics(fabric, metrics_path, pending)
            save_checkpoint(fabric, state, ctx, f"step-{step:08d}")
            fabric.print(f"Stop requested by signal: checkpoint saved at step {step}; resume with --resume auto")
            stopped_by_signal = True
            break
        paused = time.perf_counter()
        if step % ctx.eval.interval == 0 and step < ctx.max_steps:
            val_loss = validate(fabric, model, val_dataloader, ctx.eval.max_iters, ctx.cuda_graphs)
            log_validation(fabric, metrics_path, step, val_loss)
        if train.save_interval is not None and step % train.save_interval == 0 and step < ctx.max_steps:
            flush_metrics(fabric, metrics_path, pending)
            save_checkpoint(fabric, state, ctx, f"step-{step:08d}")
        window_start += time.perf_counter() - paused  # tokens/s measures training, not validation or saving

    elapsed = time.perf_counter() - run_start
    flush_metrics(fabric, metrics_path, pending)
    if stopped_by_signal:
        return
    finish(fabric, state, val_dataloader, ctx, metrics_path)
    trained_tokens = (state["step_count"] - start_step) * tokens_per_step
    summary = (
        f"Training finished: {state['step_count'] * tokens_per_step:,} tokens in total "
        f"({trained_tokens:,} in this run) | elapsed {format_seconds(elapsed)} | "
        f"{trained_tokens / max(elapsed, 1e-9):,.0f} tokens/s"
    )
    if fabric.device.type == "cuda":
        summary += f" | peak memory {torch.cuda.max_memory_allocated(fabric.device) / 1e9:.2f} GB"
    fabric.print(summary)


def finish(fabric: L.Fabric, state: Dict[str, Any], val_dataloader, ctx: RunContext, metrics_path: Path) -> None:
    """The end of a run: the final validation, then out_dir/final/."""
    if ctx.eval.final_validation:
        val_loss = validate(fabric, state["model"], val_dataloader, ctx.eval.max_iters, ctx.cuda_graphs)
        log_validation(fabric, metrics_path, state["step_count"], val_loss)
    save_checkpoint(fabric, state, ctx, "final")


@torch.no_grad()
def validate(fabric: L.Fabric, model, val_dataloader, max_iters: int, cuda_graphs: bool = False) -> Optional[float]:
    """Mean loss over `max_iters` validation batches per rank, averaged over ranks (None without validation data)."""
    if val_dataloader is None:
        return None
    model.eval()
    losses = []
    for i, batch in enumerate(val_dataloader):
        if i >= max_iters:
            break
        batch = batch.long()
        if cuda_graphs:
            # one generation of graphs per forward pass, as in training. Without a step marked (a validation
            # before the first training step), each compiled Block's call would start a generation of its own
            # and free the outputs of the Block before it, which are this Block's inputs
            torch.compiler.cudagraph_mark_step_begin()
        losses.append(model(batch[:, :-1].contiguous(), targets=batch[:, 1:].contiguous()))
    model.train()
    if not losses:
        raise RuntimeError("the validation dataloader yielded no batch: check the data module's validation split")
    val_loss = torch.stack(losses).mean()
    return float(fabric.all_reduce(val_loss, reduce_op="mean"))


def compiled_graphs() -> int:
    """How many frames torch.compile (Dynamo) has compiled in this process, first compilations included."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def compute_loss(model, input_ids: torch.Tensor, targets: torch.Tensor, eos_id: Optional[int]) -> torch.Tensor:
    if eos_id is None:
        return model(input_ids, targets=targets)
    # packed documents: flatten the micro-batch to one row and reset the state after each EOS
    cu_seqlens = doc_boundaries(input_ids, eos_id)
    return model(input_ids.reshape(1, -1), targets=targets.reshape(1, -1), cu_seqlens=cu_seqlens)


def doc_boundaries(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """cu_seqlens (int32, starting at 0, ending at B*T) for the rows of `input_ids` [B, T] laid end to
    end: a document starts at each row start and after each EOS token."""
    B, T = input_ids.shape
    flat = input_ids.reshape(-1)
    after_eos = torch.nonzero(flat == eos_id).flatten() + 1
    row_starts = torch.arange(0, B * T + 1, T, device=flat.device)
    bounds = torch.unique(torch.cat([row_starts, after_eos]))  # sorted; B*T appears once
    return bounds.to(torch.int32)


def batch_fingerprint(batch: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of a batch's token ids and their positions, computed on the device. Logged per
    step (summed over micro-batches and ranks) so that two runs can be checked to see the same data."""
    weights = torch.arange(1, batch.numel() + 1, device=batch.device, dtype=torch.int64).view_as(batch) * 1_000_003 + 7
    return ((batch.to(torch.int64) + 1) * weights).sum()


class StepFlags:
    """Each step's flags - update skipped (non-finite loss or gradient norm), stop requested (a signal, which
    may reach one rank only) - summed over ranks on the device, so that every rank skips the same updates
    and stops at the same step without the host waiting for the GPU after each step. The host reads a
    step's flags once they have arrived (`pop`), usually one step later."""

    def __init__(self, fabric: L.Fabric):
        self.fabric = fabric
        self.queue: deque = deque()  # (step, flags on the host or being copied there, copy-done event)

    def push(self, step: int, nonfinite: torch.Tensor, stop_requested: bool) -> torch.Tensor:
        """Queue this step's flags; returns 1.0 where any rank's update is to be skipped, else 0.0 (on the device)."""
        device = nonfinite.device
        flags = torch.stack([nonfinite.float(), torch.full((), float(stop_requested), device=device)])
        if self.fabric.world_size > 1:
            # not fabric.all_reduce: it starts with a barrier, which waits for the GPU
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.SUM)
        if device.type == "cuda":
            host = torch.empty(2, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flags, None
        self.queue.append((step, host, event))
        return (flags[0] > 0).float()

    def pop(self, wait_all: bool) -> List[Tuple[int, bool, bool]]:
        """(step, update skipped, stop requested) of the queued steps but the newest, or of all when
        wait_all (waiting for the GPU to get there)."""
        popped = []
        while self.queue and (wait_all or len(self.queue) > 1):
            step, host, event = self.queue.popleft()
            if event is not None:
                event.synchronize()
            skipped, stop = host.tolist()
            popped.append((step, skipped > 0, stop > 0))
        return popped


class CycleIterator:
    """Iterate a dataloader forever, starting a new epoch when one ends (`empty_error` if a new one is empty)."""

    def __init__(self, iterable, empty_error: str = "the dataloader yields no batch"):
        self.iterable = iterable
        self.empty_error = empty_error
        self.epoch = 0
        self._iterator: Optional[Iterator] = None

    def __next__(self):
        if self._iterator is None:
            self._iterator = iter(self.iterable)
        try:
            return next(self._iterator)
        except StopIteration:
            self.epoch += 1
            self._iterator = iter(self.iterable)
            try:
                return next(self._iterator)
            except StopIteration:  # a whole epoch without a batch: the data is too small
                raise ValueError(self.empty_error) from None

    def __iter__(self):
        return self


class StopRequest:
    """SIGTERM or SIGUSR1 (a scheduler's preemption notice) -> checkpoint at the next step boundary, exit 0."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.requested = False

    def __enter__(self) -> "StopRequest":
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def install(self) -> None:
        self.previous = {}
        for name in self.SIGNALS:
            if hasattr(signal, name):
                self.previous[name] = signal.signal(getattr(signal, name), self._handle)

    def uninstall(self) -> None:
        for name, handler in getattr(self, "previous", {}).items():
            signal.signal(getattr(signal, name), handler)

    def _handle(self, signum, frame) -> None:
        self.requested = True


# ---------------------------------------------------------------- logging


def flush_metrics(fabric: L.Fabric, path: Path, pending: List) -> List[float]:
    """Write the pending per-step records to metrics.jsonl (rank 0) and return their losses, averaged
    over ranks. One device-to-host transfer per call, not per step."""
    if not pending:
        return []
    losses = torch.stack([p[1] for p in pending]).float()
    fingerprints = torch.stack([p[4] for p in pending])
    if fabric.world_size > 1:
        losses = fabric.all_reduce(losses, reduce_op="mean")
        fingerprints = fabric.all_reduce(fingerprints, reduce_op="sum")
    norms = torch.stack([p[3].float() for p in pending])
    loss_values, norm_values, fingerprint_values = losses.tolist(), norms.tolist(), fingerprints.tolist()
    if fabric.global_rank == 0:
        with open(path, "a", encoding="utf-8") as f:
            for (step, _, lr, _, _), loss, norm, data in zip(pending, loss_values, norm_values, fingerprint_values):
                record = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm, "data_fingerprint": data}
                f.write(json.dumps(record) + "\n")
    pending.clear()
    return loss_values


def log_validation(fabric: L.Fabric, path: Path, step: int, val_loss: Optional[float]) -> None:
    if val_loss is None:
        return
    val_ppl = math.exp(min(val_loss, 100.0))
    fabric.log_dict({"val_loss": val_loss, "val_ppl": val_ppl}, step=step)
    fabric.print(f"step {step}: val_loss {val_loss:.4f} | val_ppl {val_ppl:.2f}")
    if fabric.global_rank == 0:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, "val_loss": val_loss, "val_ppl": val_ppl}) + "\n")


def progress_line(step: int, max_steps: int, m: Dict[str, float], eta: float) -> str:
    line = (
        f"step {step}/{max_steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | grad_norm {m['grad_norm']:.3f} | "
        f"{m['tokens_per_sec']:,.0f} tok/s"
    )
    if "mfu" in m:
        line += f" | MFU {100 * m['mfu']:.1f}%"
    if "max_memory_gb" in m:
        line += f" | mem {m['max_memory_gb']:.1f} GB"
    if m.get("recompilations"):
        line += f" | recompilations {m['recompilations']}"
    return line + f" | ETA {format_seconds(eta)}"


def format_seconds(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}"


def make_logger(name: str, out_dir: Path, hparams: Dict[str, Any]):
    if name == "tensorboard":
        from lightning.fabric.loggers import TensorBoardLogger

        return TensorBoardLogger(root_dir=out_dir / "logs", name="tensorboard")
    if name == "csv":
        return CSVLogger(root_dir=out_dir / "logs", name="csv")
    if name == "wandb":
        try:
            from lightning.pytorch.loggers import WandbLogger
            import wandb  # noqa: F401
        except ImportError as e:
            raise ImportError("logger_name=wandb needs the wandb package: pip install wandb") from e
        return WandbLogger(project="fabric-lin", name=out_dir.name, save_dir=str(out_dir / "logs"), resume="allow", config=hparams)
    raise ValueError(f"logger_name must be tensorboard, csv or wandb, got {name!r}")


# ---------------------------------------------------------------- model helpers


def resolve_model_config(model_name: Optional[str], model_config: Optional[Config]) -> Config:
    if (model_name is None) == (model_config is None):
        raise ValueError("give exactly one of --model_name and --model_config (`fabric-lin pretrain list` shows the names)")
    return Config.from_name(model_name) if model_name is not None else model_config


def canonical_name(name: str) -> str:
    """A parameter name without the prefixes that compile, FSDP, DDP, Fabric and checkpoint wrappers add."""
    for prefix in ("_forward_module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module."):
        name = name.replace(prefix, "")
    return name.removeprefix("module.")  # DistributedDataParallel's (the model has no submodule of that name)


def no_decay_parameter_names(model: torch.nn.Module) -> set:
    """Norm weights and biases: no weight decay."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            if isinstance(module, RMSNorm) or param_name == "bias":
                names.add(canonical_name(f"{module_name}.{param_name}" if module_name else param_name))
    return names


def load_initial_weights(model_dir: Path, config: Config, log=print) -> Dict[str, torch.Tensor]:
    """The weights of a model directory, checked against `config` (names, shapes, dtypes: each mismatch
    listed); a model_config.yaml there that differs from `config` in fields that keep the shapes (eps,
    context length, ...) is reported, not refused: continued pretraining may change them on purpose."""
    from fabric_lin.convert.model_dir import load_model_dir_weights  # weights_only, names the mismatches

    saved_config = Path(model_dir) / "model_config.yaml"
    if saved_config.is_file():
        saved = Config.from_file(saved_config)
        differ = {k: (v, getattr(config, k)) for k, v in vars(saved).items() if k != "name" and getattr(config, k, v) != v}
        if differ:
            log(
                f"Warning: --initial_checkpoint_dir {model_dir}: its model_config.yaml differs from this run's model in "
                + ", ".join(f"{k} ({a!r} there, {b!r} here)" for k, (a, b) in sorted(differ.items()))
            )
    return load_model_dir_weights(model_dir, config)


def load_tokenizer(tokenizer_dir: Optional[Path]):
    if tokenizer_dir is None:
        return None
    from fabric_lin.data.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir)


# ---------------------------------------------------------------- checkpoints


def save_checkpoint(fabric: L.Fabric, state: Dict[str, Any], ctx: RunContext, name: str) -> Path:
    """Write out_dir/<name>/ atomically: everything goes into out_dir/.tmp-<name>/, renamed last."""
    final_dir = ctx.out_dir / name
    tmp_dir = ctx.out_dir / f".tmp-{name}"
    if fabric.global_rank == 0:
        if tmp_dir.exists():  # left by a run killed while saving
            shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(parents=True)
    fabric.barrier()
    state["rng_states"] = get_rng_states()
    fabric.save(tmp_dir / CHECKPOINT_FILE, state)  # every rank takes part; it ends with a barrier
    if fabric.global_rank == 0:
        (tmp_dir / STEP_FILE).write_text(json.dumps({"step_count": state["step_count"]}) + "\n")
        save_hparams(ctx.hparams, tmp_dir / "hyperparameters.yaml")
        ctx.config.save(tmp_dir / "model_config.yaml")
        if ctx.tokenizer_dir is not None:
            from fabric_lin.data.tokenizer import copy_tokenizer_files

            copy_tokenizer_files(ctx.tokenizer_dir, tmp_dir)
        fsync_tree(tmp_dir)
        if final_dir.exists():  # e.g. a resumed run passing a step it had saved before
            old = ctx.out_dir / f".tmp-old-{name}"
            if old.exists():
                shutil.rmtree(old)
            os.replace(final_dir, old)
            os.replace(tmp_dir, final_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp_dir, final_dir)
        fsync_dir(ctx.out_dir)
        if name != "final" and ctx.train.keep_last_n is not None:
            prune_checkpoints(ctx.out_dir, ctx.train.keep_last_n)
        fabric.print(f"Saved checkpoint {final_dir}")
    fabric.barrier()
    return final_dir


def step_checkpoints(out_dir: Path) -> List[Path]:
    """Complete step-* checkpoints, oldest first."""
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir() if STEP_DIR_PATTERN.match(p.name) and (p / CHECKPOINT_FILE).exists()]
    return sorted(found, key=lambda p: int(STEP_DIR_PATTERN.match(p.name).group(1)))


def find_resume_dir(resume: Union[bool, str, Path], out_dir: Path) -> Optional[Path]:
    """The checkpoint directory to resume from, or None for a fresh start.

    auto/true pick the complete checkpoint with the highest step: `final/` when it is at least as new as
    every step-* directory (a run extended past its first max_steps saves step-* directories after its
    old `final/`); temporary `.tmp-*` directories are never considered."""
    if resume is False or resume is None:
        return None
    if resume is True or resume == "auto":
        candidates = [(int(STEP_DIR_PATTERN.match(p.name).group(1)), 0, p) for p in step_checkpoints(out_dir)]
        final = final_checkpoint_step(out_dir)
        if final is not None:
            candidates.append((final, 1, out_dir / "final"))  # on a tie, final/ (its validation is done)
        if candidates:
            return max(candidates)[2]
        if resume == "auto":
            return None
        raise FileNotFoundError(f"--resume true: no checkpoint (step-XXXXXXXX/ or final/ with {CHECKPOINT_FILE}) in {out_dir}")
    path = Path(resume)
    if path.name == CHECKPOINT_FILE:
        path = path.parent
    if not (path / CHECKPOINT_FILE).exists():
        raise FileNotFoundError(f"--resume {resume}: expected a checkpoint directory holding {CHECKPOINT_FILE}")
    return path


def final_checkpoint_step(out_dir: Path) -> Optional[float]:
    """The step of a complete out_dir/final/ (inf when it predates step.json: then taken as the newest), or None."""
    final = out_dir / "final"
    if not (final / CHECKPOINT_FILE).exists():
        return None
    try:
        return int(json.loads((final / STEP_FILE).read_text())["step_count"])
    except (OSError, ValueError, KeyError, TypeError):
        return float("inf")


def prune_checkpoints(out_dir: Path, keep_last_n: int) -> None:
    """Delete all but the newest `keep_last_n` complete step-* checkpoints (called after a save completes)."""
    for old in step_checkpoints(out_dir)[:-keep_last_n]:
        # rename first, so a kill during the deletion leaves a .tmp- directory, never a partial step-*
        doomed = out_dir / f".tmp-deleted-{old.name}"
        os.replace(old, doomed)
        shutil.rmtree(doomed)


def fsync_tree(root: Path) -> None:
    for dirpath, _, filenames in os.walk(root):
        for filename in filenames:
            with open(os.path.join(dirpath, filename), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_out_dir_writable(out_dir: Path) -> None:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".tmp-write-test-{os.getpid()}"
        probe.write_bytes(b"0" * 4096)
        probe.unlink()
    except OSError as e:
        raise OSError(f"out_dir {out_dir} is not writable: {e}") from e


def checkpoint_bytes(config: Config) -> int:
    """Size of one training checkpoint: fp32 weights and AdamW's two fp32 moments."""
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(config).parameters())
    return 12 * n


def check_free_space(out_dir: Path, config: Config) -> None:
    needed = checkpoint_bytes(config)
    free = shutil.disk_usage(out_dir).free
    if free < needed:
        raise OSError(
            f"out_dir {out_dir} has {free / 1e9:.2f} GB free, but one checkpoint of {config.name or 'this model'} "
            f"takes {needed / 1e9:.2f} GB (fp32 weights and optimizer state): free space or choose another out_dir"
        )


def get_rng_states() -> Dict[str, Any]:
    """Python, NumPy and torch generator states, as tensors and plain values (loadable with weights_only)."""
    np_state = np.random.get_state()
    states = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Dict[str, Any]) -> None:
    if not states:
        return
    random.setstate(tuple(states["python"]) if not isinstance(states["python"], tuple) else states["python"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


# ---------------------------------------------------------------- hyperparameters


def capture_hparams(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """setup()'s arguments as plain data, written as hyperparameters.yaml (usable with --config)."""
    return {key: to_plain(value) for key, value in arguments.items()}


def to_plain(value: Any) -> Any:
    if isinstance(value, DataModule) and is_dataclass(value):
        cls = type(value)
        init_args = {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in fields(value) if f.init}
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def save_hparams(hparams: Dict[str, Any], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(hparams, f, sort_keys=False)
