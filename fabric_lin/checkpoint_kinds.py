"""The three kinds of directory a model is read from for `fabric-lin evaluate` and `generate` (tutorials/convert.md): a
training checkpoint (verified against its manifest, as a resume does), a model directory, an fla export; and, for a
training checkpoint, its run's hyperparameters, step and data module."""
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from fabric_lin.checkpoint import (
    FINAL_DIR,
    HPARAMS_FILE,
    MANIFEST_FILE,
    STEP_FILE,
    TMP_PREFIX,
    checkpoint_dirs,
    is_training_checkpoint,
    step_checkpoints,
    to_plain,
    verify_checkpoint,
)
from fabric_lin.config import CONFIG_FILE, Config, refuse_litgpt_config
from fabric_lin.data import DataModule
from fabric_lin.errors import InvalidValue, MissingFile, UserError
from fabric_lin.files import read_yaml
from fabric_lin.weights import MODEL_FILE, canonical_state_dict, tensor_dict, torch_load_tensors


TRAINING_CHECKPOINT, MODEL_DIRECTORY, FLA_EXPORT = "training checkpoint", "model directory", "fla export"


@dataclass
class Checkpoint:
    """A model read from one of the three kinds of directory (tutorials/convert.md)."""

    kind: str
    config: Config
    state_dict: Dict[str, torch.Tensor]
    tokenizer: Any  # fabric_lin.data.Tokenizer, or None where the directory holds no tokenizer.model
    hparams: Optional[Dict[str, Any]] = None  # a training checkpoint's hyperparameters.yaml
    step: Optional[int] = None  # a training checkpoint's optimizer step


def load_checkpoint(checkpoint_dir: Path, command: str = "evaluate") -> Checkpoint:
    """The model of a training checkpoint (verified against its manifest first, as a resume does), a model
    directory or an fla export; which one is told by the files it holds. `command`: the one that reads it, as its
    errors name it."""
    return find_checkpoint(checkpoint_dir, command).read()


@dataclass
class FoundCheckpoint:
    """A directory's model as far as its files tell it before its weights are read (`find_checkpoint`): its kind, config
    and tokenizer, and a training checkpoint's hyperparameters and step, that checkpoint verified against its manifest.
    `read()` reads the weights: a check that needs the config or the tokenizer alone comes before them, without the
    minutes of reading a large model."""

    directory: Path
    kind: str
    config: Config
    tokenizer: Any  # fabric_lin.data.Tokenizer, or None where the directory holds no tokenizer.model
    hparams: Optional[Dict[str, Any]] = None
    step: Optional[int] = None
    weights_path: Optional[Path] = None  # a training checkpoint's lit_model.pth, one file or a directory of shards
    manifest: Optional[bytes] = None  # a training checkpoint's manifest.json as it was verified

    def read(self) -> Checkpoint:
        from fabric_lin.convert.hf import read_fla_checkpoint
        from fabric_lin.convert.model_dir import check_state_dict, load_model_dir_weights

        if self.kind == TRAINING_CHECKPOINT:
            state_dict = read_unchanged(self.directory, self.manifest,
                                        lambda: canonical_state_dict(load_model_weights(self.weights_path)))
            check_state_dict(state_dict, self.config, source=str(self.weights_path),
                             config_file=self.directory / CONFIG_FILE)
        elif self.kind == MODEL_DIRECTORY:
            state_dict = load_model_dir_weights(self.directory, self.config)
        else:
            state_dict = read_fla_checkpoint(self.directory)[1]
        return Checkpoint(self.kind, self.config, state_dict, self.tokenizer, self.hparams, self.step)


def checkpoint_kind(checkpoint_dir: Path) -> Optional[str]:
    """Which of the three kinds `checkpoint_dir` is, told by the names of the files it holds (none is read); None where
    it holds none of them. A training checkpoint is named as one whole or not (its step.json, manifest.json or
    hyperparameters.yaml, or a directory lit_model.pth of shards), so that what is missing of it is told as such."""
    from fabric_lin.convert.hf import HF_CONFIG_FILE
    from fabric_lin.convert.model_dir import SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE

    checkpoint_dir = Path(checkpoint_dir)

    def has(name: str) -> bool:
        return (checkpoint_dir / name).exists()

    # a sharded lit_model.pth is a directory: given in place of its checkpoint, find_training_checkpoint names it
    weights_of_a_run = checkpoint_dir.name == MODEL_FILE and is_training_checkpoint(checkpoint_dir.parent)
    if has(STEP_FILE) or has(MANIFEST_FILE) or has(HPARAMS_FILE) or (checkpoint_dir / MODEL_FILE).is_dir() \
            or weights_of_a_run:
        return TRAINING_CHECKPOINT
    if has(CONFIG_FILE) and (has(MODEL_FILE) or has(SAFETENSORS_FILE) or has(SAFETENSORS_INDEX_FILE)):
        return MODEL_DIRECTORY
    if has(HF_CONFIG_FILE):
        return FLA_EXPORT
    return None


