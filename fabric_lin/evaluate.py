"""`fabric-lin evaluate`: a model's loss and perplexity on held-out data, its loss by position in the sequence
(at the training length and past it), and lm-evaluation-harness tasks, from any checkpoint.

Reads top to bottom: `main()` (the command line: load the checkpoint, the data, each sequence length, the
tasks, then the results file and the plot) -> `evaluate_length()` (one sequence length: the loss of every
token of the validation batches, summed per position) -> the pieces they use: the plot. Reading the three kinds of
checkpoint and a run's data module: checkpoint_kinds.py; lm-evaluation-harness's tasks: harness.py.

The validation batches are read as `pretrain` reads them (the data module's validation loader: the split's
blocks in their fixed order, batches of the run's micro batch size), and the loss is the mean cross-entropy over
their tokens, so `--max_batches` = eval.max_iters x global_batch_size / micro_batch_size gives the val_loss that
`pretrain` logged with the same weights: its validation read those first blocks, on any number of devices.
"""
import json
import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Literal, NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from fabric_lin.checkpoint import EVALUATION_DIR, HPARAMS_FILE, PLOT_FILE, RESULTS_FILE, to_plain, training_checkpoint_evaluation_dir
from fabric_lin.checkpoint_kinds import (
    TRAINING_CHECKPOINT,
    Checkpoint,
    check_checkpoint_dir,
    check_run_data_is_there,
    check_tokenizer_is_there,
    checkpoint_kind,
    is_run_data,
    load_checkpoint,
    plain_value,
    recorded_training_data,
    run_data_module,
)
from fabric_lin.cpu_cores import loader_workers
from fabric_lin.data import DataModule
from fabric_lin.data.tokenizer import the_recorded_tokenizer
from fabric_lin.errors import AlreadyExists, InvalidValue, UserError
from fabric_lin.files import atomic_write, check_dir_can_be_made, created_dir, expand_home
from fabric_lin.harness import LOGIT_ROWS, HarnessScorer, find_tasks, is_task_file, load_tasks, run_tasks

BUCKETS_PER_TRAINING_LENGTH = 16  # the default bucket: 1/16 of the training length

# `--data TextFiles` on the command line: jsonargparse enables subclasses of dataclasses only when told
try:
    from jsonargparse import set_parsing_settings

    set_parsing_settings(subclasses_enabled=[DataModule])
except ImportError:
    pass


def batches_read(batches: int, batch_size: int, short_batches: int) -> str:
    """How a length's result line says what was read: "30 batches of 4 (1 of them shorter: the split's last blocks)";
    one batch is "1 batch of 4", and "(shorter: ...)" where it holds fewer blocks than the batch size."""
    if batches == 1:
        return f"1 batch of {batch_size}" + (" (shorter: the split's last blocks)" if short_batches else "")
    short = f" ({short_batches} of them shorter: the split's last blocks)" if short_batches else ""
    return f"{batches} batches of {batch_size}{short}"


