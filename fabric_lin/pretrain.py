"""`fabric-lin pretrain`: pretrain a GLA (or transformer baseline) language model with Lightning Fabric.

Reads top to bottom: `setup()` (the command line: check arguments, build Fabric, launch) ->
`main()` (seed, data, model, optimizer, resume) -> `fit()` (the loop) -> `validate()`; then the
pieces they use. Elsewhere: the checkpoint format in `fabric_lin.checkpoint`, the learning-rate
schedule in `fabric_lin.lr_schedule`, what is logged in `fabric_lin.metrics`, the option groups in
`fabric_lin.args`, a batch's loss and checksum in `fabric_lin.batches`, signals and skipped steps in
`fabric_lin.stopping`, what a run checks of earlier work (out_dir, --resume, --initial_checkpoint_dir, tokenizers) in
`fabric_lin.run_start`, the model and optimizer as Fabric sets them up (initialisation, FP8, activation checkpointing,
compilation, the GLA kernel search) in `fabric_lin.model_setup`.
"""
import contextlib
import inspect
import math
import os
import sys
import threading
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, ContextManager, Dict, Iterator, List, Literal, Optional, Tuple, Union

import lightning_fabric as L
import torch
from lightning_fabric.strategies import ModelParallelStrategy
from torch.distributed.tensor import DTensor

from fabric_lin.args import CompileArgs, EvalArgs, OptimizerArgs, ParallelismArgs, TrainArgs
from fabric_lin.batches import CycleIterator, batch_fingerprint, compute_loss
from fabric_lin.checkpoint import (
    HPARAMS_FILE,
    Checkpointer,
    check_out_dir,
    delete_checkpoints,
    load_train_state,
    select_resume_dir,
    set_aside_later_checkpoints,
    to_plain,
    train_state,
)
from fabric_lin.config import OTHER_VOCAB_SIZE, Config, resolve_model_config
from fabric_lin.cpu_cores import check_cpu_processes, loader_workers, set_cpu_threads
from fabric_lin.data import DataModule, SampleCorpus
from fabric_lin.data.sample_order import TrainLoader, repeated_samples_note
from fabric_lin.errors import PEER_LOST_EXIT_CODE, InvalidValue, PeerLost, UserError, process_rank
from fabric_lin.files import check_dir_can_be_made, environment_variables, missing_ancestors, read_yaml, remove_empty_dirs
from fabric_lin.flops import flops_per_token, peak_flops
from fabric_lin.fp8 import FP8Args, check_fp8
from fabric_lin.lr_schedule import TokenSchedule, learning_rate
from fabric_lin.metrics import MetricsWriter, make_logger
from fabric_lin.model_setup import COMPILE_CACHE_DIR, build_model, gpt_options, make_optimizer, tune_gla_kernels
from fabric_lin.parallelism import (
    check_launch_variables,
    check_other_nodes_launched,
    check_torchrun_processes,
    free_gathered_weights,
    launching_rank_watched,
    make_strategy,
    peer_lost_during,
)
from fabric_lin.precompile import precompile_first_step
from fabric_lin.rendezvous import joining_watched, rendezvous_of
from fabric_lin.run_identity import (
    check_changeable, check_every_process_runs_this_command, compare_with_checkpoint, recorded_settings,
)
from fabric_lin.run_start import (
    check_earlier_run,
    check_initial_checkpoint_dir,
    check_no_checkpoint_went_missing,
    check_out_dir_is_no_model_or_data,
    check_trained_on_these_ids,
    how_to_continue_without_the_peer,
    load_tokenizer,
    resume_hint,
    run_tokenizer_dir,
    training_data_tokenizer,
    with_training_data,
)
from fabric_lin.save_failures import CheckpointFileIO
from fabric_lin.stopping import StepFlags, StopRequest