def find_checkpoint(checkpoint_dir: Path, command: str = "evaluate", tokenizer_for: str = "") -> FoundCheckpoint:
    """The kind, config and tokenizer of a training checkpoint (verified against its manifest first, as a resume does;
    its config at the length its run trained at), a model directory or an fla export, its weights not read yet; or the
    error that says what `checkpoint_dir` is instead. `command`: the one that reads it (evaluate, generate), as its
    errors name it. `tokenizer_for`: what needs the tokenizer, where a directory without one is refused (after the
    config of a model directory or an export, which may say it is no model of fabric-lin's; before the checksums of a
    training checkpoint, seconds to minutes of reading)."""
    from fabric_lin.convert.hf import HF_CONFIG_FILE, fla_checkpoint_config
    from fabric_lin.convert.model_dir import SAFETENSORS_FILE, check_not_lora_adapters, models_below
    from fabric_lin.data.tokenizer import Tokenizer

    checkpoint_dir = Path(checkpoint_dir)
    check_checkpoint_dir(checkpoint_dir)
    kind = checkpoint_kind(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir, "checkpoint_dir") if (checkpoint_dir / "tokenizer.model").exists() else None

    def tokenizer_is_there() -> None:
        if tokenizer_for:
            check_tokenizer_is_there(checkpoint_dir, "", tokenizer_for)

    if kind == TRAINING_CHECKPOINT:
        tokenizer_is_there()
        # a running pretrain may delete the checkpoint meanwhile (its oldest past train.keep_last_n), or replace it (a
        # step it saves again): what was read is then no one checkpoint, and the reading fails on files that went
        manifest = manifest_bytes(checkpoint_dir)

        def verified():
            config, weights_path = find_training_checkpoint(checkpoint_dir, use=command)
            hparams = read_hparams(checkpoint_dir / HPARAMS_FILE) if (checkpoint_dir / HPARAMS_FILE).exists() else None
            return at_the_trained_length(config, hparams), weights_path, hparams, read_step(checkpoint_dir / STEP_FILE)

        config, weights_path, hparams, step = read_unchanged(checkpoint_dir, manifest, verified)
        return FoundCheckpoint(checkpoint_dir, kind, config, tokenizer, hparams, step, weights_path, manifest)
    if kind in (MODEL_DIRECTORY, FLA_EXPORT):
        config = Config.from_checkpoint(checkpoint_dir) if kind == MODEL_DIRECTORY else fla_checkpoint_config(checkpoint_dir)
        tokenizer_is_there()
        return FoundCheckpoint(checkpoint_dir, kind, config, tokenizer)
    check_not_lora_adapters(checkpoint_dir, command, reads_exports=True)
    inside = [p.name for p in checkpoint_dirs(checkpoint_dir)]
    below = models_below(checkpoint_dir)
    hint = (f"; it holds a run's checkpoints ({', '.join(inside[:3])}): pass one of them" if inside
            else f"; {below}" if below else "")
    raise MissingFile(
        f"{checkpoint_dir} is not a checkpoint: it holds none of {MODEL_FILE}, {SAFETENSORS_FILE} or {HF_CONFIG_FILE}; "
        f"{CHECKPOINT_EXPECTED}{hint}"
    )


def at_the_trained_length(config: Config, hparams: Optional[Dict[str, Any]]) -> Config:
    """`config` with the length its run trained at, its hyperparameters' (`hparams`) train.max_seq_length: a run may
    train past (or short of) its model config's max_seq_length, which nothing else sets. A model directory's is this
    length (convert_pretrained_checkpoint), which evaluate takes for the training length, convert_to_hf exports as
    max_position_embeddings, and generate and the harness's requests keep a transformer within."""
    train = hparams.get("train") if isinstance(hparams, dict) else None
    length = train.get("max_seq_length") if isinstance(train, dict) else None
    if isinstance(length, int) and not isinstance(length, bool) and length > 0:
        return replace(config, max_seq_length=length)
    return config