def main(
    checkpoint_dir: Path,
    data: Optional[DataModule] = None,
    seq_len: Union[int, List[int], None] = None,
    max_batches: Optional[int] = None,
    batch_size: Optional[int] = None,
    bucket_size: Optional[int] = None,
    bucket_edges: Optional[List[int]] = None,
    tasks: Union[str, List[str], None] = None,
    task_dir: Optional[Path] = None,
    num_fewshot: Optional[int] = None,
    limit: Optional[float] = None,
    out_dir: Optional[Path] = None,
    precision: Optional[Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]] = None,
    device: Optional[str] = None,
    overwrite: bool = False,
    reset_state_at_doc_boundaries: Optional[bool] = None,
) -> Dict[str, Any]:
    """Evaluate a model: loss, perplexity and loss by position on validation data; lm-evaluation-harness tasks.

    Args:
        checkpoint_dir: A training checkpoint (out_dir/step-XXXXXXXX or out_dir/final, sharded or not), a model
            directory (convert_pretrained_checkpoint's output) or an fla-format export (convert_to_hf's output).
        data: The data module whose validation split is read. Default: the run's own, from the checkpoint's
            hyperparameters.yaml (a model directory or an export has none: give --data, or only --tasks);
            --data.<option> without --data changes that one setting of the run's own (--data.num_workers 0).
        seq_len: One sequence length or a list of them, e.g. [2048, 4096, 8192]: the data is read in blocks of
            each length. Default: the training length (hyperparameters.yaml's train.max_seq_length, else the
            model config's max_seq_length).
        max_batches: Read at most this many batches per length (default: every block of the validation split,
            the last batch short where the blocks do not fill it). A run's validation read eval.max_iters x
            global_batch_size / micro_batch_size batches of its micro batch size. 0: no data evaluation (tasks only).
        batch_size: Sequences per batch. Default: the run's train.micro_batch_size (the same batches as its
            validation), else 1. Also the batch size of the harness's requests.
        bucket_size: Positions per bucket of the loss by position. Default: 1/16 of the training length.
        bucket_edges: Buckets of their own in place of --bucket_size: the positions where one ends and the next
            begins, e.g. [2048, 8192, 16384] for 0-2K, 2K-8K, 8K-16K and 16K to the end of each length (an edge at
            or past a length is left out for it).
        tasks: lm-evaluation-harness tasks, groups or tags ("hellaswag,arc_easy" or a list), or YAML files of
            tasks of your own. Needs `pip install -e '.[eval]'`.
        task_dir: A directory of task YAML files of your own (lm-evaluation-harness's include_path).
        num_fewshot: Few-shot examples per task (default: each task's own, else 0).
        limit: Examples per task: a whole count, or a fraction below 1 (for a quick look; not a full result).
        out_dir: Where evaluate.json and loss_by_position.png go. Default: a training checkpoint's
            <run out_dir>/evaluate/<checkpoint name>/, else <checkpoint_dir>/evaluate/. Not inside a training
            checkpoint, whose files are the ones its manifest lists.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed or 16-true. Default: bf16-mixed on a GPU (what
            pretrain validates with), 32-true on the CPU.
        device: "cpu", "cuda", "cuda:1", ... Default: cuda if there is a GPU. The fused kernels run on a GPU,
            their PyTorch references on the CPU.
        overwrite: Replace the results of an earlier evaluation in out_dir (without it, they are kept and this
            evaluation is refused before it starts).
        reset_state_at_doc_boundaries: Read each document of a block on its own, the state reset after each EOS
            token, as pretrain's option of that name trains and validates. Default: the training run's setting
            (a training checkpoint's hyperparameters.yaml), else false (the documents of a block see each other).
    """
    import lightning_fabric as L

    from fabric_lin.generate import resolve_device

    checkpoint_dir = Path(checkpoint_dir)
    seq_lens = check_arguments(seq_len, max_batches, batch_size, bucket_size, bucket_edges, num_fewshot, limit)
    task_names = task_list(tasks)
    harness_options = [name for name, value in (("--num_fewshot", num_fewshot), ("--limit", limit), ("--task_dir", task_dir))
                       if value is not None]
    if harness_options and not task_names:
        raise InvalidValue(f"{' and '.join(harness_options)} set how lm-evaluation-harness runs its tasks, and no --tasks "
                           f"is given: give --tasks, or leave {' and '.join(harness_options)} out")
    torch_device = resolve_device(device)
    cuda = torch_device.type == "cuda"
    precision = precision or ("bf16-mixed" if cuda else "32-true")
    if precision == "16-mixed" and not cuda:  # Fabric would run bf16-mixed, which evaluate.json would call 16-mixed
        raise InvalidValue("--precision 16-mixed needs a CUDA GPU (the CPU has no fp16 autocast): give --precision "
                           "bf16-mixed or 32-true (exact, and the fastest on the CPU)")
    # where the results go, and an earlier evaluation's there, before any slow work (indexing the harness's tasks,
    # reading their datasets, the weights and the data): the directory's kind is told by the names of its files
    kind = checkpoint_kind(checkpoint_dir)
    if out_dir is not None:
        check_dir_can_be_made(out_dir, "--out_dir")
        check_out_dir_outside_training_checkpoint(Path(out_dir), checkpoint_dir, kind)
    out_dir = Path(out_dir) if out_dir is not None else default_out_dir(checkpoint_dir, kind)
    if (out_dir / RESULTS_FILE).exists() and not overwrite:
        raise AlreadyExists(f"{out_dir / RESULTS_FILE} holds the {earlier_results(out_dir / RESULTS_FILE)}: write this "
                            f"one to another --out_dir, or replace them with --overwrite true")
    task_manager = find_tasks(task_names, task_dir) if task_names else None  # before the minutes of loading a model
    if task_manager is not None:  # the tasks built and their few-shot examples counted, before the model is loaded
        check_checkpoint_dir(checkpoint_dir)
        check_tokenizer_is_there(checkpoint_dir, "--tasks: ", "the harness's tasks are text")
        task_manager = load_tasks(task_manager, task_names, num_fewshot)

    checkpoint = load_checkpoint(checkpoint_dir)
    hparams = checkpoint.hparams or {}
    train_hparams = hparams.get("train") if isinstance(hparams.get("train"), dict) else {}
    train_seq_len = checkpoint.config.max_seq_length  # a training checkpoint's: its run's train.max_seq_length
    batch_size = batch_size or train_hparams.get("micro_batch_size") or 1
    seq_lens = seq_lens or [train_seq_len]
    bucket_size = bucket_size or max(1, train_seq_len // BUCKETS_PER_TRAINING_LENGTH)
    if reset_state_at_doc_boundaries is None:
        reset_state_at_doc_boundaries = bool(hparams.get("reset_state_at_doc_boundaries", False))
    # the run's own data: without --data, or with --data.* options that change only how it is loaded (the command line
    # puts the run's data module before them)
    data_of_run = max_batches != 0 and checkpoint.hparams is not None and (
        data is None or is_run_data(data, checkpoint.hparams))
    data_origin = "--data"  # where the data module comes from, as its errors name it
    if data_of_run:
        data = data if data is not None else run_data_module(checkpoint.hparams, checkpoint_dir / HPARAMS_FILE)
        data_origin = f"the run's data ({type(data).__name__}, from {checkpoint_dir / HPARAMS_FILE})"
    evaluate_data = data is not None and max_batches != 0
    if evaluate_data:
        data.validate()
    if not evaluate_data and not task_names:
        if max_batches == 0:
            raise InvalidValue("--max_batches 0 leaves nothing to evaluate: give --tasks, or more batches")
        raise InvalidValue(
            f"{checkpoint_dir} is a {checkpoint.kind}, which names no validation data (a training checkpoint's "
            f"{HPARAMS_FILE} does): give --data (e.g. --data TextFiles --data.val_dir DIR) or --tasks"
        )
    if reset_state_at_doc_boundaries and evaluate_data and checkpoint.tokenizer is None:
        raise InvalidValue(f"--reset_state_at_doc_boundaries true needs the end-of-text token's id, and {checkpoint_dir} "
                           f"has no tokenizer.model{the_recorded_tokenizer(checkpoint_dir)}")
    if checkpoint.tokenizer is not None:  # before the data is compared with it
        checkpoint.tokenizer.check_fits(checkpoint.config.vocab_size, checkpoint_dir)
    if evaluate_data:  # the data's errors (no validation split, blocks too long) before the model is set up
        data.num_workers = loader_workers(data.num_workers)  # a run's setting may come from a larger machine
        data.prepare_data()
        if data_of_run:
            check_run_data_is_there(data, checkpoint_dir / HPARAMS_FILE)
        setup_validation_data(data, data_origin, checkpoint, checkpoint_dir, batch_size)
        warn_of_training_data(data, data_origin, checkpoint_dir, checkpoint.hparams)
        validation_loader(data, data_origin, max(seq_lens))
        if checkpoint.tokenizer is None and data.validation_dirs():  # else setup_validation() checked the data with it
            check_data_tokenizer(checkpoint_dir, data, data_origin)

    fabric = L.Fabric(accelerator="cuda" if cuda else "cpu", devices=[torch_device.index or 0] if cuda else 1,
                      precision=precision)
    model = build_model(fabric, checkpoint)
    results: Dict[str, Any] = {
        "checkpoint": str(checkpoint_dir.absolute()),
        "kind": checkpoint.kind,
        "model": checkpoint.config.name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step": checkpoint.step,
        "precision": precision,
        "device": str(fabric.device),
        "train_seq_len": train_seq_len,
        "reset_state_at_doc_boundaries": reset_state_at_doc_boundaries,
    }
    print(f"{checkpoint.kind} {checkpoint_dir}: {checkpoint.config.name or 'model'}, {results['parameters']:,} parameters, "
          f"{precision} on {fabric.device}" + ("" if cuda else " (the PyTorch path)")
          + ("; each document read on its own (reset_state_at_doc_boundaries)" if reset_state_at_doc_boundaries else ""),
          flush=True)
    with created_dir(out_dir):
        if evaluate_data:
            results["data"] = to_plain(data)
            results["lengths"] = []
            for length in seq_lens:
                loader = validation_loader(data, data_origin, length)
                starts = bucket_starts(length, bucket_size, bucket_edges)
                try:
                    result = evaluate_length(fabric, model, loader, length, batch_size, max_batches, starts,
                                             checkpoint.tokenizer.eos_id if reset_state_at_doc_boundaries else None)
                except KeyboardInterrupt as stopped:  # Ctrl-C or SIGTERM: what was measured, kept
                    write_interrupted_data_results(results, out_dir, stopped, length, seq_lens, task_names)
                    raise
                results["lengths"].append(result)
                print(f"seq_len {length}: loss {result['loss']:.4f} | perplexity {result['perplexity']:.3f} | "
                      f"{result['tokens']:,} tokens in {batches_read(result['batches'], batch_size, result['short_batches'])} | "
                      f"{result['tokens_per_sec']:,.0f} tokens/s", flush=True)
        if task_names:
            scorer = HarnessScorer(fabric, model, checkpoint.tokenizer, batch_size, block_size=train_seq_len)
            try:
                results["tasks"] = run_tasks(scorer, task_names, task_manager, num_fewshot, limit)
            except (Exception, KeyboardInterrupt) as stopped:  # a failure, Ctrl-C or SIGTERM
                if evaluate_data:  # minutes or hours of evaluation, kept whatever stopped the tasks
                    write_partial_results(results, out_dir, stopped)
                raise
        write_results(results, out_dir, evaluate_data)
    return results


def earlier_results(path: Path) -> str:
    """What the evaluate.json at `path` holds, as the refusal to write over it names it: an earlier evaluation's results,
    or the partial ones of an evaluation whose tasks did not finish (`write_partial_results`)."""
    try:
        earlier = json.loads(path.read_text(encoding="utf-8"))
        partial, in_the_data = earlier.get("partial"), "not_evaluated" in earlier
    except (OSError, ValueError, AttributeError):  # not what evaluate writes: results all the same, kept
        partial = None
    if not partial:
        return "results of an earlier evaluation"
    return ("partial results of an earlier evaluation (" + ("it was interrupted as it read the validation data"
                                                            if in_the_data else "its tasks did not finish") + ")")


def interruption(stopped: KeyboardInterrupt) -> str:
    """What a KeyboardInterrupt stands for: SIGTERM (as the command's handler of it raises it), else Ctrl-C."""
    return "SIGTERM" if str(stopped) == "SIGTERM" else "Ctrl-C"


def write_interrupted_data_results(results: Dict[str, Any], out_dir: Path, stopped: KeyboardInterrupt, length: int,
                                   seq_lens: List[int], task_names: List[str]) -> None:
    """What was measured of the validation data where Ctrl-C or SIGTERM (`stopped`) came as it read `length`: the lengths
    read whole, and that length over the batches it had read (`evaluate_length`'s `measured`, marked partial itself),
    written whole as evaluate.json, marked partial first thing in the file, the lengths and tasks not reached named in
    `not_evaluated`; nothing where no batch had been read. Says which (`kept`) in the command's last line, where the
    CLI reports the interruption."""
    measured = getattr(stopped, "measured", None)
    lengths = results["lengths"] + ([measured] if measured is not None else [])
    if not lengths:
        stopped.kept = ("no batch of the validation data had been evaluated, so nothing was written; run the same "
                        "command again")
        return
    how = interruption(stopped)
    not_read = seq_lens[seq_lens.index(length) + (measured is not None):]
    whole = [str(result["seq_len"]) for result in results["lengths"]]
    said, summary = [], []
    if whole:
        said.append(f"seq_len {', '.join(whole)} {'is' if len(whole) == 1 else 'are'} whole")
        summary.append(f"seq_len {', '.join(whole)} whole")
    if measured is not None:
        said.append(f"seq_len {length} holds its first {measured['read']}")
        summary.append(f"seq_len {length} over its first {measured['read']}")
    if not_read or task_names:
        missing = [f"seq_len {', '.join(map(str, not_read))}"] if not_read else []
        missing += ["the tasks"] if task_names else []
        said.append(f"{' and '.join(missing)} {'was' if len(not_read) == 1 and not task_names else 'were'} not evaluated")
    partial = {"partial": f"the evaluation was interrupted ({how}) as it read seq_len {length}: {'; '.join(said)}",
               **results, "lengths": [{key: value for key, value in result.items() if key != "read"}
                                      for result in lengths],
               "not_evaluated": {"seq_len": not_read, **({"tasks": task_names} if task_names else {})}}
    write_results(partial, out_dir, evaluate_data=True)
    stopped.kept = (f"what had been measured is in {out_dir / RESULTS_FILE}, marked partial ({', '.join(summary)}): "
                    f"evaluate again with --overwrite true for the whole evaluation")


def write_partial_results(results: Dict[str, Any], out_dir: Path, stopped: BaseException) -> None:
    """The validation data's results, whole, where the harness's tasks did not finish: marked partial first thing in the
    file (its `partial` says why; `tasks` holds what stopped them: a failure, Ctrl-C or SIGTERM), so that nothing takes
    them for a complete evaluation. A KeyboardInterrupt carries what was written (`kept`) to the command's last line,
    which would otherwise say that nothing was."""
    if isinstance(stopped, KeyboardInterrupt):
        how = interruption(stopped)
        results["tasks"] = {"interrupted": how}
        why = f"the lm-evaluation-harness tasks were interrupted ({how})"
    else:
        results["tasks"] = {"failed": f"{type(stopped).__name__}: {stopped}"}
        why = "lm-evaluation-harness failed before its tasks finished"
    write_results({"partial": f"{why}: the validation data's results are whole, the tasks have none", **results}, out_dir,
                  evaluate_data=True)
    if isinstance(stopped, KeyboardInterrupt):
        stopped.kept = (f"the validation data's results are in {out_dir / RESULTS_FILE}, marked partial (the tasks have "
                        f"none): run the tasks alone with --max_batches 0 and another --out_dir, or everything again "
                        f"with --overwrite true")


def write_results(results: Dict[str, Any], out_dir: Path, evaluate_data: bool) -> None:
    """evaluate.json, whole or not at all, and the plot of the loss by position where the data was evaluated."""
    results_path = out_dir / RESULTS_FILE
    (out_dir / PLOT_FILE).unlink(missing_ok=True)  # an earlier evaluation's, which these results may not match
    atomic_write(results_path, lambda p: Path(p).write_text(json.dumps(results, indent=1, default=plain_value) + "\n"))
    print(f"Results: {results_path}")
    if evaluate_data:
        if plot_loss_by_position(results, out_dir / PLOT_FILE):
            print(f"Loss by position: {out_dir / PLOT_FILE}")
        else:
            print(f"Loss by position: in {results_path} (lengths[].by_position); for the plot, pip install matplotlib "
                  f"(or pip install -e '.[eval]')")


def check_arguments(seq_len, max_batches, batch_size, bucket_size, bucket_edges, num_fewshot, limit) -> List[int]:
    """The sequence lengths as a list, each value checked before any work (each wrong one named)."""
    lengths = [] if seq_len is None else [seq_len] if isinstance(seq_len, int) else list(seq_len)
    if seq_len is not None and not lengths:
        raise InvalidValue("--seq_len [] holds no length: give one or more, e.g. [2048, 4096], or leave it out for the "
                           "training length")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in lengths):
        raise InvalidValue(f"--seq_len must be a positive number of tokens or a list of them, e.g. [2048, 4096]; got {seq_len!r}")
    if max_batches is not None and max_batches < 0:
        raise InvalidValue(f"--max_batches must be 0 (no data evaluation) or a positive number of batches, got {max_batches}")
    for name, value in (("batch_size", batch_size), ("bucket_size", bucket_size)):
        if value is not None and value < 1:
            raise InvalidValue(f"--{name} must be at least 1, got {value}")
    if bucket_edges is not None:
        edges = list(bucket_edges) if isinstance(bucket_edges, (list, tuple)) else []
        positions = all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in edges)
        if not edges or not positions or edges != sorted(set(edges)):
            raise InvalidValue(
                f"--bucket_edges must be a list of increasing positive positions, e.g. [2048, 8192, 16384]; got {bucket_edges!r}"
            )
        if bucket_size is not None:
            raise InvalidValue("--bucket_size and --bucket_edges both set the buckets of the loss by position: give one")
    if num_fewshot is not None and num_fewshot < 0:
        raise InvalidValue(f"--num_fewshot must be 0 or more examples, got {num_fewshot}")
    # the harness reads a limit of 1 or more as a count and cuts it to a whole one (1.5 runs 1 example)
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        raise InvalidValue(f"--limit must be a fraction below 1 or a whole count of examples per task (e.g. 0.1 or 100); "
                           f"got {limit}")
    return list(dict.fromkeys(lengths))


