"""A model directory: the weights of one model and what is needed to run it.

    lit_model.pth        the model's state dict alone (plain `torch.save` of a dict of tensors)
                         or, instead, model.safetensors / model.safetensors.index.json with shards
    model_config.yaml    `Config.save`
    tokenizer files      `fabric_lin.data.tokenizer.TOKENIZER_FILES`
    trained_with.json    the tokenizer the weights were trained with (vocab_size, sha256 of its tokenizer.model):
                         `fabric_lin.data.tokenizer.Tokenizer` refuses another tokenizer.model put there; and the
                         data they were trained on, which evaluate compares its data with. A directory written
                         before it was kept has none, and loads as before

Everything read here comes from files that travel between people, so nothing is unpickled beyond
tensors (`torch.load(weights_only=True)`, safetensors), and file names read from an index stay
inside their directory.
"""
import json
import os
import re
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Union

import torch
import torch.nn as nn

from fabric_lin.checkpoint import EVALUATION_DIR, remove_evaluation_results, signals_deferred
from fabric_lin.config import CONFIG_FILE, Config
from fabric_lin.errors import AlreadyExists, InvalidValue, MissingFile
from fabric_lin.files import (
    PART_WRITTEN_PREFIX,
    atomic_write,
    check_dir_can_be_made,
    check_outside_checkpoint_or_data,
    directories_below,
    read_json,
    short_list,
    sync_to_disk,
)
from fabric_lin.weights import (
    MODEL_FILE,
    canonical_state_dict,
    config_outline,
    inside,
    load_safetensors,
    meta_model,
    tensor_dict,
    torch_load_tensors,
    weights_outline,
)

HF_CONFIG_FILE = "config.json"  # a Hugging Face directory's (e.g. an fla export's) configuration
PEFT_ADAPTER_CONFIG = "adapter_config.json"  # peft's save_pretrained of a model's adapters alone
LLAMA_MODEL_TYPES = ("llama", "mistral")  # the Hugging Face models convert_from_llama reads
# fla's model_type of each block_type: the fla models convert_from_hf reads
MODEL_TYPES = {"gla": "gla", "gdn": "gated_deltanet", "deltanet": "delta_net", "transformer": "transformer"}
SAFETENSORS_FILE = "model.safetensors"
# more tensors than this of other shapes, within one family, depth and width, are a model of another size (head
# widths, MLP width), told in one line as another family is
ANOTHER_SIZE = 3
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def what_it_holds(directory: Path) -> Optional[str]:
    """What kind of model `directory` holds, as the errors name it ("a model directory", "an fla export", ...); None
    where it holds none."""
    from fabric_lin.checkpoint import is_training_checkpoint

    directory = Path(directory)
    if (directory / PEFT_ADAPTER_CONFIG).is_file():
        return "LoRA adapters alone"
    if is_training_checkpoint(directory):
        return "a training checkpoint"
    if (directory / CONFIG_FILE).is_file():
        return "a model directory"
    if (directory / HF_CONFIG_FILE).is_file():
        if is_llama_dir(directory):
            return "a Hugging Face Llama/Mistral directory"
        return "an fla export" if hf_model_type(directory) in MODEL_TYPES.values() else "a Hugging Face directory"
    return None


def models_below(directory: Path) -> str:
    """For a directory that holds no model: "below it: DIR (what it holds), ..." where a model lies one or two levels
    down (the output of tutorials/finetune_lora.md's script holds adapter/ and merged/), else ""."""
    found = directories_below(directory, what_it_holds)
    return "below it: " + short_list([f"{d} ({kind})" for d, kind in found.items()], 4) if found else ""