def read_unchanged(checkpoint_dir: Path, manifest: Optional[bytes], read: Callable[[], Any]) -> Any:
    """`read()` of a training checkpoint whose manifest.json was `manifest` when it was found: its error, or its value
    where the checkpoint was deleted or replaced meanwhile, is the error that says so."""
    try:
        value = read()
    except (OSError, UserError):
        if manifest is not None and manifest_bytes(checkpoint_dir) != manifest:
            raise changed_while_read(checkpoint_dir) from None
        raise
    if manifest is not None and manifest_bytes(checkpoint_dir) != manifest:
        raise changed_while_read(checkpoint_dir)
    return value


CHECKPOINT_EXPECTED = ("expected a training checkpoint (a run's step-XXXXXXXX/ or final/), a model directory "
                       "(convert_pretrained_checkpoint's output) or an fla export (convert_to_hf's output)")


def manifest_bytes(checkpoint_dir: Path) -> Optional[bytes]:
    """The bytes of a training checkpoint's manifest.json, None where it has none (or is gone): a checkpoint replaced
    has another (its files' CRC-32s), and one deleted none."""
    try:
        return (Path(checkpoint_dir) / MANIFEST_FILE).read_bytes()
    except OSError:
        return None


def changed_while_read(checkpoint_dir: Path) -> InvalidValue:
    return InvalidValue(
        f"{checkpoint_dir} was deleted or replaced while it was read: a running pretrain deletes its oldest step-* "
        f"checkpoints past train.keep_last_n, and replaces a checkpoint it saves again; evaluate it again where it is "
        f"still there, or a checkpoint that the run keeps"
    )


def not_saved_yet(checkpoint_dir: Path) -> Optional[str]:
    """Where `checkpoint_dir` is not there but is a checkpoint's name in a run's out_dir: its `.tmp-` directory there (a
    pretrain that is saving it, or one killed while it saved), or the run's other checkpoints (final/ comes at the end
    of a run): what to do, for the error that `checkpoint_dir` is not there; else None."""
    checkpoint_dir = Path(checkpoint_dir)
    tmp = checkpoint_dir.parent / f"{TMP_PREFIX}{checkpoint_dir.name}"
    if checkpoint_dir.name in ("", ".", "..") or checkpoint_dir.exists():
        return None
    finished = [p.name for p in checkpoint_dirs(checkpoint_dir.parent)]
    if tmp.is_dir():
        return (f"{checkpoint_dir} is not there yet: {tmp} is being written (a running pretrain saves a checkpoint there "
                f"and renames it when complete; one killed while saving leaves it): give it once the run has saved it"
                + (f", or one that is complete ({', '.join(finished[:3])})" if finished else ""))
    if not finished:
        return None
    ends = " (a run saves final/ when it ends)" if checkpoint_dir.name == FINAL_DIR else ""
    return (f"{checkpoint_dir} does not exist{ends}: the run in {checkpoint_dir.parent} has saved "
            f"{', '.join(finished[:3])}{', ...' if len(finished) > 3 else ''}: give one of them")


def check_checkpoint_dir(checkpoint_dir: Path) -> None:
    """Refuse a `checkpoint_dir` that is no directory, before anything is read: a file of a checkpoint (its weights, its
    config) named with the directory that holds it."""
    from fabric_lin.convert.model_dir import what_it_holds

    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.is_dir():
        return
    holder = checkpoint_dir.parent
    kind = what_it_holds(holder) if checkpoint_dir.is_file() else None
    if kind is not None and kind != "LoRA adapters alone":
        raise InvalidValue(f"{checkpoint_dir} is a file: give the directory that holds it, {holder} ({kind})")
    raise MissingFile(not_saved_yet(checkpoint_dir) or f"{checkpoint_dir} is not a directory: {CHECKPOINT_EXPECTED}")