def task_list(tasks: Union[str, List[str], None]) -> List[str]:
    """--tasks as a list of names: "a,b" (lm-evaluation-harness's own form), a list, or None. A task file's path
    starting with ~ starts in the home directory, as a path option's does (the option is text, not a path)."""
    if tasks is None:
        return []
    items = tasks.split(",") if isinstance(tasks, str) else [t for item in tasks for t in str(item).split(",")]
    names = [t.strip() for t in items if t.strip()]
    if not names:  # asked for tasks and given none: the data alone would be evaluated, as if --tasks were left out
        raise InvalidValue(f"--tasks {tasks!r} names no task: give task, group or tag names separated by commas "
                           "(e.g. hellaswag,arc_easy), or leave --tasks out")
    empty = [position for position, item in enumerate(items, 1) if not item.strip()]
    if empty:
        # lm-eval itself refuses the empty name (no task is named ''); dropping it would evaluate fewer tasks than
        # were meant where it is a shell variable left unset (--tasks "hellaswag,$MORE,arc_easy")
        raise InvalidValue(f"--tasks {tasks!r}: entry {empty[0]} of {len(items)} is empty (a shell variable left unset, "
                           f"or a comma too many?): every entry between commas names a task, group or tag, e.g. "
                           f"--tasks {','.join(names)}")
    return [str(expand_home(name)) if is_task_file(name) else name for name in names]