def check_model_dir_given(model_dir: Path, argument: str, command: str) -> None:
    """Refuse what the `argument` of `command` names where a model directory is expected, naming what it is and the
    command that makes a model directory of it: no directory at all, a training checkpoint, a training run's out_dir,
    a Hugging Face directory (an fla export), a directory with nothing of a model in it (naming the models below it)."""
    from fabric_lin.checkpoint import checkpoint_dirs, is_training_checkpoint

    model_dir = Path(model_dir)
    if model_dir.is_file() and (model_dir.parent / CONFIG_FILE).is_file():
        raise InvalidValue(f"{argument} {model_dir} is a file: give the model directory that holds it, {model_dir.parent}")
    if not model_dir.is_dir():
        raise MissingFile(f"{argument} {str(model_dir)!r} is not a directory")
    # told by its step.json and manifest.json, before its weights are read: they come with the optimizer's state
    if is_training_checkpoint(model_dir):
        raise InvalidValue(f"{argument} {model_dir} is a training checkpoint: {command} reads a model directory; make one "
                           f"of it with: fabric-lin convert_pretrained_checkpoint {model_dir} --output_dir <DIR>")
    if (model_dir / CONFIG_FILE).is_file():
        return
    check_not_lora_adapters(model_dir, command, reads_exports=False)
    run_checkpoints = [p.name for p in checkpoint_dirs(model_dir)]
    if run_checkpoints:
        raise InvalidValue(
            f"{model_dir} is a training run's directory (it holds {', '.join(run_checkpoints[:3])}): {command} reads "
            f"a model directory; make one from a checkpoint with: fabric-lin convert_pretrained_checkpoint "
            f"{model_dir / run_checkpoints[0]} --output_dir <DIR>"
        )
    if (model_dir / HF_CONFIG_FILE).is_file():
        if is_llama_dir(model_dir):
            raise InvalidValue(f"{model_dir} is a Hugging Face Llama/Mistral directory: {command} reads a model directory; "
                               f"make a GLA one from it with: {from_llama_command(model_dir)}")
        raise InvalidValue(
            f"{model_dir} is a Hugging Face directory ({HF_CONFIG_FILE}, no {CONFIG_FILE}), e.g. an fla export: {command} "
            f"reads a model directory; make one with: fabric-lin convert_from_hf {model_dir} --output_dir <DIR>"
        )
    weights = (MODEL_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE)
    if not any((model_dir / name).exists() for name in weights):
        below = models_below(model_dir)
        raise MissingFile(f"{model_dir} holds no {CONFIG_FILE} and no weights: {command} reads a model directory"
                          + (f"; {below}" if below else ""))


def check_export_given(export_dir: Path, command: str) -> None:
    """Refuse what `command` is given where an fla export is expected, naming what it is and, where there is one, the
    command that reads it: nothing there, a file (of an export: its directory), LoRA adapters, a model directory (the
    other way: convert_to_hf), a training checkpoint or a run's out_dir (convert_pretrained_checkpoint)."""
    from fabric_lin.checkpoint import checkpoint_dirs, is_training_checkpoint

    export_dir = Path(export_dir)
    expected = f"expected an fla export ({HF_CONFIG_FILE} and safetensors, as convert_to_hf writes them)"
    if not export_dir.exists():
        raise MissingFile(f"{export_dir} does not exist: {expected}")
    if not export_dir.is_dir():
        of_export = (export_dir.parent / HF_CONFIG_FILE).is_file()
        raise InvalidValue(f"{export_dir} is a file: " + (f"give {command} the export that holds it, {export_dir.parent}"
                                                          if of_export else expected))
    check_not_lora_adapters(export_dir, command, reads_exports=True)
    if (export_dir / HF_CONFIG_FILE).is_file():
        return
    to_model_dir = f"fabric-lin convert_pretrained_checkpoint {{}} --output_dir <DIR> makes a model directory of it"
    if is_training_checkpoint(export_dir):
        raise InvalidValue(f"{export_dir} is a training checkpoint, not an fla export: {to_model_dir.format(export_dir)}")
    run_checkpoints = [p.name for p in checkpoint_dirs(export_dir)]
    if run_checkpoints:
        raise InvalidValue(f"{export_dir} is a training run's directory (it holds {', '.join(run_checkpoints[:3])}), not an "
                           f"fla export: {to_model_dir.format(export_dir / run_checkpoints[0])}")
    if (export_dir / CONFIG_FILE).is_file():
        raise InvalidValue(f"{export_dir} is a model directory ({CONFIG_FILE}) already, not an fla export; to export it "
                           f"in fla's format (the other way): fabric-lin convert_to_hf {export_dir} --output_dir <DIR>")
    below = models_below(export_dir)
    held = sorted(p.name for p in export_dir.iterdir())
    raise MissingFile(f"{export_dir} holds no {HF_CONFIG_FILE}: {expected}; " + (below or "it holds " + (
        ", ".join(held[:5]) + (", ..." if len(held) > 5 else "") if held else "nothing")))