def check_tokenizer_is_there(checkpoint_dir: Path, said_first: str, needs_it: str) -> None:
    """Refuse weights without their tokenizer.model where the command needs it for text (`needs_it`, said after the
    directory, `said_first` before it), naming the one its trained_with.json records: before the minutes of reading the
    weights. A directory that holds no weights is left to `find_checkpoint`, which says what it is."""
    from fabric_lin.convert.hf import HF_CONFIG_FILE
    from fabric_lin.convert.model_dir import SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE
    from fabric_lin.data.tokenizer import the_recorded_tokenizer

    checkpoint_dir = Path(checkpoint_dir)
    weights = (MODEL_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE, HF_CONFIG_FILE)
    if any((checkpoint_dir / name).exists() for name in weights) and not (checkpoint_dir / "tokenizer.model").exists():
        raise InvalidValue(f"{said_first}{checkpoint_dir} has no tokenizer.model, and {needs_it}"
                           f"{the_recorded_tokenizer(checkpoint_dir)}")


def read_hparams(path: Path) -> Dict[str, Any]:
    hparams = read_yaml(path)
    if not isinstance(hparams, dict):
        raise InvalidValue(f"{path}: expected a mapping of pretrain's arguments, got {type(hparams).__name__}")
    return hparams


def read_step(path: Path) -> Optional[int]:
    try:
        step = json.loads(path.read_text(encoding="utf-8")).get("step_count")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def run_data_entry(hparams: Dict[str, Any], path: Path) -> Dict[str, Any]:
    """The data module a run trained with, as its hyperparameters.yaml (`path`) records it: `data`'s class_path and
    init_args. Only fabric-lin's own data modules are taken from a checkpoint: a class_path elsewhere would import a
    module named by a file that may come from anyone."""
    entry = hparams.get("data")
    class_path = entry.get("class_path") if isinstance(entry, dict) else None
    if not isinstance(class_path, str):
        raise InvalidValue(f"{path}: its data entry is not a data module (class_path and init_args); give --data")
    if not class_path.startswith("fabric_lin.data."):
        raise InvalidValue(
            f"{path}: data.class_path {class_path} is not one of fabric-lin's data modules, and evaluate imports no "
            f"other module that a checkpoint names: give it on the command line, --data {class_path} --data.<option> ..."
        )
    return entry


def run_data_module(hparams: Dict[str, Any], path: Path) -> DataModule:
    """The data module a run trained with, built from its hyperparameters.yaml (`path`, `run_data_entry`)."""
    from jsonargparse import ArgumentParser

    entry = run_data_entry(hparams, path)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--data", type=DataModule)
    try:
        parsed = parser.parse_object({"data": entry})
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes  # the second before jsonargparse 4.49
        return instantiate(parsed).data
    except Exception as e:  # jsonargparse's own error types, or the data module's check of its values
        raise InvalidValue(f"{path}: its data entry does not load ({' '.join(str(e).split())}); give --data") from None


def is_run_data(data: DataModule, hparams: Dict[str, Any]) -> bool:
    """Whether `data` is the data module that a run's hyperparameters (`hparams`) record but for its loader's worker
    count: the run's own data, read with other loader settings (`evaluate CHECKPOINT --data.num_workers 0`)."""
    def but_workers(entry: Dict[str, Any]):
        init_args = entry.get("init_args") if isinstance(entry.get("init_args"), dict) else {}
        return entry.get("class_path"), {key: value for key, value in init_args.items() if key != "num_workers"}

    recorded = hparams.get("data")
    return isinstance(recorded, dict) and but_workers(to_plain(data)) == but_workers(recorded)