def check_data_tokenizer(checkpoint_dir: Path, data: DataModule, data_origin: str) -> None:
    """For weights without a tokenizer.model: refuse data tokenized with another tokenizer than the one their
    trained_with.json records (the loss of other ids would read as a bad model); without the record, say that nothing
    tells. `data_origin`: where `data` comes from, as the error names it."""
    from fabric_lin.data.tokenizer import TRAINED_WITH_FILE, describe_tokenizer, read_trained_with, tokenizer_identity

    data_dir = data.validation_dirs()[0]
    data_info, trained_with = data.prepared[data_dir], read_trained_with(checkpoint_dir)
    if trained_with is None:
        print(f"Note: {checkpoint_dir} holds no tokenizer.model, so nothing tells whether the data's tokenizer "
              f"({describe_tokenizer(data_info)}) is the one its model was trained with", flush=True)
    elif tokenizer_identity(trained_with) != tokenizer_identity(data_info):
        raise other_tokenizers_data(data_origin, data_dir, data_info, checkpoint_dir,
                                    f"{describe_tokenizer(trained_with)} ({TRAINED_WITH_FILE})")


def other_tokenizers_data(data_origin: str, data_dir: Path, data_info: dict, checkpoint_dir: Path, model_tokenizer: str,
                          prepare_with: str = "") -> InvalidValue:
    """The error for data (`data_dir`, its prepared.json `data_info`) tokenized with another tokenizer than the one the
    weights of `checkpoint_dir` were trained with (`model_tokenizer`, as named), `prepare_with` the option that
    prepares it with that one, where the model has its tokenizer.model. `data_origin`: --data, or the run's data (which
    only --data replaces)."""
    from fabric_lin.data.tokenizer import describe_tokenizer

    return InvalidValue(
        f"{data_origin}: {data_dir} was tokenized with {describe_tokenizer(data_info)}, and the weights of {checkpoint_dir} "
        f"were trained on the ids of {model_tokenizer}: an id is another piece in each; evaluate on data prepared with "
        f"the model's tokenizer{prepare_with}" + ("" if data_origin == "--data" else ", given with --data")
    )