def check_training_checkpoint_given(checkpoint_dir: Path) -> None:
    """Refuse, where a training checkpoint is expected, a directory without weights of its own that holds a model of a
    kind another command reads (an fla export, a Llama, LoRA adapters), or nothing of a model with models below it;
    what has weights or a run's checkpoints is `fabric_lin.checkpoint_kinds.find_training_checkpoint`'s to name."""
    from fabric_lin.checkpoint import checkpoint_dirs

    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir() or (checkpoint_dir / MODEL_FILE).exists() or checkpoint_dirs(checkpoint_dir):
        return
    kind = what_it_holds(checkpoint_dir)
    fixes = {
        "an fla export": f"fabric-lin convert_from_hf {checkpoint_dir} --output_dir <DIR> makes a model directory of it",
        "a Hugging Face Llama/Mistral directory": f"make a GLA model directory of it with: {from_llama_command(checkpoint_dir)}",
        "LoRA adapters alone": "merge them into the export they were trained on (merge_and_unload, "
                               "tutorials/finetune_lora.md) and convert the merged export with fabric-lin convert_from_hf",
    }
    if kind is not None:
        raise InvalidValue(f"{checkpoint_dir} is not a training checkpoint but {kind}"
                           + (f": {fixes[kind]}" if kind in fixes else ""))
    below = models_below(checkpoint_dir)
    if below:
        raise MissingFile(f"{checkpoint_dir} is not a training checkpoint: it has no {MODEL_FILE}; {below}")


def check_not_lora_adapters(directory: Path, command: str, reads_exports: bool) -> None:
    """Refuse a LoRA fine-tune's adapters alone (peft's save_pretrained of a PeftModel, tutorials/finetune_lora.md's
    adapter/): low-rank changes to the weights of an export, not a model. `command` reads fla exports
    (`reads_exports`) or model directories only; the directory to give it instead is named."""
    if not (Path(directory) / PEFT_ADAPTER_CONFIG).is_file():
        return
    instead = ("the merged export" if reads_exports
               else "the model directory that fabric-lin convert_from_hf makes of the merged export")
    raise InvalidValue(
        f"{directory} holds LoRA adapters alone (peft's {PEFT_ADAPTER_CONFIG}), not a model: merge them into the export "
        f"they were trained on (merge_and_unload, tutorials/finetune_lora.md) and give {command} {instead}"
    )


def check_tokenizer_fits_model(directory: Path, config: Config, given_by: str) -> None:
    """Refuse a directory whose tokenizer.model has more pieces than its model has embeddings: it is not the model's
    tokenizer (an id past the last embedding cannot be read), and a converter would copy it and record it as the one
    the weights were trained with, where it holds no such record yet. `given_by`: the argument that named `directory`."""
    from fabric_lin.data.tokenizer import Tokenizer

    if (Path(directory) / "tokenizer.model").is_file():
        Tokenizer(directory, given_by).check_fits(config.vocab_size, directory)


