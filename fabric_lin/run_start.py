"""What a pretraining run checks and loads, before its first step, of the work that came before it: an earlier run in
its out_dir (and checkpoints recorded there but gone), the checkpoint `--resume` names, the model directory
`--initial_checkpoint_dir` names and its weights, and the tokenizer that the data and those weights were made with
(an id means another piece under another tokenizer, of the same vocabulary size too); and how to continue from out_dir's
checkpoints, as a stopped run or one that lost a peer process says it."""
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

import torch

from fabric_lin.checkpoint import (
    HPARAMS_FILE,
    checkpoint_dirs,
    damaged_checkpoints,
    earlier_run_checkpoints,
    explicit_resume_dir,
    is_training_checkpoint,
)
from fabric_lin.config import CONFIG_FILE, Config
from fabric_lin.data import DataModule
from fabric_lin.errors import AlreadyExists, InvalidValue, MissingFile, UserError
from fabric_lin.files import check_outside_checkpoint_or_data, is_a, read_yaml, short_list
from fabric_lin.metrics import METRICS_FILE, recorded_checkpoints
from fabric_lin.weights import config_outline, weights_outline


def check_initial_checkpoint_dir(model_dir: Path, resume: Union[bool, str, Path, None], out_dir: Path) -> None:
    """--initial_checkpoint_dir reads a model directory: what else it is given (a training checkpoint, a run's out_dir, a
    Hugging Face Llama or fla directory) is refused before any work, naming what it is and how to go on from it. A run
    that resumes does not read it (its weights are the checkpoint's), so the directory a recipe names may be gone."""
    from fabric_lin.convert.model_dir import check_model_dir_given

    if not may_start_fresh(resume, out_dir):
        return
    if is_training_checkpoint(model_dir):
        raise InvalidValue(
            f"--initial_checkpoint_dir {model_dir} is a training checkpoint, and it reads a model directory: to go on with "
            f"that run, --resume {model_dir}; to start a new run from its weights, fabric-lin convert_pretrained_checkpoint "
            f"{model_dir} --output_dir <DIR>, then --initial_checkpoint_dir <DIR>"
        )
    check_model_dir_given(model_dir, "--initial_checkpoint_dir", "--initial_checkpoint_dir")


def may_start_fresh(resume: Union[bool, str, Path, None], out_dir: Path) -> bool:
    """Whether a run given `resume` can start from step 0: --resume true and --resume <dir> resume or fail, and
    --resume auto starts fresh only where out_dir holds no checkpoint, none set aside as damaged and none recorded in
    its metrics.jsonl (each of those resumes, or is refused naming the checkpoints)."""
    if resume is False or resume is None:
        return True
    if resume != "auto":
        return False
    return not (checkpoint_dirs(out_dir) or damaged_checkpoints(out_dir) or recorded_checkpoints(out_dir))


def check_out_dir_is_no_model_or_data(out_dir: Path) -> None:
    """Refuse an out_dir that is a model (a training checkpoint, a model directory, an export) or a prepared data
    directory, most likely a path typed for another flag: the run would write its checkpoints, logs and metrics into
    it, mixing a run with the model or the data. Named with the flag that reads such a directory. An out_dir inside a
    training checkpoint or prepared data is refused too: the run would go with them."""
    from fabric_lin.convert.model_dir import what_it_holds
    from fabric_lin.data.prepared import INDEX_FILE

    out_dir = Path(out_dir)
    check_outside_checkpoint_or_data(out_dir, "--out_dir")
    if not out_dir.is_dir():
        return
    kind = what_it_holds(out_dir) or ("a prepared data directory" if (out_dir / INDEX_FILE).is_file() else None)
    if kind is None:
        return
    meant = {
        "a model directory": f"to start from this model's weights: --initial_checkpoint_dir {out_dir}",
        "a training checkpoint": f"to continue this checkpoint's run: --out_dir {out_dir.parent} --resume auto",
        "a prepared data directory": f"to train on this data: --data TextFiles --data.train_dir {out_dir}",
    }.get(kind)
    raise AlreadyExists(f"--out_dir {out_dir} is {kind}: a run writes its checkpoints, logs and metrics.jsonl into its "
                        f"out_dir; give it a directory of its own" + (f" ({meant})" if meant else ""))