def default_out_dir(checkpoint_dir: Path, kind: Optional[str]) -> Path:
    """Beside a training checkpoint, never inside it: its files are the ones its manifest lists."""
    if kind == TRAINING_CHECKPOINT:
        if checkpoint_dir.name in ("", ".."):  # `.` and `..` have no name of their own (and `.` no parent): its path has
            checkpoint_dir = Path(os.path.abspath(checkpoint_dir))
        return training_checkpoint_evaluation_dir(checkpoint_dir)
    return checkpoint_dir / EVALUATION_DIR


def check_out_dir_outside_training_checkpoint(out_dir: Path, checkpoint_dir: Path, kind: str) -> None:
    """Refuse an --out_dir in a training checkpoint, the one evaluated or another: its files are the ones its manifest
    lists, and results among them would go with it when the run prunes or replaces it (a model directory or an export
    holds its evaluate/ itself)."""
    from fabric_lin.checkpoint import is_training_checkpoint

    if kind == TRAINING_CHECKPOINT and out_dir.resolve().is_relative_to(checkpoint_dir.resolve()):
        raise InvalidValue(f"--out_dir {out_dir} is inside the training checkpoint {checkpoint_dir}, whose files are the "
                           f"ones its manifest lists: give a directory outside it, or leave --out_dir out for "
                           f"{default_out_dir(checkpoint_dir, kind)}")
    resolved = out_dir.resolve()
    another = next((d for d in (resolved, *resolved.parents) if d.is_dir() and is_training_checkpoint(d)), None)
    if another is not None:
        raise InvalidValue(f"--out_dir {out_dir} is inside the training checkpoint {another}, whose files are the ones its "
                           f"manifest lists: give a directory outside it")