IGNORED_TARGET = -100  # the cross-entropy's ignore_index: rows that pad a validation batch count no loss

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
    resume_changes: Optional[List[str]] = None,
    overwrite: bool = False,
    initial_checkpoint_dir: Optional[Path] = None,
    data: Optional[DataModule] = None,
    train: TrainArgs = TrainArgs(),
    eval: EvalArgs = EvalArgs(),
    optimizer: OptimizerArgs = OptimizerArgs(),
    parallelism: ParallelismArgs = ParallelismArgs(),
    compile: CompileArgs = CompileArgs(),
    fp8: FP8Args = FP8Args(),
    devices: Union[int, Literal["auto"]] = "auto",
    num_nodes: int = 1,
    seed: int = 42,
    tokenizer_dir: Optional[Path] = None,
    logger_name: Literal["tensorboard", "csv", "wandb"] = "tensorboard",
    reset_state_at_doc_boundaries: bool = False,
) -> None:
    """Pretrain a model.

    Arguments:
        model_name: A name from `fabric-lin pretrain list` (mutually exclusive with model_config; either one given
            on the command line replaces the other of a --config file).
        model_config: A full model configuration (the fields of `fabric_lin.config.Config`).
        out_dir: Directory for checkpoints (step-XXXXXXXX/, final/), logs and metrics.jsonl.
        precision: bf16-mixed, bf16-true, 16-mixed (CUDA only) or 32-true. Default: bf16-mixed on GPU, 32-true on CPU.
        resume: false: start fresh (refused where out_dir holds an earlier run's checkpoints, see overwrite).
            true: resume from the newest checkpoint in out_dir that verifies against its manifest (error if none).
            auto: the same, or a fresh start if out_dir holds no checkpoint (and its metrics.jsonl records none saved
            there). A path: resume from that checkpoint directory. A damaged checkpoint is reported, set aside as .damaged-<name> and not loaded.
        resume_changes: The run's settings that a resume may change on purpose, among train.global_batch_size,
            train.max_steps, train.max_tokens, data (any data.* setting) and seed; a resume that changes one
            not named here is refused, naming it (tutorials/resume.md: what each change does). A list: e.g.
            --resume_changes '[train.max_steps]'.
        overwrite: true: start afresh where out_dir holds an earlier run, deleting its checkpoints (step-*,
            final, .damaged-*, .superseded-*, .tmp-*), metrics.jsonl and metrics.superseded.jsonl before the first step
            (a command that the start-up refuses leaves them), and evaluate's
            results of its checkpoints (evaluate/step-*/, evaluate/final/); its logs/ stay (loggers add a version),
            and so does compile_cache/.
        initial_checkpoint_dir: A model directory (the output of convert_pretrained_checkpoint, convert_from_llama or
            convert_from_hf) whose weights initialise the model before training (continued pretraining; the optimizer
            and the data order start afresh); the model must be the directory's, the data tokenized by its tokenizer.
        data: The data module. Default: SampleCorpus (a small corpus shipped with the package).
        train: Training schedule, batch sizes and checkpointing.
        eval: Validation.
        optimizer: AdamW settings.
        parallelism: How several processes share the work: FSDP2 (sharded) or DDP, FSDP's unit and resharding,
            activation checkpointing.
        compile: torch.compile (on by default with CUDA), its caches and mode, the GLA kernels' launch search.
        fp8: FP8 products for the projections (in the fused ops or through torchao; compute capability 8.9+).
        devices: Devices per node ("auto": every GPU, or one CPU process).
        num_nodes: Number of nodes.
        seed: Random seed (weights; the data order follows the data module's own seed).
        tokenizer_dir: Directory of tokenizer.model. Default: the data module's tokenizer, if it has one.
        logger_name: tensorboard, csv or wandb (needs `pip install wandb`).
        reset_state_at_doc_boundaries: Reset the recurrent state (and attention) at each EOS token, in training and
            validation, so packed documents do not see each other.
    """
    config = resolve_model_config(model_name, model_config)
    cuda = torch.cuda.is_available()
    if devices == "auto":
        devices = torch.cuda.device_count() if cuda else 1
    if not isinstance(devices, int) or devices < 1:
        raise InvalidValue(f"--devices {devices}: expected a positive number of devices per node, or auto")
    if num_nodes < 1:
        raise InvalidValue(f"--num_nodes {num_nodes}: expected a positive number of nodes")
    if not 0 <= seed < 2**32:  # Fabric's seed_everything seeds NumPy's generator too, whose seeds are 32-bit
        raise InvalidValue(f"--seed {seed}: expected a seed from 0 to {2**32 - 1} (it seeds NumPy's generator too)")
    if cuda and devices > torch.cuda.device_count():
        raise InvalidValue(
            f"--devices {devices}: this machine has {torch.cuda.device_count()} CUDA GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); give --devices {torch.cuda.device_count()} or fewer"
        )
    check_torchrun_processes(devices, num_nodes)
    check_other_nodes_launched(num_nodes)
    check_launch_variables(devices, num_nodes)
    precision = precision or ("bf16-mixed" if cuda else "32-true")
    if precision == "16-mixed" and not cuda:
        # Fabric would run bf16-mixed instead, with a warning, while hyperparameters.yaml records 16-mixed
        raise InvalidValue("--precision 16-mixed needs a CUDA GPU (the CPU has no fp16 autocast): give --precision "
                           "bf16-mixed or 32-true (exact, and the fastest on the CPU)")
    compile = replace(compile, enabled=cuda if compile.enabled is None else compile.enabled)
    data = SampleCorpus() if data is None else data
    data.validate()
    check_changeable(resume_changes or [])
    if not cuda:
        check_cpu_processes(devices)
        set_cpu_threads(devices)
    # this run's arguments, as resolved above, for hyperparameters.yaml and the logger (loadable with --config)
    arguments = locals()
    command = to_plain({name: arguments[name] for name in inspect.signature(setup).parameters})
    hparams = recorded_settings(command)
    # after hparams, which keep the count asked for, as a larger machine runs it. A CPU run's processes share this
    # process's cores; a GPU's process may have cores of its own (a scheduler binds each rank to some), so it is
    # held to the cores it may use, not to a share of them
    data.num_workers = loader_workers(data.num_workers, processes=devices if not cuda else 1)

    # errors that would otherwise appear only after the model and the data are loaded
    train.gradient_accumulation_iters(devices, num_nodes)
    train.total_steps()
    train.validate()
    optimizer.validate(train.min_lr)
    eval.validate()
    parallelism.validate()
    compile = compile.resolve(cuda, devices, num_nodes, reset_state_at_doc_boundaries)
    if compile.kernel_autotune and config.block_type != "gla":
        raise InvalidValue(f"--compile.kernel_autotune searches the GLA kernels' launch settings; {config.name} is block_type "
                           f"{config.block_type!r}, which has no GLA layers: leave it false")
    check_fp8(fp8, torch.device("cuda" if cuda else "cpu"),
              sharded=devices * num_nodes > 1 and parallelism.data_parallel == "fsdp")
    out_dir = Path(out_dir)
    if initial_checkpoint_dir is not None:
        check_initial_checkpoint_dir(Path(initial_checkpoint_dir), resume, out_dir)
    check_dir_can_be_made(out_dir, "--out_dir")
    check_out_dir_is_no_model_or_data(out_dir)
    check_earlier_run(out_dir, resume, overwrite, config)
    created = missing_ancestors(out_dir)
    earlier_run_deleted = threading.Event()  # by main, where --overwrite true, once the start-up has passed its checks
    fabric = None
    try:
        check_out_dir(out_dir, config)
        # Fabric's processes inherit the cache locations: set before it starts any process or compiles anything
        with compile_caches_in(out_dir, compile.cache):
            strategy = make_strategy(cuda, devices, num_nodes, parallelism, precision)
            fabric = L.Fabric(
                accelerator="cuda" if cuda else "cpu", devices=devices, num_nodes=num_nodes, precision=precision,
                strategy=strategy, loggers=[make_logger(logger_name, out_dir, hparams, continuing=resume is not False)],
                # FSDP writes its shards itself (torch.distributed.checkpoint, in place) and takes no such plugin
                plugins=[] if isinstance(strategy, ModelParallelStrategy) else [CheckpointFileIO()],
            )
            with peer_lost_during("the start-up"):  # training, validations and saves name themselves
                lost = partial(exit_at_once, out_dir=out_dir, resume=resume, overwrite=overwrite)
                with launching_rank_watched(lost), joining_watched(fabric, rendezvous_of(fabric, num_nodes, devices),
                                                                   parallelism, created, lost):
                    fabric.launch()
                check_every_process_runs_this_command(fabric, command, devices)
                main(
                    fabric, config, out_dir=out_dir, resume=resume, resume_changes=resume_changes or [], overwrite=overwrite,
                    earlier_run_deleted=earlier_run_deleted, initial_checkpoint_dir=initial_checkpoint_dir,
                    data=data, train=train, eval=eval, optimizer=optimizer, parallelism=parallelism, compile=compile, fp8=fp8, seed=seed,
                    tokenizer_dir=tokenizer_dir, reset_state_at_doc_boundaries=reset_state_at_doc_boundaries,
                    precision=precision, hparams=hparams,
                )
    except BaseException as error:
        if isinstance(error, PeerLost):
            error.advice = how_to_continue_without_the_peer(out_dir, resume, overwrite, earlier_run_deleted.is_set())
        if fabric is None or fabric.global_rank == 0:
            remove_empty_dirs(created)  # a failed run leaves no empty out_dir behind
        raise