def hf_model_type(directory: Path) -> Optional[str]:
    """The model_type of `directory`'s config.json; None where it has none or cannot be read."""
    try:
        return json.loads((Path(directory) / HF_CONFIG_FILE).read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_llama_dir(directory: Path) -> bool:
    """Whether `directory`'s config.json is a Hugging Face Llama's or Mistral's (which convert_from_llama reads, and
    convert_from_hf does not)."""
    return hf_model_type(directory) in LLAMA_MODEL_TYPES


def from_llama_command(llama_dir: Path) -> str:
    return (f"fabric-lin convert_from_llama --checkpoint_dir {llama_dir} --model_name <a GLA model of its width and depth: "
            f"fabric-lin pretrain list> --output_dir <DIR>")


def load_model_dir_weights(
    model_dir: Union[str, Path], model: Optional[Union[nn.Module, Config]] = None
) -> Dict[str, torch.Tensor]:
    """The state dict stored in `model_dir` (lit_model.pth, else safetensors), on the CPU.

    `torch.compile`'s `_orig_mod.` prefixes are removed. A training checkpoint (the dict with
    `model`, `optimizer`, ...) or a sharded one is refused with the command that converts it.
    With `model` (a module, possibly on meta, or a Config: the model of the directory's model_config.yaml), the
    tensors are checked against it by `check_state_dict`.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise MissingFile(f"{model_dir} is not a directory: expected a model directory holding {MODEL_FILE}")
    path = model_dir / MODEL_FILE
    if path.is_dir():
        raise InvalidValue(
            f"{path} is a directory: this is a sharded training checkpoint, not a model directory. "
            f"Convert it first: fabric-lin convert_pretrained_checkpoint {model_dir} --output_dir <DIR>"
        )
    if path.is_file():
        state = torch_load_tensors(path)
        if isinstance(state, dict) and isinstance(state.get("model"), dict):
            raise InvalidValue(
                f"{path} is a training checkpoint (keys {sorted(state)[:6]}), not a model state dict. "
                f"Convert it first: fabric-lin convert_pretrained_checkpoint {model_dir} --output_dir <DIR>"
            )
    elif (model_dir / SAFETENSORS_FILE).is_file() or (model_dir / SAFETENSORS_INDEX_FILE).is_file():
        state = load_safetensors_dir(model_dir)
    else:
        raise MissingFile(
            f"{model_dir} holds no {MODEL_FILE}, {SAFETENSORS_FILE} or {SAFETENSORS_INDEX_FILE}; "
            f"found {sorted(p.name for p in model_dir.iterdir())[:10]}"
        )
    state = canonical_state_dict(tensor_dict(state, path))
    if model is not None:
        check_state_dict(state, model, source=str(weights_file(model_dir)), config_file=model_dir / CONFIG_FILE)
    return state


def weights_file(model_dir: Path) -> Path:
    """The file of a model directory that holds its weights, as the errors name it: lit_model.pth, else the safetensors
    file or the index of its shards."""
    for name in (MODEL_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE):
        if (Path(model_dir) / name).exists():
            return Path(model_dir) / name
    return Path(model_dir) / MODEL_FILE


def check_state_dict(
    state_dict: Dict[str, torch.Tensor], model: Union[nn.Module, Config], exact_dtype: bool = False,
    source: str = "state dict", config_file: Optional[Path] = None, model_is: Optional[str] = None,
    fix: Optional[str] = None,
) -> None:
    """Raise a ValueError listing every difference between `state_dict` and `model`'s own:
    missing and unexpected names, shape mismatches and dtype mismatches.

    Floating-point tensors of another precision are accepted unless `exact_dtype` (a bf16 export
    loads into an fp32 model); a floating tensor where an integer one is expected, or the reverse,
    is always a mismatch. `model` may be on the meta device, or a `Config` (checked on meta).

    Weights of another model (another family, depth or width, or many tensors of other shapes) are told in one line:
    what the weights are and what the model is, which `config_file` (the file the model was read from, beside the
    weights) or `model_is` ("this run builds") names, then `fix` (by default: put back the config file written with the
    weights). A given `fix` also ends the list of a few differences.
    """
    config = model if isinstance(model, Config) else getattr(model, "config", None)
    if isinstance(model, Config):
        model = meta_model(model)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    problems, shapes = [], []
    for name, want in expected.items():
        got = state_dict.get(name)
        if got is None:
            continue
        if tuple(got.shape) != tuple(want.shape):
            problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
            shapes.append((name, tuple(got.shape), tuple(want.shape)))
        if got.dtype != want.dtype and (exact_dtype or got.dtype.is_floating_point != want.dtype.is_floating_point):
            problems.append(f"{name}: dtype {got.dtype}, expected {want.dtype}")
    if not (missing or unexpected or problems):
        return
    if isinstance(config, Config):
        weights, wanted = weights_outline(state_dict), config_outline(config)
        if not weights.same_model(wanted) or len(shapes) > ANOTHER_SIZE:
            model_is = f"{config_file} describes" if config_file is not None else (model_is or "the model is")
            name, got, want = shapes[0] if shapes and weights.same_model(wanted) else (None, None, None)
            differs = f", whose {name} is {want} where the weights' is {got}" if name is not None else ""
            default = (f"they were not written together; put back the {Path(config_file).name} written with these "
                       f"weights" if config_file is not None else "give the weights of this model, or a model of these")
            raise InvalidValue(f"{source} holds {weights} and {model_is} {config.name}, {wanted}{differs}: "
                               f"{fix or default}")
    lines = [f"{source} does not match the model:"]
    if missing:
        lines.append(f"  missing ({len(missing)}): {short_list(missing)}")
    if unexpected:
        lines.append(f"  unexpected ({len(unexpected)}): {short_list(unexpected)}")
    lines += [f"  {p}" for p in problems] + ([f"  {fix}"] if fix else [])
    raise InvalidValue("\n".join(lines))


def load_safetensors_dir(directory: Union[str, Path], prefix_filter: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """All tensors of `model.safetensors`, or of the shards listed by `model.safetensors.index.json`."""
    directory = Path(directory)
    index_path = directory / SAFETENSORS_INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise InvalidValue(f"{index_path}: expected a non-empty 'weight_map' of tensor name -> shard file")
        refuse_mixed_exports(directory, weight_map.values(), index_path)
        files = {}
        for tensor_name, file_name in weight_map.items():
            files.setdefault(file_name, set()).add(tensor_name)
        state = {}
        for file_name, names in files.items():
            shard_path = inside(directory, file_name, str(index_path))
            if not shard_path.is_file():
                raise MissingFile(f"{index_path} lists {file_name!r}, which does not exist in {directory}")
            shard = load_safetensors(shard_path)
            absent = sorted(names - set(shard))
            if absent:
                raise InvalidValue(f"{index_path} places {short_list(absent)} in {file_name}, which lacks them")
            for name in names:
                state[name] = shard[name]
        return state
    path = directory / SAFETENSORS_FILE
    if not path.is_file():
        found = sorted(p.name for p in directory.glob("*.safetensors"))
        raise MissingFile(
            f"{directory} holds neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX_FILE}"
            + (f" (found {found[:5]}; an index file is needed for shards)" if found else "")
        )
    return load_safetensors(path)


def refuse_mixed_exports(directory: Path, index_files: Iterable[str], index_path: Path) -> None:
    """Refuse a directory whose model.safetensors is not one of the files its index lists: two
    exports were written into it, and readers disagree on which wins (transformers takes
    model.safetensors, an index-first reader the shards)."""
    if (Path(directory) / SAFETENSORS_FILE).is_file() and SAFETENSORS_FILE not in set(index_files):
        raise InvalidValue(
            f"{directory} holds both {SAFETENSORS_FILE} and {index_path.name}, which does not list it: two exports "
            f"are mixed in one directory and it is unclear which weights are meant; remove the stale one "
            f"(or export again into an empty directory)"
        )


# what Hugging Face's save_pretrained writes beside a model's config.json and safetensors: transformers' AutoTokenizer
# reads tokenizer.json before tokenizer.model, and generate the ids of generation_config.json before config.json's
HF_MODEL_FILES = ("generation_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json")
# the files by which a reader takes a directory for a model, with its weights: the model directory's lit_model.pth
# (model_config.yaml without it is no model: `unfinished_conversion`), an export's config.json
MODEL_MARKS = (MODEL_FILE, HF_CONFIG_FILE)


def is_model_file(name: str) -> bool:
    """Whether a file of this name in a model directory or an export is one of its model's (its weights, its config,
    its tokenizer and the record of it), which a conversion writes and `--overwrite true` replaces."""
    from fabric_lin.data.tokenizer import TOKENIZER_FILES, TRAINED_WITH_FILE

    written_by_a_conversion = {MODEL_FILE, CONFIG_FILE, HF_CONFIG_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE,
                               TRAINED_WITH_FILE, *TOKENIZER_FILES, *HF_MODEL_FILES}
    return name in written_by_a_conversion or _SHARD_NAME.fullmatch(name) is not None


def part_written(name: str) -> bool:
    """Whether a file of this name is one that `atomic_write` had not finished (a conversion killed in the middle of
    writing it): the size of the whole file at most, and read by nothing."""
    return name.startswith(PART_WRITTEN_PREFIX) and is_model_file(name[len(PART_WRITTEN_PREFIX):])


def remove_earlier_model(directory: Path) -> None:
    """Delete what a conversion wrote into `directory` before (`--overwrite true`), in either format: a model
    directory's lit_model.pth and model_config.yaml, an export's config.json and safetensors (one file, or shards and
    their index), the tokenizer files and trained_with.json, what save_pretrained writes beside a Hugging Face model
    (`HF_MODEL_FILES`), the part-written files of a conversion killed there, and evaluate's results of that model in its
    evaluate/; other files stay. Left beside the new model, the earlier one is what some reader would load: generate
    reads lit_model.pth, convert_from_hf and transformers config.json and the safetensors, a stale index or
    model.safetensors wins over new shards or the reverse; its tokenizer and trained_with.json would be taken for the
    new weights' (transformers takes an earlier tokenizer.json over the new tokenizer.model), and its results (which
    name the directory, not the weights) for theirs. The weights and config.json go first: a kill in the middle leaves
    files that no reader takes for a model (`unfinished_conversion` names them), not a model without its tokenizer."""
    removed = []
    for path in sorted(Path(directory).iterdir(), key=lambda path: (not weights_or_mark(path.name), path.name)):
        if path.is_file() and (is_model_file(path.name) or part_written(path.name)):
            path.unlink()
            removed.append(path.name)
    removed += [f"{EVALUATION_DIR}/{name}" for name in remove_evaluation_results(Path(directory) / EVALUATION_DIR)]
    if removed:
        print(f"Removed the files of an earlier model in {directory}: {short_list(removed, 6)}")


def weights_or_mark(name: str) -> bool:
    """Whether a file of this name holds a model's weights (lit_model.pth, the safetensors, their index) or is one of
    the `MODEL_MARKS`."""
    weights = (MODEL_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE, *MODEL_MARKS)
    return name in weights or _SHARD_NAME.fullmatch(name) is not None


# where a conversion writes its model before the model in its output directory is replaced: inside that directory, so
# on its file system (the files move in by renames), and under atomic_write's prefix for what is not written whole yet:
# hidden, so no search for models below a directory looks into it
STAGING_DIR = f"{PART_WRITTEN_PREFIX}new-model"


@contextmanager
def model_written_aside(output_dir: Path) -> Iterator[Path]:
    """Within the block, a conversion writes its model's files into the directory yielded, a staging directory inside
    the existing `output_dir`; once the block has ended, and only then, the model written there before
    (`remove_earlier_model`) is replaced by them, every one of them written whole and on the disk. A block that fails
    (Ctrl-C, SIGTERM, a full disk) takes the staging directory with it and leaves `output_dir` as it was, the earlier
    model whole: removed before the new one was written, it would be lost to a conversion that stops. (The cost: room
    for both models until the end.) A file system error names the file by its name in `output_dir`, where the user
    will look for it.

    The replacement (unlinks and renames: no data written, milliseconds) runs with SIGINT and SIGTERM deferred, so a
    Ctrl-C does not split it; one that came meanwhile ends the block once the new model is whole and on the disk, as a
    KeyboardInterrupt whose `kept` says so (the command's last line: not "run it again"). A kill that cannot be
    deferred (SIGKILL) leaves no mix of two models: the earlier model's weights go first, and the new model's
    lit_model.pth or config.json, which a reader takes the directory by, comes last; its staging directory is
    removed by the next conversion into `output_dir` (`prepare_output_dir`)."""
    output_dir = Path(output_dir)
    staging = output_dir / STAGING_DIR
    remove_stopped_staging(output_dir)
    staging.mkdir()
    try:
        try:
            yield staging
            for path in staging.iterdir():  # on the disk before the earlier model goes, not lost with it to a power cut
                sync_to_disk(path)
        except OSError as error:
            if error.filename is None or staging not in Path(error.filename).parents:
                raise
            named = output_dir / Path(error.filename).relative_to(staging)
            raise OSError(error.errno, error.strerror, str(named)) from error
        try:
            with signals_deferred(signal.SIGINT, signal.SIGTERM):
                remove_earlier_model(output_dir)
                for path in sorted(staging.iterdir(), key=lambda path: (path.name in MODEL_MARKS, path.name)):
                    os.replace(path, output_dir / path.name)
                sync_to_disk(output_dir)
        except KeyboardInterrupt as stopped:  # a signal that came as the files moved in, raised once all of them had
            stopped.kept = (f"the conversion had finished: the new model in {output_dir} is whole (the signal came as its "
                            f"files took the earlier model's place, which went on to its end)")
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def remove_stopped_staging(output_dir: Path) -> None:
    """Remove the staging directory (`model_written_aside`) of a conversion into `output_dir` that was killed outright
    (SIGKILL, a power cut), with the part of a model it holds."""
    staging = Path(output_dir) / STAGING_DIR
    if staging.is_symlink() or staging.is_file():
        staging.unlink()
    elif staging.is_dir():
        shutil.rmtree(staging)
        print(f"Removed {staging}: the unfinished files of a conversion that was stopped")


def save_safetensors_dir(
    state_dict: Dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = 5 * 2**30, metadata: Optional[dict] = None
) -> List[str]:
    """Write `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` plus the index when the
    tensors exceed `max_shard_bytes`, into `directory` (a conversion's staging directory: `model_written_aside`).
    Returns the file names written."""
    from safetensors.torch import save_file

    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.contiguous()
        size += nbytes
    metadata = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        atomic_write(directory / SAFETENSORS_FILE, lambda p: save_file(shards[0], p, metadata=metadata))
        return [SAFETENSORS_FILE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(directory / file_name, lambda p, s=shard: save_file(s, p, metadata=metadata))
        weight_map.update({k: file_name for k in shard})
        names.append(file_name)
    total = sum(t.numel() * t.element_size() for t in state_dict.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(directory / SAFETENSORS_INDEX_FILE, lambda p: Path(p).write_text(json.dumps(index, indent=2) + "\n"))
    return names + [SAFETENSORS_INDEX_FILE]


def parse_dtype(dtype: Optional[str]) -> Optional[torch.dtype]:
    if dtype is None:
        return None
    if dtype not in DTYPES:
        raise InvalidValue(f"dtype {dtype!r} is not supported; choose one of {list(DTYPES)}")
    return DTYPES[dtype]


def cast_floating(state_dict: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]) -> Dict[str, torch.Tensor]:
    """Cast the floating-point tensors in place, one at a time, so a 7B model is never held twice. A value past the
    range of a narrower `dtype` (float16's 65504) is refused, naming the tensor: it would become inf."""
    if dtype is not None:
        for name, tensor in state_dict.items():
            if tensor.is_floating_point():
                state_dict[name] = cast = tensor.to(dtype)
                narrower = torch.finfo(dtype).max < torch.finfo(tensor.dtype).max
                if narrower and torch.isinf(cast).sum() > torch.isinf(tensor).sum():
                    given = next((key for key, value in DTYPES.items() if value == dtype), str(dtype))
                    finite = tensor[torch.isfinite(tensor)]
                    raise InvalidValue(
                        f"--dtype {given}: {name} holds {finite[finite.abs().argmax()].item():g}, past {given}'s largest "
                        f"value ({torch.finfo(dtype).max:g}), which would be inf: give --dtype bfloat16 or float32")
    return state_dict


def prepare_output_dir(output_dir: Path, overwrite: bool, sources: Iterable[Path] = ()) -> Path:
    """Check `output_dir` before anything is written: refuse a non-empty one unless `overwrite`, and one
    that is a source, and a training checkpoint or run directory even with `overwrite` (a model directory's weights
    would replace the checkpoint's), and a prepared data directory (its tokenizer files, which its prepared.json
    records, would be replaced by the model's). The staging directory of a conversion into it that was killed outright
    (`model_written_aside`) is removed first: it holds no model, and the directory is taken as if it were not there.
    Create it with `fabric_lin.files.created_dir(output_dir)`, which removes it again (when still empty) if the
    conversion fails."""
    from fabric_lin.checkpoint import checkpoint_dirs, is_training_checkpoint

    output_dir = Path(output_dir)
    for source in sources:
        if output_dir.resolve() == Path(source).resolve():
            raise InvalidValue(f"output_dir {output_dir} is the input directory; choose another one")
    check_dir_can_be_made(output_dir, "--output_dir")
    if output_dir.is_dir() and is_training_checkpoint(output_dir):
        raise AlreadyExists(f"output_dir {output_dir} is a training checkpoint, which a conversion does not write into "
                            f"(its {MODEL_FILE} would replace the checkpoint's): choose another directory")
    run_checkpoints = [p.name for p in checkpoint_dirs(output_dir)]
    if run_checkpoints:
        raise AlreadyExists(f"output_dir {output_dir} is a training run's directory (it holds {', '.join(run_checkpoints[:3])}), "
                            f"which a conversion does not write into: choose another directory")
    from fabric_lin.data.prepared import INDEX_FILE, PREPARED_INFO_FILE

    data_files = [name for name in (PREPARED_INFO_FILE, INDEX_FILE) if (output_dir / name).is_file()]
    if data_files:
        raise AlreadyExists(f"output_dir {output_dir} is a prepared data directory (it holds {data_files[0]}), which a "
                            f"conversion does not write into (the model's tokenizer files would replace the data's): "
                            f"choose another directory")
    check_outside_checkpoint_or_data(output_dir, "output_dir")
    remove_stopped_staging(output_dir)
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        unfinished = unfinished_conversion(output_dir)
        if unfinished:
            raise AlreadyExists(f"output_dir {output_dir} holds {unfinished}: no whole model; pass --overwrite true to "
                                f"write this one in its place")
        kind = what_it_holds(output_dir)
        # a model that a printed suggestion's --output_dir (checkpoints/<model name>) may name; adapters stay beside one
        if kind is not None and kind != "LoRA adapters alone":
            raise AlreadyExists(f"output_dir {output_dir} holds {kind} already: --overwrite true would replace its model "
                                f"with this one; to keep it, give another --output_dir")
        raise AlreadyExists(
            f"output_dir {output_dir} is not empty (holds {sorted(p.name for p in output_dir.iterdir())[:5]}); "
            "pass --overwrite true to write into it"
        )
    return output_dir


def unfinished_conversion(directory: Path) -> str:
    """What a conversion stopped before its end (killed: it had no time to take its files back) left in `directory`, as
    the refusal of it says it ("a model_config.yaml without weights, and the part-written .tmp-lit_model.pth"); "" where
    it holds no such thing. A model directory gets its weights last, so its model_config.yaml without them is not a
    model, whatever wrote it."""
    names = {path.name for path in Path(directory).iterdir()}
    parts = []
    if CONFIG_FILE in names and not names & {MODEL_FILE, SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE}:
        parts.append(f"a {CONFIG_FILE} without weights ({MODEL_FILE})")
    leftovers = sorted(name for name in names if part_written(name))
    if leftovers:
        parts.append(f"the part-written {short_list(leftovers, 3)} of a conversion that was stopped")
    return ", and ".join(parts)


def save_model_dir(
    state_dict: Dict[str, torch.Tensor], config: Config, output_dir: Path, tokenizer_dir: Optional[Path] = None,
    tokenizer_given_by: str = "",
) -> List[str]:
    """Write (from `tokenizer_dir`, named by the argument `tokenizer_given_by` where it is wrong) the tokenizer files with the record of the tokenizer the weights were trained with,
    model_config.yaml and lit_model.pth into the existing `output_dir`, in place of any model written there before,
    which stays until every new file is written whole (`model_written_aside`). A tokenizer.model that is not the one
    `tokenizer_dir` records is refused before anything is written. Returns the names of the tokenizer files copied."""
    from fabric_lin.data.tokenizer import weights_trained_with

    output_dir = Path(output_dir)
    trained_with = weights_trained_with(tokenizer_dir, tokenizer_given_by) if tokenizer_dir is not None else None
    with model_written_aside(output_dir) as staging:
        copied = copy_tokenizer(tokenizer_dir, staging, trained_with, output_dir) if tokenizer_dir is not None else []
        atomic_write(staging / CONFIG_FILE, config.save)
        # the weights last: a staging directory that a kill -9 left holds no model a command given it would load
        atomic_write(staging / MODEL_FILE, lambda p: torch.save(dict(state_dict), p))
    return copied


def copy_tokenizer(src_dir: Path, dst_dir: Path, trained_with: Optional[dict], output_dir: Optional[Path] = None
                   ) -> List[str]:
    """Copy the tokenizer files of `src_dir` and write `trained_with` (`weights_trained_with(src_dir)`) as
    `dst_dir`'s trained_with.json; without a tokenizer.model, warn that `output_dir` (the directory the files end up in,
    by default `dst_dir`) gets no tokenizer, and copy none."""
    from fabric_lin.data.tokenizer import TOKENIZER_FILES, copy_tokenizer_files, write_trained_with

    if trained_with is not None:
        write_trained_with(dst_dir, trained_with)
    if not (Path(src_dir) / "tokenizer.model").is_file():
        print(
            f"Warning: {src_dir} has no tokenizer.model, so {output_dir or dst_dir} gets no tokenizer; copy a "
            f"SentencePiece tokenizer.model there before running generate"
            + (" (the one its weights were trained with, as trained_with.json records)" if trained_with else "")
        )
        return []
    return [p.name for p in copy_tokenizer_files(src_dir, dst_dir) if p.name in TOKENIZER_FILES]