def recorded_training_data(checkpoint_dir: Path, hparams: Optional[Dict[str, Any]]) -> Tuple[List[dict], Optional[Path]]:
    """The data the weights of `checkpoint_dir` were trained on, as `DataModule.training_data_record` entries, and the
    file that records it: their trained_with.json's "data", else (a checkpoint of a run from before that record was
    kept) the training directories of its hyperparameters.yaml's data module (`hparams`), as they are now; ([], None)
    where nothing records it."""
    from fabric_lin.data.prepared import DOCUMENT_KEYS, PREPARED_INFO_FILE
    from fabric_lin.data.sample_order import source_key
    from fabric_lin.data.tokenizer import TRAINED_WITH_FILE, read_trained_with
    from fabric_lin.files import INDEX_FILE, read_json

    recorded = (read_trained_with(checkpoint_dir) or {}).get("data")
    if isinstance(recorded, list):
        return [entry for entry in recorded if isinstance(entry, dict)], checkpoint_dir / TRAINED_WITH_FILE
    if hparams is None or not isinstance(hparams.get("data"), dict):
        return [], None
    try:
        dirs = run_data_module(hparams, checkpoint_dir / HPARAMS_FILE).training_dirs()
    except UserError:  # a data entry that no longer loads: the evaluation names it where it reads the run's data
        return [], None
    entries = []
    for directory in dirs:
        try:
            info = read_json(directory / PREPARED_INFO_FILE) if (directory / PREPARED_INFO_FILE).is_file() else {}
        except UserError:  # damaged since: its index.json may still tell
            info = {}
        entries.append({"dir": str(directory.absolute()),
                        "index": source_key(directory) if (directory / INDEX_FILE).is_file() else None,
                        "documents": {key: info[key] for key in DOCUMENT_KEYS if key in info}})
    return entries, checkpoint_dir / HPARAMS_FILE


def check_run_data_is_there(data: DataModule, path: Path) -> None:
    """The validation directories of the run's data module (read from its hyperparameters.yaml, `path`) are still
    there: data moved since is named with the file that names it, and --data is the way on."""
    for directory in data.validation_dirs():
        if not Path(directory).exists():
            name = type(data).__name__
            raise MissingFile(f"{directory} does not exist: {path} names it as the run's data ({name}); give --data to "
                              f"read the data where it is now, e.g. --data {name} --data.<option> DIR")


def plain_value(value: Any) -> Any:
    """JSON for what json does not write itself (numbers of NumPy, paths)."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)


# ---------------------------------------------------------------- the plot


# ---------------------------------------------------------------- reading the model's weights


def find_training_checkpoint(checkpoint_dir: Path, use: str) -> Tuple[Any, Path]:
    """(Config, path of lit_model.pth) of a training checkpoint directory whose checksums hold, or a clear error.
    use: the command that reads it ("evaluate", "convert", "generate"), for the error of a damaged checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    if checkpoint_dir.name == MODEL_FILE and is_training_checkpoint(checkpoint_dir.parent):
        raise InvalidValue(f"{checkpoint_dir} is the weights of the training checkpoint {checkpoint_dir.parent}: pass that directory")
    if not checkpoint_dir.is_dir():
        raise MissingFile(not_saved_yet(checkpoint_dir)
                          or f"{checkpoint_dir} is not a directory: expected a training checkpoint directory")
    if checkpoint_dir.resolve().name.startswith(TMP_PREFIX):  # resolved: `.` given inside one has no name of its own
        raise InvalidValue(f"{checkpoint_dir} is an unfinished checkpoint (a `{TMP_PREFIX}` directory is renamed when complete)")
    weights_path = checkpoint_dir / MODEL_FILE
    if not weights_path.exists():
        distributed = distributed_checkpoint_of_another_kind(checkpoint_dir)
        if distributed:
            raise InvalidValue(distributed)
        steps = [p.name for p in step_checkpoints(checkpoint_dir)]
        finals = [FINAL_DIR] if (checkpoint_dir / FINAL_DIR / MODEL_FILE).exists() else []
        hint = f"; it holds checkpoints {(steps[-3:] + finals)}, pass one of those" if steps or finals else ""
        raise MissingFile(f"{checkpoint_dir} is not a training checkpoint: it has no {MODEL_FILE}{hint}")
    if not is_training_checkpoint(checkpoint_dir) and weights_path.is_dir():
        raise InvalidValue(
            f"{weights_path} is a directory, as a sharded training checkpoint's weights are, but {checkpoint_dir} has no "
            f"{STEP_FILE} or {MANIFEST_FILE} beside it: not a whole training checkpoint (copied without them, or saved by "
            f"a run that did not finish it); give the checkpoint directory as pretrain wrote it"
        )
    if not is_training_checkpoint(checkpoint_dir):
        if (checkpoint_dir / CONFIG_FILE).is_file():
            refuse_litgpt_config(checkpoint_dir / CONFIG_FILE, read_yaml(checkpoint_dir / CONFIG_FILE))
        raise InvalidValue(
            f"{checkpoint_dir} holds {MODEL_FILE} but no {STEP_FILE} or {MANIFEST_FILE}: it is already a model directory "
            f"(convert_pretrained_checkpoint's output), not a training checkpoint"
        )
    if weights_path.is_dir() and not (weights_path / ".metadata").is_file():
        raise InvalidValue(
            f"{weights_path} is a directory without the torch.distributed.checkpoint `.metadata` file; "
            "expected Fabric's sharded FSDP checkpoint"
        )
    check = verify_checkpoint(checkpoint_dir, model_only=True)  # the model is all that is read of it
    if not check.ok:
        not_done = {"evaluate": "evaluated", "convert": "converted"}.get(use, "read")
        instead = "generate from" if use == "generate" else use
        raise InvalidValue(
            f"{checkpoint_dir}: the checkpoint is damaged: {check.describe()}. It is not {not_done}; {instead} an older "
            f"checkpoint of the run"
        )
    return Config.from_checkpoint(checkpoint_dir), weights_path