def exit_at_once(lost: PeerLost, out_dir: Path, resume: Union[bool, str, Path], overwrite: bool) -> None:
    """End a rank that lost a peer in the rendezvous (the rank that started it, or rank 0's store) as the CLI ends one
    whose peer is gone (one line, PEER_LOST_EXIT_CODE), from wherever that is found: the main thread waits in the
    rendezvous, where no exception from another thread reaches it."""
    lost.advice = how_to_continue_without_the_peer(out_dir, resume, overwrite, earlier_run_deleted=False)  # main has not begun
    sys.stdout.flush()
    print(lost.line("fabric-lin pretrain", process_rank()), file=sys.stderr, flush=True)
    os._exit(PEER_LOST_EXIT_CODE)


def compile_caches_in(out_dir: Path, enabled: bool) -> ContextManager[None]:
    """Triton's and torch.compile's caches in out_dir/compile_cache (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR) while
    the run lasts, where `enabled`; afterwards the caller's own settings again, for a run started from Python."""
    if not enabled:
        return contextlib.nullcontext()
    cache = (out_dir / COMPILE_CACHE_DIR).absolute()
    return environment_variables({"TRITON_CACHE_DIR": str(cache / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})


def main(
    fabric: L.Fabric, config: Config, *, out_dir: Path, resume: Union[bool, str, Path], resume_changes: List[str],
    overwrite: bool = False, earlier_run_deleted: threading.Event, initial_checkpoint_dir: Optional[Path],
    data: DataModule, train: TrainArgs, eval: EvalArgs, optimizer: OptimizerArgs, parallelism: ParallelismArgs,
    compile: CompileArgs, seed: int, tokenizer_dir: Optional[Path], reset_state_at_doc_boundaries: bool,
    precision: str, hparams: Dict, fp8: FP8Args = FP8Args(),
) -> None:
    metrics = MetricsWriter(
        fabric, out_dir, max_steps=train.total_steps(), tokens_per_step=train.global_batch_size * train.max_seq_length,
        flops_per_token=flops_per_token(config, train.max_seq_length), peak_flops=peak_flops(fabric.device, precision),
        count_recompilations=compile.enabled,
    )
    # SIGTERM, SIGUSR1 and Ctrl-C from here on: checkpoint at the next step boundary
    with StopRequest(announce=fabric.local_rank == 0) as stop:
        resume_dir = select_resume_dir(fabric, resume, out_dir)  # before any work, so a bad --resume fails fast
        if resume_dir is None and resume == "auto":
            check_no_checkpoint_went_missing(out_dir)
        run_changes: List[str] = []
        if resume_dir is not None:
            run_changes, other_changes = compare_with_checkpoint(resume_dir, hparams, config.to_dict(), resume_changes)
            for change in run_changes:
                fabric.print(f"Resuming with a change of the run (--resume_changes): {change}")
            if other_changes:
                fabric.print(f"Note: resuming with other settings than the checkpoint's: {'; '.join(other_changes)}")
        elif resume_changes:
            fabric.print(f"Note: --resume_changes {', '.join(resume_changes)} has no effect: this run starts at step 0")
        fabric.seed_everything(seed)

        # data
        if fabric.global_rank == 0:
            data.prepare_data()
        fabric.barrier()
        given_by = "--tokenizer_dir" if tokenizer_dir is not None else "the data's recorded tokenizer"
        tokenizer_dir = run_tokenizer_dir(tokenizer_dir, data)
        tokenizer = load_tokenizer(tokenizer_dir, given_by)
        if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
            raise InvalidValue(
                f"the tokenizer in {tokenizer_dir} has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{config.vocab_size}; use a model config with vocab_size >= {tokenizer.vocab_size} ({OTHER_VOCAB_SIZE})"
            )
        if reset_state_at_doc_boundaries and tokenizer is None:
            raise InvalidValue("reset_state_at_doc_boundaries needs the EOS id: give --tokenizer_dir")
        data.connect(tokenizer=tokenizer, batch_size=train.micro_batch_size, max_seq_length=train.max_seq_length,
                     vocab_size=config.vocab_size)
        data.setup()
        trained_with = training_data_tokenizer(data, tokenizer)
        if resume_dir is not None:
            check_trained_on_these_ids(resume_dir, "--resume", tokenizer, trained_with, fix=(
                f"resume on data prepared with --tokenizer_path {resume_dir}, or train on this data in a new run"),
                log=fabric.print)
        elif initial_checkpoint_dir is not None:
            check_trained_on_these_ids(initial_checkpoint_dir, "--initial_checkpoint_dir", tokenizer, trained_with, fix=(
                f"prepare the data with --tokenizer_path {initial_checkpoint_dir}"), log=fabric.print)
        trained_with = with_training_data(trained_with, data, resume_dir or initial_checkpoint_dir)
        if tokenizer is None:  # said once the data is found good: a mistake in its paths is the error to show
            fabric.print(
                f"Warning: no tokenizer (--tokenizer_dir, or a data module that has one): the checkpoints will hold "
                f"no tokenizer files, which generate and convert_to_hf need; {type(data).__name__} reads token ids only"
            )
        train_loader = data.train_dataloader()
        if any(change.startswith("data") for change in run_changes):
            if not isinstance(train_loader, TrainLoader):
                raise InvalidValue(f"--resume_changes data: {type(data).__name__}'s training loader cannot go on in a new order")
            train_loader.new_order_allowed = True
        if resume_dir is None and isinstance(train_loader, TrainLoader):
            repeats = repeated_samples_note(train_loader.dataset, train.total_steps(), train.global_batch_size)
            if repeats:
                fabric.print(repeats)
        if resume_dir is None and train.lr_warmup_steps >= train.total_steps():
            fabric.print(warmup_past_the_end_note(train, optimizer.lr))
        val_dataloader = data.val_dataloader()
        train_dataloader = fabric.setup_dataloaders(train_loader)
        if val_dataloader is not None:  # a data module without a validation split returns None
            val_dataloader = fabric.setup_dataloaders(val_dataloader)
        metrics.startup_phase("data ready")

        # model and optimizer
        gla_launch = None  # the shipped launch settings
        if compile.kernel_autotune and fabric.device.type == "cuda" and config.block_type == "gla":
            gla_launch = tune_gla_kernels(fabric, config, train, precision, out_dir)
            metrics.startup_phase("kernels tuned")
        elif compile.kernel_autotune:  # a recipe written for GPUs, tried on the CPU: said, not refused
            fabric.print("Note: compile.kernel_autotune does nothing on the CPU: it searches the launch settings of the GLA "
                         "Triton kernels, and the CPU runs the GLA layers' PyTorch ops instead")
        if compile.precompile and precompile_first_step(  # compiles in the background until each kernel's first launch
                fabric, config, gpt_options(fabric.device, fp8, gla_launch), train.micro_batch_size, train.max_seq_length,
                tokenizer.eos_id if reset_state_at_doc_boundaries else None, fabric.print):
            metrics.startup_phase("kernels found")
        model, no_decay = build_model(  # a resume's weights are its checkpoint's: no initial weights to read
            fabric, config, seed, initial_checkpoint_dir if resume_dir is None else None, parallelism.activation_checkpointing,
            compile, gla_launch, fp8,
        )
        metrics.startup_phase("model built")
        state = train_state(model, fabric.setup_optimizers(make_optimizer(model, no_decay, optimizer)), train_dataloader)
        if resume_dir is not None:
            load_train_state(fabric, resume_dir, state)
            metrics.startup_phase("checkpoint loaded")
            if getattr(train_loader, "new_order_note", None):
                fabric.print(train_loader.new_order_note)
            jump = learning_rate_jump(resume_dir, train, optimizer.lr, state)
            if jump:
                fabric.print(jump)
        if overwrite:  # here, after every check of the start-up: a command refused before leaves the earlier run as it was
            if fabric.global_rank == 0:
                deleted = delete_checkpoints(out_dir) + metrics.delete_history()
                if deleted:
                    fabric.print(f"--overwrite true: deleted the earlier run's checkpoints and metrics in {out_dir}: {', '.join(deleted)}")
            fabric.barrier()
            earlier_run_deleted.set()
        # the steps after the checkpoint are trained again: their records leave metrics.jsonl, and where the resume
        # comes from an earlier checkpoint of out_dir, their checkpoints are set aside
        metrics.begin_attempt(state["step_count"])
        superseded = set_aside_later_checkpoints(out_dir, resume_dir) if resume_dir and fabric.global_rank == 0 else []
        if superseded:
            fabric.print(f"Resuming from an earlier checkpoint: the later ones are set aside, out of --resume auto's way: "
                         f"{', '.join(p.name for p in superseded)}")
        fabric.barrier()
        if run_changes:
            metrics.write({"step": state["step_count"], "resume_changes": run_changes})

        data_path = getattr(data, "data_path", None)
        data_name = type(data).__name__ + (f" {data_path}" if data_path is not None else "")
        train_batches = CycleIterator(train_dataloader, empty_error=(
            f"The training data ({data_name}) yields no full batch of train.micro_batch_size={train.micro_batch_size}"
            f" samples of max_seq_length + 1 = {train.max_seq_length + 1} tokens (train.max_seq_length="
            f"{train.max_seq_length}) in any DataLoader worker of a process: lower train.max_seq_length,"
            " train.micro_batch_size or data.num_workers, or give it more data"
        ))
        checkpointer = Checkpointer(out_dir, hparams, config, tokenizer_dir, keep_last_n=train.keep_last_n,
                                    trained_with=trained_with)
        metrics.log_hyperparams(hparams)  # here, so that a run failing before has written nothing into out_dir
        status = "failed"
        try:
            fit(fabric, state, Run(
                train=train, eval=eval, accumulation=train.gradient_accumulation_iters(fabric.world_size, 1),
                cuda_graphs=compile.cuda_graphs, eos_id=tokenizer.eos_id if reset_state_at_doc_boundaries else None,
                train_batches=train_batches, val_dataloader=val_dataloader, checkpointer=checkpointer, metrics=metrics,
                stop=stop, resume_hint=resume_hint(overwrite),
            ))
            status = "success"
        finally:
            metrics.close(status)
    if stop.signal_name == "SIGINT" and fabric.local_rank == 0:
        # the shell's code for a command ended by Ctrl-C, in each node's shell that got one (nodes started by hand
        # have one each); the node's other ranks exit 0, as Fabric's launcher ends every process as soon as one of
        # them exits with an error
        raise SystemExit(130)


@dataclass
class Run:
    """What the loop works with, built by `main`: the option groups that steer it and the parts that do the work."""

    train: TrainArgs
    eval: EvalArgs
    accumulation: int  # micro-batches per optimizer step on each process
    cuda_graphs: bool  # the compiled Blocks replay as CUDA graphs
    eos_id: Optional[int]  # where packed documents' state resets (reset_state_at_doc_boundaries), else None
    train_batches: Iterator  # the training data, epoch after epoch
    val_dataloader: Any  # None without validation data
    checkpointer: Checkpointer
    metrics: MetricsWriter
    stop: StopRequest
    resume_hint: str  # how to continue after a stop, as the console says it


@peer_lost_during("training")
def fit(fabric: L.Fabric, state: Dict, run: Run) -> None:
    model, optimizer, train, eval = state["model"], state["optimizer"], run.train, run.eval
    base_lr = optimizer.defaults["lr"]  # as built for this run (a loaded checkpoint sets the groups' lr only)
    tokens_per_step = train.global_batch_size * train.max_seq_length
    state["schedule_tokens_per_step"] = state["schedule_tokens_per_step"] or tokens_per_step
    schedule = TokenSchedule.of_run(train.max_steps, train.max_tokens, state["schedule_tokens_per_step"])
    start_step = state["step_count"]
    end_step = schedule.end_step(start_step, state["tokens_seen"], tokens_per_step)

    if eval.initial_validation and start_step == 0:
        validated(fabric, model, run, 0)  # a stop during it is said below: before the first step
    if start_step >= end_step:
        fabric.print(f"Nothing to train: the checkpoint is at step {start_step}, {state['tokens_seen']:,} tokens, the end of "
                     f"the schedule ({schedule.steps} steps of {schedule.unit:,} tokens)")
        if (run.checkpointer.final_step() or -1) < start_step:  # e.g. stopped by a signal at the last step
            if (final_dir := finish(fabric, state, run)) is not None:  # None: stopped during the final validation
                fabric.print(next_steps_note(final_dir, run.checkpointer.config.name))
        return
    if run.stop.requested_on_any_rank(fabric):  # during the start-up: no step taken, nothing new to save
        fabric.print(f"Stopped by {run.stop.signal_name or 'a signal'} before the first step: nothing new to save; "
                     f"to continue, {run.resume_hint}")
        return
    fabric.barrier()
    fabric.print(steps_note(train, start_step, end_step, run.accumulation, fabric.world_size))
    run.metrics.start(start_step, end_step)
    step_flags = StepFlags(fabric)

    while state["step_count"] < end_step:
        lr = scheduled_learning_rate(train, base_lr, schedule, state["tokens_seen"])
        loss, grad_norm, fingerprint = train_step(fabric, state, run, lr, step_flags)
        state["tokens_seen"] += tokens_per_step
        step = state["step_count"]
        log_step = step % train.log_interval == 0 or step == end_step
        save_step = train.save_interval is not None and step % train.save_interval == 0
        skipped, stop_now = step_flags.settle(wait=log_step or save_step or step == start_step + 1)
        state["skipped_steps"] += skipped
        if step == start_step + 1:
            run.metrics.log_first_step(step)
        run.metrics.add_step(step, loss, lr, grad_norm, fingerprint)
        if step_flags.nonfinite_in_a_row >= train.max_nonfinite_steps:
            stop_after_nonfinite_steps(fabric, state, run, step_flags.nonfinite_in_a_row)
        if log_step or stop_now:
            run.metrics.log_progress(step, lr, grad_norm, state["skipped_steps"], state["tokens_seen"])
        if stop_now:
            stop_with_checkpoint(fabric, state, run)
            return
        with run.metrics.paused():
            # the last step's validation is finish()'s where eval.final_validation asks for one
            if step % eval.interval == 0 and (step < end_step or not eval.final_validation):
                if not validated(fabric, model, run, step):
                    stop_with_checkpoint(fabric, state, run, " during its validation")
                    return
            if save_step and step < end_step:
                run.metrics.flush()
                save_checkpoint(fabric, state, run)

    elapsed = run.metrics.stop_clock()
    run.metrics.flush()
    final_dir = finish(fabric, state, run)
    if final_dir is None:  # stopped during the final validation
        return
    run.metrics.log_summary(state["step_count"], state["tokens_seen"], elapsed)
    fabric.print(next_steps_note(final_dir, run.checkpointer.config.name))


def stop_with_checkpoint(fabric: L.Fabric, state: Dict, run: Run, during: str = "") -> None:
    """The stop a signal asked for: the checkpoint of the step the run is at, and how to go on."""
    saved = save_checkpoint(fabric, state, run)
    fabric.print(f"Stopped by {run.stop.signal_name or 'a signal'} at step {state['step_count']}{during}: checkpoint "
                 f"saved in {saved}; to continue, {run.resume_hint}")
    run.metrics.flush()


def scheduled_learning_rate(train: TrainArgs, base_lr: float, schedule: TokenSchedule, tokens_seen: int) -> float:
    """The learning rate of the step that follows `tokens_seen` tokens trained, on the schedule `train` sets from base_lr."""
    return learning_rate(schedule.position(tokens_seen), base_lr, train.min_lr, train.lr_warmup_steps, schedule.steps,
                         train.lr_schedule, train.wsd_decay_fraction)


def warmup_past_the_end_note(train: TrainArgs, base_lr: float) -> str:
    """A warmup as long as the run or longer (a recipe's warmup kept for a short run): its learning rate only rises."""
    steps = train.total_steps()
    last_lr = learning_rate(steps - 1, base_lr, train.min_lr, train.lr_warmup_steps, steps, train.lr_schedule,
                            train.wsd_decay_fraction)
    return (f"Note: train.lr_warmup_steps ({train.lr_warmup_steps}) is not below the run's {steps} steps: the learning rate "
            f"rises for the whole run, to {last_lr:.2e} at its last step (optimizer.lr {base_lr:g}), and never decays to "
            f"train.min_lr (config_hub/debug.yaml warms up for 15 of its 150 steps)")


def learning_rate_jump(checkpoint_dir: Path, train: TrainArgs, base_lr: float, state: Dict) -> Optional[str]:
    """A resume whose settings give its first step another learning rate than the checkpoint's run would (a longer or
    shorter schedule, another optimizer.lr, warmup or min_lr): one line with both values. The schedule is a function of
    the tokens trained, so the learning rate jumps there, with no new warmup: raising max_steps on a run that has decayed
    to min_lr takes it back up to the longer cosine's value at that point."""
    saved = read_yaml(Path(checkpoint_dir) / HPARAMS_FILE) or {}
    saved_train = TrainArgs(**saved.get("train", {}))
    saved_lr = saved.get("optimizer", {}).get("lr", base_lr)
    unit, tokens = state["schedule_tokens_per_step"] or train.global_batch_size * train.max_seq_length, state["tokens_seen"]

    def next_lr(args: TrainArgs, lr: float) -> float:
        return scheduled_learning_rate(args, lr, TokenSchedule.of_run(args.max_steps, args.max_tokens, unit), tokens)

    schedule = TokenSchedule.of_run(train.max_steps, train.max_tokens, unit)
    if schedule.end_step(state["step_count"], tokens, train.global_batch_size * train.max_seq_length) <= state["step_count"]:
        return None  # at its end: the resume trains no step ("Nothing to train")
    before, now = next_lr(saved_train, saved_lr), next_lr(train, base_lr)
    if math.isclose(before, now, rel_tol=1e-6):
        return None
    return (f"Note: step {state['step_count'] + 1} trains at learning rate {now:.2e}, where the checkpoint's settings give "
            f"{before:.2e}: the schedule is a function of the tokens trained, so the learning rate jumps here (no new warmup)")


def train_step(fabric: L.Fabric, state: Dict, run: Run, lr: float, step_flags: StepFlags):
    """One optimizer step at learning rate `lr`: `run.accumulation` micro-batches forward and backward, clipping,
    the update. Returns the step's loss, gradient norm and data checksum, on the device (nothing waits for the GPU)."""
    model, optimizer, train = state["model"], state["optimizer"], run.train
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros((), device=fabric.device)
    fingerprint = torch.zeros((), dtype=torch.int64, device=fabric.device)
    for micro in range(run.accumulation):
        batch = next(run.train_batches).long()  # a data module's own loader may yield the stored dtype
        state["iter_num"] += 1
        fingerprint += batch_fingerprint(batch)
        input_ids = batch[:, : train.max_seq_length].contiguous()
        targets = batch[:, 1 : train.max_seq_length + 1].contiguous()
        if run.cuda_graphs:  # this micro-batch's graphs may reuse the last one's graph memory
            torch.compiler.cudagraph_mark_step_begin()
        with fabric.no_backward_sync(model, enabled=micro < run.accumulation - 1):
            loss = compute_loss(model, input_ids, targets, run.eos_id)
            fabric.backward(loss / run.accumulation)
        if run.cuda_graphs and micro == 0 and run.accumulation > 1:
            # autograd took the first micro-batch's weight gradients as the .grad tensors themselves, and
            # they live in the graphs' memory, which the next micro-batch's replay overwrites: give them
            # their own memory before the others are added in (one copy of the gradients per step)
            for p in model.parameters():
                if p.grad is not None:
                    p.grad = p.grad.clone()
        loss_sum += loss.detach()
    grad_norm = fabric.clip_gradients(model, optimizer, max_norm=train.max_norm or float("inf"), error_if_nonfinite=False)
    if isinstance(grad_norm, DTensor):  # sharded: the norm over the shards, already reduced, as a plain tensor
        grad_norm = grad_norm.full_tensor()
    step_loss = loss_sum / run.accumulation
    # A non-finite loss or gradient norm skips the update (the data is consumed and the step counted,
    # as a loss-scaler skip), decided on the device: fused AdamW leaves weights, moments and step
    # counts untouched where found_inf is set. (Under 16-mixed the loss scaler sets found_inf itself,
    # from the gradients.) The host learns of it a step later, without waiting for the GPU.
    nonfinite = ~(torch.isfinite(grad_norm) & torch.isfinite(step_loss))
    optimizer.optimizer.found_inf = step_flags.push(state["step_count"] + 1, nonfinite, run.stop.requested)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state["step_count"] += 1
    return step_loss, grad_norm, fingerprint


def stop_after_nonfinite_steps(fabric: L.Fabric, state: Dict, run: Run, in_a_row: int) -> None:
    """Save the last good weights (no bad update was applied) and stop: the run is diverging or its data is bad."""
    run.metrics.flush()
    saved = save_checkpoint(fabric, state, run)
    raise UserError(
        f"{in_a_row} consecutive steps with a non-finite loss or gradient norm (train.max_nonfinite_steps="
        f"{run.train.max_nonfinite_steps}); the last good weights are saved in {saved}. Lower optimizer.lr or check the data."
    )


def finish(fabric: L.Fabric, state: Dict, run: Run) -> Optional[Path]:
    """The end of a run: the final validation, then out_dir/final/ (returned). A signal during the validation stops
    the run (None) with the checkpoint of its last step, as a signal during that step does: a resume then validates
    and writes final/."""
    if run.eval.final_validation and not validated(fabric, state["model"], run, state["step_count"]):
        stop_with_checkpoint(fabric, state, run, " during the final validation")
        return None
    return save_checkpoint(fabric, state, run, final=True)


def steps_note(train: TrainArgs, start_step: int, end_step: int, accumulation: int, processes: int) -> str:
    """What the run trains, in the unit of every step count it is given and logs: optimizer steps, each of
    `accumulation` micro-batches on each of `processes` processes."""
    warmup = train.lr_warmup_steps
    return (f"Training optimizer steps {start_step + 1} to {end_step}, each of {train.global_batch_size} sequences x "
            f"{train.max_seq_length} tokens = {train.global_batch_size * train.max_seq_length:,} tokens (gradient accumulation "
            f"{accumulation}: {accumulation} micro-batch{'es' * (accumulation != 1)} of {train.micro_batch_size} sequences x "
            f"{processes} process{'es' * (processes != 1)}); learning rate: {warmup} warmup step{'s' * (warmup != 1)}, then "
            f"{train.lr_schedule} to {train.min_lr:.2e}. Every count of steps here and in the logs is of optimizer steps")


def next_steps_note(final_dir: Path, model_name: str) -> str:
    """Where a finished run's model is and the commands that take it on: evaluate and generate read a training
    checkpoint as it is, convert_to_hf and --initial_checkpoint_dir a model directory made of it."""
    return (f"The model: {final_dir}. Evaluate it with fabric-lin evaluate {final_dir}, sample from it with fabric-lin "
            f"generate {final_dir}; for convert_to_hf and --initial_checkpoint_dir, make a model directory of it: "
            f"fabric-lin convert_pretrained_checkpoint {final_dir} --output_dir checkpoints/{model_name or 'model'}")


@peer_lost_during("a checkpoint save")
def save_checkpoint(fabric: L.Fabric, state: Dict, run: Run, final: bool = False) -> Path:
    """Save out_dir/step-<step>/ (or final/), and record it in metrics.jsonl: a later --resume auto that finds none of
    the checkpoints recorded there knows they were moved or deleted, rather than never written."""
    saved = run.checkpointer.save(fabric, state, final=final)
    run.metrics.log_checkpoint(state["step_count"], saved.name)
    return saved


class ValidationStopped(Exception):
    """A signal (on any process) during a validation, which ends it at its next batch: a validation may take
    minutes, longer than a scheduler waits after its signal before it kills the run."""


def validated(fabric: L.Fabric, model, run: Run, step: int) -> bool:
    """Validate at `step` and log the result; False where a signal stopped the validation."""
    try:
        run.metrics.log_validation(step, validate(fabric, model, run))
    except ValidationStopped:
        return False
    return True


@torch.no_grad()
@peer_lost_during("a validation")
def validate(fabric: L.Fabric, model, run: Run) -> Optional[Tuple[float, int]]:
    """The mean loss over the tokens of the first `eval.max_iters` global batches of the validation split, all
    processes together, and their number of tokens (None without validation data). Each process reads
    `eval.max_iters` x gradient accumulation micro batches, so a validation covers the same blocks whatever the
    micro batch size and the number of processes. A batch cut short at the end of a small split is padded to a
    full micro batch whose padding counts no loss: compiled graphs keep one shape. A stop asked for by a signal ends
    it before its next batch (ValidationStopped)."""
    if run.val_dataloader is None:
        return None
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=fabric.device)
    tokens = 0
    for i, batch in enumerate(run.val_dataloader):
        if i >= run.eval.max_iters * run.accumulation:
            break
        if run.stop.requested_on_any_rank(fabric):
            model.train()
            free_gathered_weights(model)
            raise ValidationStopped
        batch = batch.long()
        inputs, targets = batch[:, :-1], batch[:, 1:]
        padding = run.train.micro_batch_size - len(batch)
        if padding > 0:
            inputs = torch.cat([inputs, inputs.new_zeros(padding, inputs.shape[1])])
            targets = torch.cat([targets, targets.new_full((padding, targets.shape[1]), IGNORED_TARGET)])
        if run.cuda_graphs:
            # one generation of graphs per forward pass, as in training. Without a step marked (a validation
            # before the first training step), each compiled Block's call would start a generation of its own
            # and free the outputs of the Block before it, which are this Block's inputs
            torch.compiler.cudagraph_mark_step_begin()
        # every process runs the forward pass, an empty batch too: under FSDP each one gathers the weights. Where
        # training resets the state at documents' starts, so does validation: val_loss measures the model trained
        loss = compute_loss(model, inputs.contiguous(), targets.contiguous(), run.eos_id)
        if len(batch):
            loss_sum += loss.double() * batch[:, 1:].numel()
            tokens += batch[:, 1:].numel()
    model.train()
    free_gathered_weights(model)
    total = fabric.all_reduce(torch.stack([loss_sum, loss_sum.new_tensor(tokens)]), reduce_op="sum")
    if total[1] == 0:
        raise UserError("the validation dataloader yielded no batch: check the data module's validation split")
    return float(total[0] / total[1]), int(total[1])