def build_model(fabric, checkpoint: "Checkpoint"):
    """The model in eval mode, set up by Fabric on its device and precision: the fused kernels on CUDA, their
    PyTorch references elsewhere. The weights are taken as fp32 and Fabric casts them for a -true precision."""
    from fabric_lin.convert.model_dir import cast_floating
    from fabric_lin.model import GPT

    with torch.device("meta"):
        model = GPT(checkpoint.config, fused=fabric.device.type == "cuda")
    model.load_state_dict(cast_floating(checkpoint.state_dict, torch.float32), assign=True)
    return fabric.setup_module(model.eval())


# ---------------------------------------------------------------- the data: loss and loss by position


def setup_validation_data(data: DataModule, data_origin: str, checkpoint: "Checkpoint", checkpoint_dir: Path,
                          batch_size: int) -> None:
    """Connect the data module to the model of `checkpoint` (its tokenizer and vocabulary, batches of `batch_size`)
    and check its validation split with them: once, for every length read after. `data_origin`: where `data` comes from
    (--data, or the run's hyperparameters.yaml), as its errors name it."""
    from fabric_lin.data.prepared import PREPARED_INFO_FILE, MadeWithAnotherTokenizer, VocabularyTooLarge

    data.connect(tokenizer=checkpoint.tokenizer, batch_size=batch_size, vocab_size=checkpoint.config.vocab_size)
    try:
        data.setup_validation()
    except MadeWithAnotherTokenizer as e:  # its fix, the data's own tokenizer, is for pretrain: here the model's is read
        raise other_tokenizers_data(data_origin, e.path, e.info, checkpoint_dir, e.tokenizer.describe(),
                                    f" (--tokenizer_path {checkpoint_dir})") from None
    except VocabularyTooLarge as e:  # its fix, a model config of a larger vocabulary, is for pretrain
        raise InvalidValue(
            f"{e.path} was tokenized with a vocabulary of {e.data_vocab} tokens ({PREPARED_INFO_FILE}), more than the "
            f"{e.model_vocab} embeddings of the model of {checkpoint_dir}: its ids are not those of the tokenizer the model "
            f"was trained with; evaluate on data prepared with that tokenizer"
        ) from None


def warn_of_training_data(data: DataModule, data_origin: str, checkpoint_dir: Path,
                          hparams: Optional[Dict[str, Any]]) -> None:
    """Say in one line where the validation data is data the model was trained on, as its weights record it
    (`recorded_training_data`): the same directory, a copy of it (one index.json) or documents of the same input
    (`documents_in_common`, the comparison of a data module's validation and training directories): the loss is then
    no held-out loss. `data_origin`: where `data` comes from, as the line names it."""
    from fabric_lin.data.base import documents_in_common

    records, source = recorded_training_data(checkpoint_dir, hparams)
    for val in map(Path, data.validation_dirs()):
        for record in records:  # a file edited by hand may hold anything: what is not a record of its kind tells nothing
            train = Path(record["dir"]) if isinstance(record.get("dir"), str) else None
            documents = record.get("documents") if isinstance(record.get("documents"), dict) else {}
            if train is not None and train.resolve() == val.resolve():
                said = "is the data the model was trained on"
            else:
                how = documents_in_common(val, data.prepared[val], record.get("index"), documents)
                said = f"holds documents of {train or 'the data'}, which the model was trained on: {how}" if how else None
            if said:
                print(f"Warning: {data_origin}: {val} {said} (as {source} records): the loss on it is not a held-out "
                      f"loss", flush=True)
                return