def distributed_checkpoint_of_another_kind(directory: Path) -> str:
    """Where `directory` is, or holds, a torch.distributed.checkpoint (its `.metadata`) that is no training checkpoint of
    fabric-lin's (whose shards lie in a lit_model.pth/ beside its step.json and manifest.json), what it is and how to
    read it; else "". flame and torchtitan save theirs as checkpoint/step-N/; the shards of one of fabric-lin's, taken
    out of their checkpoint, have Fabric's meta.pt beside them."""
    from fabric_lin.sharded_checkpoint import FABRIC_META_FILE

    directory = Path(directory)
    below = sorted(p for p in directory.iterdir() if p.is_dir()) if directory.is_dir() else []
    found = [d for d in [directory, *below] if (d / ".metadata").is_file()]
    if not found:
        return ""
    if (found[0] / FABRIC_META_FILE).is_file():
        return (f"{found[0]} holds the shards of a sharded training checkpoint's {MODEL_FILE} (Fabric's {FABRIC_META_FILE} "
                f"beside them) without the checkpoint around them: give the checkpoint directory as pretrain wrote it, "
                f"with its {STEP_FILE} and {MANIFEST_FILE}")
    if found[0] == directory:
        what = f"{directory} is"
    else:
        what = f"{directory} holds {found[0].name}" + (f" and {len(found) - 1} more, each" if len(found) > 1 else ",")
    step = re.fullmatch(r"step-(\d+)", found[0].name)
    # flame's dump folder holds checkpoint/step-N/; its converter is given the folder and N
    dump, n = ((found[0].parent.parent, int(step.group(1))) if step and found[0].parent.name == "checkpoint"
               else ("<its dump folder>", "N"))
    return (f"{what} a torch.distributed.checkpoint of another program (flame and torchtitan save theirs as "
            f"checkpoint/step-N), not a training checkpoint of fabric-lin's ({MODEL_FILE}, {STEP_FILE}, {MANIFEST_FILE}): "
            f"convert it to Hugging Face format with that program (flame: python -m flame.utils.convert_dcp_to_hf --path "
            f"{dump} --step {n} --config <model config> --tokenizer <tokenizer>) and give fabric-lin convert_from_hf the "
            f"directory it writes")


def load_model_weights(weights_path: Path) -> Dict[str, torch.Tensor]:
    """The model's tensors of a checkpoint's lit_model.pth, single file or FSDP-sharded, as saved
    (names may carry torch.compile's `_orig_mod.` prefix)."""
    from fabric_lin.sharded_checkpoint import load_sharded_model_state

    weights_path = Path(weights_path)
    if weights_path.is_dir():
        return load_sharded_model_state(weights_path)
    return load_single_file_model_state(weights_path)


def load_single_file_model_state(path: Path) -> Dict[str, torch.Tensor]:
    """The `model` entry of a checkpoint saved by `fabric.save` on one device (or DDP)."""
    # the checkpoint also holds the RNG states, which include NumPy's (an array)
    checkpoint = torch_load_tensors(path, allow_numpy=True)
    if not isinstance(checkpoint, dict):
        raise InvalidValue(f"{path}: expected the dict saved by fabric.save, got {type(checkpoint).__name__}")
    if "model" not in checkpoint:
        if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            raise InvalidValue(f"{path} holds a bare state dict: {path.parent} is already a model directory, not a training checkpoint")
        raise InvalidValue(f"{path}: no 'model' entry; found keys {sorted(map(str, checkpoint))}")
    return tensor_dict(checkpoint["model"], path)