def check_earlier_run(out_dir: Path, resume: Union[bool, str, Path], overwrite: bool, config: Config) -> None:
    """Refuse a fresh run into an out_dir that holds an earlier run's checkpoints: the two runs' step
    directories would lie side by side, and a later --resume auto would take the earlier run's newest. Where the
    earlier run trained another model than this run's `config`, continuing it is no way on for this run."""
    continuing = resume is True or resume == "auto"
    # a --resume path that names no checkpoint is said before out_dir's earlier run, which it may have meant to name
    named = None if continuing or resume is False or resume is None else explicit_resume_dir(resume, out_dir)
    # resolved: a checkpoint named through a symbolic link to out_dir (or out_dir through one) is out_dir's, which
    # --overwrite true would delete before the resume
    inside = named is not None and Path(named).resolve().parent == Path(out_dir).resolve()
    if overwrite and continuing:
        raise InvalidValue(
            f"--overwrite true deletes the checkpoints in {out_dir} that --resume {resume} would continue from: give one of "
            f"the two (a checkpoint's hyperparameters.yaml records resume: auto; --resume false with it starts afresh)"
        )
    if overwrite and inside:
        raise InvalidValue(f"--overwrite true would delete the checkpoint --resume {resume} names, in out_dir {out_dir}")
    earlier = earlier_run_checkpoints(out_dir)
    if not earlier or continuing or overwrite or inside:
        return
    shown = short_list(earlier, 3)
    earlier_model = model_of_earlier_run(out_dir)
    if earlier_model is not None and {**earlier_model.to_dict(), "name": None} != {**config.to_dict(), "name": None}:
        named = (earlier_model.name if earlier_model.name and earlier_model.name != config.name
                 else f"another model (its checkpoints' {CONFIG_FILE})")
        raise AlreadyExists(
            f"out_dir {out_dir} holds the checkpoints of an earlier run of {named} ({shown}), and this run trains "
            f"{config.name or 'another model'}, which cannot continue it: write this one to another --out_dir, or start "
            f"afresh with --overwrite true (deletes those checkpoints)"
        )
    raise AlreadyExists(
        f"out_dir {out_dir} holds the checkpoints of an earlier run ({shown}); a new run would put its own beside them. "
        f"Continue that run with --resume auto, write this one to another --out_dir, or start afresh with "
        f"--overwrite true (deletes those checkpoints)"
    )


def model_of_earlier_run(out_dir: Path) -> Optional[Config]:
    """The model of the newest checkpoint in out_dir whose model_config.yaml reads, or None."""
    for checkpoint in checkpoint_dirs(out_dir):
        try:
            return Config.from_checkpoint(checkpoint)
        except UserError:  # missing or damaged: an older checkpoint may tell
            continue
    return None


def check_config_of_a_moved_run(config_files: List[Path]) -> None:
    """A checkpoint's hyperparameters.yaml given as --config, and no --out_dir: the run goes on in the out_dir the file
    records. Where the checkpoint now lies in another directory (the run was moved or copied), that is the old place,
    where `--resume auto` would find no checkpoint and start again from step 0: refused, naming both places."""
    recorded = None
    for path in config_files:
        content = read_yaml(path) if is_a(path, "file") else None  # else inline YAML, or a file jsonargparse names
        if isinstance(content, dict) and "out_dir" in content:
            recorded = (path, content["out_dir"])  # the last file that sets out_dir is the one that counts
    if recorded is None or recorded[0].name != HPARAMS_FILE or not is_training_checkpoint(recorded[0].parent):
        return
    path, out_dir = recorded
    lies_in = path.parent.parent
    if out_dir is not None and Path(out_dir).expanduser().resolve() != lies_in.resolve():
        raise InvalidValue(
            f"--config {path}: it records out_dir {out_dir}, but its checkpoint now lies in {lies_in} (the run was moved "
            f"or copied). Give --out_dir {lies_in} to go on where it lies (with --resume auto), or --out_dir {out_dir} to "
            f"write to the recorded place"
        )


def check_no_checkpoint_went_missing(out_dir: Path) -> None:
    """--resume auto found no checkpoint in out_dir: a fresh start, unless metrics.jsonl records checkpoints that the
    run saved there, moved or deleted since. Starting again from step 0 would then train its steps over again."""
    recorded = recorded_checkpoints(out_dir)
    if recorded:
        shown = ", ".join(recorded[-3:])
        raise MissingFile(
            f"--resume auto: out_dir {out_dir} holds no checkpoint, but its {METRICS_FILE} records the ones the run saved "
            f"there ({shown}): they were moved or deleted. Put them back, or resume from one with --resume <dir>; to "
            f"start again from step 0 here: --resume false --overwrite true"
        )


def resume_hint(overwrite: bool) -> str:
    """How to continue a run that stopped, as the console says it."""
    return "run the same command with --resume auto" + (" instead of --overwrite true" if overwrite else "")