def validation_loader(data: DataModule, data_origin: str, seq_len: int):
    """The validation loader of the data module that `setup_validation_data` set up, its blocks `seq_len` + 1 tokens
    long. `data_origin`: where `data` comes from, as its errors name it."""
    from fabric_lin.data.prepared import BlockTooLong

    data.connect(tokenizer=data.tokenizer, batch_size=data.batch_size, max_seq_length=seq_len, vocab_size=data.vocab_size)
    try:
        loader = data.val_dataloader()
    except BlockTooLong as e:  # blocks longer than the data's chunk files, or than the whole split
        raise e.for_setting("--seq_len") from None
    except ValueError as e:
        raise InvalidValue(f"reading the validation data with --seq_len {seq_len}: {e}") from None
    if loader is None:
        with_validation = ("TextFiles --data.val_dir DIR, TokenChunks --data.val_path DIR, "
                           "SlimPajamaStarcoder --data.validation true")
        if data_origin == "--data":
            raise InvalidValue(f"{type(data).__name__} gives no validation data, which evaluate reads: give a data module "
                               f"with a validation split ({with_validation})")
        raise InvalidValue(f"{data_origin} has no validation split, which evaluate reads: give --data with one "
                           f"({with_validation})")
    return loader


def bucket_starts(seq_len: int, bucket_size: Optional[int], bucket_edges: Optional[List[int]]) -> List[int]:
    """The first position of each bucket of the loss by position: at `bucket_edges` where given, else every
    `bucket_size` positions."""
    if bucket_edges is not None:
        return [0] + [edge for edge in bucket_edges if edge < seq_len]
    return list(range(0, seq_len, bucket_size))


class BatchesRead(NamedTuple):
    """What the batches of one length read so far sum to (`evaluate_length`): the loss per position (fp64), the sum of
    their blocks' checksums, their rows, their number and how many were short."""

    sums: torch.Tensor
    fingerprint: torch.Tensor
    rows: int = 0
    batches: int = 0
    short_batches: int = 0


@torch.no_grad()
def evaluate_length(fabric, model, loader, seq_len: int, batch_size: int, max_batches: Optional[int],
                    starts: Sequence[int], eos_id: Optional[int] = None) -> Dict[str, Any]:
    """The loss of every token of the loader's batches ([B, seq_len + 1] blocks: inputs and shifted targets),
    in the loader's order, up to `max_batches` batches: summed per position (fp64), then the mean over all
    tokens (loss, perplexity) and over each bucket of positions, from each of `starts` to the next. With `eos_id`,
    the state resets after each of its tokens. Interrupted (Ctrl-C, SIGTERM) after a batch or more, the
    KeyboardInterrupt carries the result of the batches read (`measured`, marked partial), which is that of
    --max_batches that many."""
    from tqdm import tqdm

    from fabric_lin.batches import batch_fingerprint

    # replaced whole after each batch (one assignment, new tensors): a KeyboardInterrupt, which comes between two
    # statements, finds it as it was after some batch, never with one part of a batch counted and not another
    read = BatchesRead(torch.zeros(seq_len, dtype=torch.float64, device=fabric.device),
                       torch.zeros((), dtype=torch.int64, device=fabric.device))
    if fabric.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(fabric.device)
    try:
        expected_batches = len(loader)
    except TypeError:  # a loader that cannot tell
        expected_batches = max_batches
    if max_batches is not None and expected_batches is not None:
        expected_batches = min(expected_batches, max_batches)
    start = time.perf_counter()
    try:
        # closed however the loop ends: a bar left open is drawn again when it is collected, after an error's line or
        # Ctrl-C's, which would then not be the last
        with tqdm(desc=f"seq_len {seq_len}", unit="tok", unit_scale=True, dynamic_ncols=True,
                  total=expected_batches * batch_size * seq_len if expected_batches else None) as progress:
            for batch in loader:
                batch = batch.to(fabric.device).long()
                if batch.shape[1] != seq_len + 1:
                    raise UserError(f"the validation loader gave blocks of {batch.shape[1]} tokens, expected seq_len + 1 "
                                    f"= {seq_len + 1}")
                with fabric.autocast():
                    losses = token_losses(model, batch[:, :-1], batch[:, 1:], eos_id)
                read = BatchesRead(read.sums + losses.sum(0, dtype=torch.float64),
                                   read.fingerprint + batch_fingerprint(batch), read.rows + batch.shape[0],
                                   read.batches + 1, read.short_batches + (batch.shape[0] < batch_size))
                progress.update(batch.shape[0] * seq_len)
                if read.batches == 1:  # weights or a precision that give no finite logits, told before the whole split is read
                    check_finite_loss(read.sums, seq_len, "its first batch")
                if read.batches == max_batches:
                    break
            sums = read.sums.cpu()  # waits for the device: the time below is the computation's
            elapsed = time.perf_counter() - start
    except KeyboardInterrupt as stopped:
        sums = read.sums.cpu()
        if read.batches and bool(torch.isfinite(sums).all()):
            of = f" of {expected_batches}" if expected_batches else ""
            batches = f"{read.batches}{of} batch{'es' if read.batches > 1 or of else ''}"
            stopped.measured = {**length_result(read, sums, seq_len, batch_size, starts, time.perf_counter() - start,
                                                fabric.device),
                                "partial": f"interrupted ({interruption(stopped)}) after {batches}", "read": batches}
        raise
    if read.batches == 0:
        raise InvalidValue(
            f"seq_len {seq_len}: the validation data gives no block of {seq_len + 1} tokens; lower --seq_len"
        )
    check_finite_loss(sums, seq_len, f"its {read.batches} batches")
    return length_result(read, sums, seq_len, batch_size, starts, elapsed, fabric.device)