def how_to_continue_without_the_peer(out_dir: Path, resume: Union[bool, str, Path], overwrite: bool,
                                     earlier_run_deleted: bool) -> str:
    """What a rank whose peer process is gone says of the run's checkpoints: the newest complete one (renamed from
    .tmp- once every rank had written it: what --resume auto verifies and loads) and how to continue. Not verified
    here: on every rank that is left, that would read a whole checkpoint before the process exits. --overwrite true
    deletes out_dir's earlier run once the start-up has found nothing to refuse (`earlier_run_deleted`): the
    checkpoints there before that are the earlier run's, which a resume would continue."""
    saved = checkpoint_dirs(out_dir)
    if saved and overwrite and not earlier_run_deleted:
        return (f"the checkpoints in {out_dir} are still the earlier run's, which --overwrite true deletes once the "
                f"start-up has passed its checks: to start afresh, run the same command")
    if saved:
        return f"the newest complete checkpoint is {saved[0]}: to continue from it, {resume_hint(overwrite)}"
    if resume in (False, True, "auto"):
        return f"no checkpoint in {out_dir} is complete: to start again, {resume_hint(overwrite)}"
    return f"no checkpoint in {out_dir} is complete: to start again from --resume {resume}, run the same command"


def load_initial_weights(model_dir: Path, config: Config, log=print) -> Dict[str, torch.Tensor]:
    """The weights of a model directory, checked against `config`: a model of another family, depth or width refused
    in one line, with the flag that builds the directory's model where the weights are that of its model_config.yaml;
    a few tensors' names, shapes or dtypes that differ listed. A model_config.yaml there that differs from `config` in
    fields that keep the shapes (eps, RoPE base, ...) is reported, not refused: continued pretraining may change them
    on purpose."""
    from fabric_lin.convert.model_dir import (
        check_state_dict,
        load_model_dir_weights,  # weights_only
        weights_file,
    )

    saved_config = Path(model_dir) / CONFIG_FILE
    saved = Config.from_file(saved_config) if saved_config.is_file() else None
    if saved is not None and saved.block_type != config.block_type:
        raise InvalidValue(
            f"--initial_checkpoint_dir {model_dir} holds a {saved.block_type} model ({saved.name}, its {CONFIG_FILE}) and "
            f"this run builds a {config.block_type} one ({config.name}): the weights of one family are not those of the "
            f"other's layers; start this run with {saved.flag(saved_config)}"
        )
    if saved is not None:
        # not max_seq_length: a run trains at train.max_seq_length, whatever its model config says, and a model directory
        # records the length its run trained at
        differ = {k: (v, getattr(config, k)) for k, v in vars(saved).items()
                  if k not in ("name", "max_seq_length") and getattr(config, k, v) != v}
        if differ:
            log(
                f"Warning: --initial_checkpoint_dir {model_dir}: its {CONFIG_FILE} differs from this run's model in "
                + ", ".join(f"{k} ({a!r} there, {b!r} here)" for k, (a, b) in sorted(differ.items()))
            )
    state = load_model_dir_weights(model_dir)
    if not fits(state, config):
        fix = None  # the weights of no model at hand: what differs is told alone
        if saved is not None and fits(state, saved):
            fix = f"they are the model of its {CONFIG_FILE}: start this run with {saved.flag(saved_config)}"
        elif saved is not None and not weights_outline(state).same_model(config_outline(saved)):
            fix = (f"nor are they the model of its {CONFIG_FILE}, {saved.name}: put back the {CONFIG_FILE} written "
                   f"with these weights, then start this run with the model it names")
        check_state_dict(state, config, source=f"--initial_checkpoint_dir {weights_file(model_dir)}",
                         model_is="this run builds", fix=fix)
    return state


def fits(state: Dict[str, torch.Tensor], config: Config) -> bool:
    """Whether the weights `state` are those of the model `config` (names, shapes, kinds of dtype)."""
    from fabric_lin.convert.model_dir import check_state_dict

    try:
        check_state_dict(state, config)
    except InvalidValue:
        return False
    return True


def run_tokenizer_dir(tokenizer_dir: Optional[Path], data: DataModule) -> Optional[Path]:
    """The run's tokenizer: --tokenizer_dir, else the one that prepared the data (its files lie beside the tokens),
    else None. A --tokenizer_dir that is not there while the data carries a tokenizer is named with the data's: a
    --config recipe's tokenizer_dir (Llama-2's, which prepared its SlimPajama) stays set under a --data of one's own."""
    carried = getattr(data, "tokenizer_dir", None)
    if tokenizer_dir is None:
        return carried
    if carried is not None and not Path(tokenizer_dir).exists():
        raise MissingFile(f"--tokenizer_dir {tokenizer_dir} does not exist; the data carries the tokenizer that prepared "
                          f"it, in {carried}: give --tokenizer_dir null to train with that one (a --config file's "
                          f"tokenizer_dir is the tokenizer of that recipe's data), or the directory of the tokenizer meant")
    return tokenizer_dir


def load_tokenizer(tokenizer_dir: Optional[Path], given_by: str = "--tokenizer_dir"):
    if tokenizer_dir is None:
        return None
    from fabric_lin.data.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir, given_by)


def training_data_tokenizer(data: DataModule, tokenizer) -> Optional[Dict[str, Any]]:
    """What the checkpoints record as the tokenizer their weights are trained with (their trained_with.json): the one
    that prepared the training data, as its prepared.json records it (data.setup() checked that the run's tokenizer and
    every directory agree, and kept what it read), else the run's tokenizer; None where neither is known."""
    from fabric_lin.data.tokenizer import tokenizer_identity

    dirs = data.prepared_dirs()
    info = data.prepared[dirs[0]] if dirs else {}
    if None not in tokenizer_identity(info):
        return {"tokenizer": info["tokenizer"]}
    return {"tokenizer": tokenizer.record()} if tokenizer is not None else None


def with_training_data(trained_with: Optional[Dict[str, Any]], data: DataModule,
                       earlier_weights: Optional[Path]) -> Optional[Dict[str, Any]]:
    """`trained_with` (`training_data_tokenizer`) with the data the weights are trained on, "data": what the weights
    this run starts from (`earlier_weights`: --resume's, --initial_checkpoint_dir's) record of theirs, then this run's
    training directories (`DataModule.training_data_record`), each once. None where `trained_with` is: the record is
    first the tokenizer's."""
    from fabric_lin.data.tokenizer import read_trained_with

    if trained_with is None:
        return None
    earlier = (read_trained_with(earlier_weights) or {}).get("data") if earlier_weights is not None else None
    record = [entry for entry in earlier if isinstance(entry, dict)] if isinstance(earlier, list) else []
    for entry in data.training_data_record():
        if entry not in record:
            record.append(entry)
    return {**trained_with, "data": record}


def check_trained_on_these_ids(weights_dir: Path, option: str, tokenizer, data_trained_with: Optional[Dict[str, Any]],
                               fix: str, log=print) -> None:
    """Refuse to train on from weights (a checkpoint or a model directory; each holds the tokenizer its model was
    trained with) with data of another tokenizer: an id stands for another piece in each, of the same vocabulary size
    too, and the loss would only say so as a slow recovery. The weights' tokenizer is their trained_with.json's, or
    their tokenizer.model's; the data's is `data_trained_with` (`training_data_tokenizer`: its prepared.json's, which
    tells it also where the data carries no tokenizer files, else the run's `tokenizer`). Nothing to compare where
    either tells none; where the weights tell none (a directory with neither file), `log` says so."""
    from fabric_lin.data.prepared import PREPARED_INFO_FILE
    from fabric_lin.data.tokenizer import (
        TRAINED_WITH_FILE, Tokenizer, describe_tokenizer, tokenizer_identity, weights_trained_with)

    weights_tokenizer = weights_trained_with(weights_dir, option) if data_trained_with is not None else None
    if data_trained_with is not None and weights_tokenizer is None:
        log(f"Note: {option} {weights_dir} holds no tokenizer.model and no {TRAINED_WITH_FILE}, so nothing tells whether "
            f"this run's data tokenizer ({describe_tokenizer(data_trained_with)}) is the one its weights were trained "
            f"with; under another one each id is another piece")
    if weights_tokenizer is not None and tokenizer_identity(weights_tokenizer) != tokenizer_identity(data_trained_with):
        weights_named = (Tokenizer(weights_dir).describe() if (Path(weights_dir) / "tokenizer.model").is_file()
                         else f"the tokenizer its {TRAINED_WITH_FILE} records ({describe_tokenizer(weights_tokenizer)})")
        data_named = (tokenizer.describe() if tokenizer is not None
                      else f"the tokenizer its data's {PREPARED_INFO_FILE} records ({describe_tokenizer(data_trained_with)})")
        raise InvalidValue(
            f"{option} {weights_dir}: its weights were trained on the ids of {weights_named}, and this run reads "
            f"those of {data_named}: an id is another piece in each; {fix}"
        )