def length_result(read: BatchesRead, sums: torch.Tensor, seq_len: int, batch_size: int, starts: Sequence[int],
                  elapsed: float, device: torch.device) -> Dict[str, Any]:
    """One length's entry of evaluate.json, from the batches `read` (their loss per position: `sums`, on the CPU)."""
    tokens = read.rows * seq_len
    loss = float(sums.sum() / tokens)
    starts = list(starts)
    ends = starts[1:] + [seq_len]
    return {
        "seq_len": seq_len,
        "batches": read.batches,
        "batch_size": batch_size,
        "short_batches": read.short_batches,
        "tokens": tokens,
        "loss": loss,
        "perplexity": math.exp(min(loss, 100.0)),
        "tokens_per_sec": tokens / max(elapsed, 1e-9),
        "seconds": elapsed,
        "max_memory_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None,
        # the sum of the blocks' checksums (fabric_lin.batches): two evaluations with equal values read the same tokens
        "data_fingerprint": int(read.fingerprint),
        "by_position": {
            "start": starts,
            "end": ends,
            "loss": [float(sums[s:e].sum() / (read.rows * (e - s))) for s, e in zip(starts, ends)],
            "tokens": [read.rows * (e - s) for s, e in zip(starts, ends)],
        },
    }


def check_finite_loss(sums: torch.Tensor, seq_len: int, read: str) -> None:
    """Refuse a loss that is NaN or inf (`sums`: the loss summed per position): a JSON file holds no such number, and
    its cause is the model's logits, not the data."""
    if not bool(torch.isfinite(sums).all()):
        loss = float(sums.sum())
        raise InvalidValue(
            f"seq_len {seq_len}: the loss of {read} is {loss}: the model's logits are not finite (its weights hold NaN or "
            f"inf, or its activations overflow the --precision it runs in: float16's range ends at 65504, bf16's and "
            f"32-true's go past 1e38); no results are written"
        )


def token_losses(model, input_ids: torch.Tensor, targets: torch.Tensor, eos_id: Optional[int] = None) -> torch.Tensor:
    """The cross-entropy of each target token [B, T] (fp32): the model's final hidden states, then the logits of
    LOGIT_ROWS tokens at a time, in the compute dtype, their log-softmax in fp32 (as the training loss). With
    `eos_id`, each document (a row's start, or the token after an EOS) is read on its own, as the training loss
    reads it (`fabric_lin.batches.compute_loss`)."""
    from fabric_lin.batches import doc_boundaries

    if eos_id is None:
        hidden = model(input_ids, return_hidden=True).flatten(0, 1)
    else:
        hidden = model(input_ids.reshape(1, -1), cu_seqlens=doc_boundaries(input_ids, eos_id), return_hidden=True)[0]
    flat_targets = targets.flatten()
    losses = torch.empty(flat_targets.shape, dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], LOGIT_ROWS):
        rows = slice(start, start + LOGIT_ROWS)
        logits = F.linear(hidden[rows], model.output_weight).float()
        losses[rows] = F.cross_entropy(logits, flat_targets[rows], reduction="none")
    return losses.view_as(targets)


def plot_loss_by_position(results: Dict[str, Any], path: Path) -> bool:
    """Mean loss per position bucket, one line per sequence length, the training length marked; False
    without matplotlib (an optional extra)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return False
    figure = Figure(figsize=(8, 4.5), layout="constrained")
    axes = figure.subplots()
    for length in results["lengths"]:
        buckets = length["by_position"]
        centres = [(s + e) / 2 for s, e in zip(buckets["start"], buckets["end"])]
        partial = f", partial: {length['batches']} batches" if "partial" in length else ""
        axes.plot(centres, buckets["loss"], marker=".",
                  label=f"seq_len {length['seq_len']} (loss {length['loss']:.3f}{partial})")
    axes.axvline(results["train_seq_len"], color="grey", linestyle="--", label=f"training length {results['train_seq_len']}")
    axes.set_xlabel("position in the sequence (tokens)")
    axes.set_ylabel("mean loss (nats per token)")
    axes.set_title(f"{results['model'] or 'model'}: {Path(results['checkpoint']).name}"
                   + (f" (step {results['step']})" if results.get("step") is not None else ""))
    axes.grid(alpha=0.3)
    axes.legend()
    atomic_write(path, lambda p: figure.savefig(p, format="png", dpi=120))
    return True
