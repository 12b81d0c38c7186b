"""What makes a run that run: the settings a resumed run must share with its checkpoint, unless it changes
them on purpose (`--resume_changes`).

The checkpoint's own hyperparameters.yaml and model_config.yaml are the record: a resume compares this run's
settings with them. The model, the sequence length and the seed of the weights are the run itself; a larger
global batch later in a run, a new data mix and a longer (or shorter) schedule are what practitioners change
on purpose, so they pass when named, and are then logged. The rest (logging, evaluation, saving, the layout
of processes and workers, the optimizer's settings) may change freely; changes are reported in one note.
"""
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from fabric_lin.checkpoint import HPARAMS_FILE, to_plain
from fabric_lin.config import CONFIG_FILE, Config
from fabric_lin.errors import InvalidValue
from fabric_lin.files import read_yaml

# settings a resume may change when --resume_changes names them ("data" stands for every data.* setting)
CHANGEABLE = ("train.global_batch_size", "train.max_steps", "train.max_tokens", "data", "seed")
# part of the run, never changed on resume
FIXED = ("model", "train.max_seq_length")
# not settings of the run: how this attempt was started, or where its process layout puts the work
NOT_COMPARED = ("resume", "resume_changes", "out_dir", "model_name", "model_config", "data.num_workers")
# settings of a fresh run's start, which a resume leaves aside: a change says so
NOT_READ_ON_RESUME = {"initial_checkpoint_dir": "not read: a resume's weights are its checkpoint's"}


def recorded_settings(arguments: Dict[str, Any]) -> Dict[str, Any]:
    """pretrain's `arguments` as hyperparameters.yaml records them (and the logger), for `--config` to read back: not
    `overwrite` and `resume_changes`, actions of one command rather than settings of the run, and `resume` as `auto`
    however this attempt began, so that the file continues the run from its newest checkpoint. Recorded as given, a
    resume from a named checkpoint would go back to that one again and set aside the checkpoints saved since."""
    recorded = {name: value for name, value in arguments.items() if name not in ("overwrite", "resume_changes")}
    return to_plain({**recorded, "resume": "auto"})


def flat(value: Any, prefix: str = "") -> Dict[str, Any]:
    """Nested mappings as one mapping of dotted keys; a data module's class_path/init_args as `data` and `data.*`."""
    if not isinstance(value, dict):
        return {prefix: value}
    if "class_path" in value and "init_args" in value:
        return {prefix: value["class_path"], **flat(value["init_args"], prefix)}
    out: Dict[str, Any] = {}
    for key, item in value.items():
        out.update(flat(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def settings(hparams: Dict[str, Any], model: Dict[str, Any]) -> Dict[str, Any]:
    """The run's settings as dotted keys, the model's config (less its name) as one entry; as the YAML files
    hold them, so that a tuple given and the list read back compare equal."""
    hparams, model = yaml.safe_load(yaml.safe_dump(hparams)), yaml.safe_load(yaml.safe_dump(model))
    # a key's own keys too: a model_config given as a mapping flattens to model_config.hidden_size, ...
    values = {k: v for k, v in flat(hparams).items() if not any(k == n or k.startswith(n + ".") for n in NOT_COMPARED)}
    values["model"] = {k: v for k, v in model.items() if k != "name"}
    return values


def group_of(key: str) -> str:
    return "data" if key == "data" or key.startswith("data.") else key


def describe(key: str, saved: Any, given: Any) -> str:
    if key == "model":
        fields = sorted(k for k in set(saved) | set(given) if saved.get(k) != given.get(k))
        return "model: " + ", ".join(f"{k} {saved.get(k)!r} in the checkpoint, {given.get(k)!r} here" for k in fields)
    unread = f" ({NOT_READ_ON_RESUME[key]})" if key in NOT_READ_ON_RESUME and given is not None else ""
    return f"{key}: {saved!r} in the checkpoint, {given!r} here{unread}"


def ways_on_from(checkpoint_dir: Path, model: Dict[str, Any], saved_seq_length: Any, out_dir: Any) -> str:
    """After a refusal to resume another model or sequence length: the flags that resume the checkpoint's run, the
    way to run this one instead (elsewhere than the checkpoint's run, whose out_dir `out_dir` may be, or without
    --resume where it is not), and where its weights fit this run's model, how to start this run from them."""
    from fabric_lin.weights import meta_model

    saved_config, config = Config.from_checkpoint(checkpoint_dir), Config(**model)
    flags = []
    if {**saved_config.to_dict(), "name": None} != {**config.to_dict(), "name": None}:
        flags.append(saved_config.flag(checkpoint_dir / CONFIG_FILE))
    if saved_seq_length is not None:
        flags.append(f"--train.max_seq_length {saved_seq_length}")
    in_its_run = out_dir is not None and Path(checkpoint_dir).resolve().parent == Path(out_dir).resolve()
    instead = "write this run to another --out_dir" if in_its_run else "start this run without --resume"
    resume = f"Resume it with the checkpoint's {' '.join(flags)}, or {instead}"
    shapes = [{name: tuple(t.shape) for name, t in meta_model(c).state_dict().items()} for c in (saved_config, config)]
    if shapes[0] != shapes[1]:
        return resume + " (the checkpoint's weights do not fit this model's shapes, so they cannot start it either)"
    return (resume + f"; or start this run from its weights: fabric-lin convert_pretrained_checkpoint {checkpoint_dir} "
            f"--output_dir <DIR>, then --initial_checkpoint_dir <DIR>")


def check_changeable(names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in CHANGEABLE]
    if unknown:
        raise InvalidValue(f"--resume_changes {', '.join(unknown)}: expected names among {', '.join(CHANGEABLE)}")


def compare_with_checkpoint(checkpoint_dir: Path, hparams: Dict[str, Any], model: Dict[str, Any],
                            allowed: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(changes of the run that `allowed` lets pass, other changed settings), each described in a few words.
    Raises, in one message naming each saved and given value, where the run itself changed."""
    check_changeable(allowed)
    checkpoint_dir = Path(checkpoint_dir)
    saved_hparams = read_yaml(checkpoint_dir / HPARAMS_FILE) or {}
    saved_model = read_yaml(checkpoint_dir / CONFIG_FILE) or {}
    saved, given = settings(saved_hparams, saved_model), settings(hparams, model)
    changed = [k for k in sorted(set(saved) | set(given)) if saved.get(k) != given.get(k)]
    fixed = [k for k in changed if k in FIXED]
    if fixed:
        raise InvalidValue(
            f"--resume {checkpoint_dir}: a resumed run trains the checkpoint's run, and this one differs in "
            + "; ".join(describe(k, saved.get(k), given.get(k)) for k in fixed) + ". "
            + ways_on_from(checkpoint_dir, model, saved.get("train.max_seq_length") if "train.max_seq_length" in fixed
                           else None, hparams.get("out_dir"))
        )
    refused = [k for k in changed if group_of(k) in CHANGEABLE and group_of(k) not in allowed]
    if refused:
        names = sorted({group_of(k) for k in refused})
        raise InvalidValue(
            f"--resume {checkpoint_dir}: this run differs from the checkpoint's in "
            + "; ".join(describe(k, saved.get(k), given.get(k)) for k in refused)
            + f". Resume with the checkpoint's values (its {HPARAMS_FILE}), or change them on purpose with "
            f"--resume_changes '[{', '.join(names)}]' (tutorials/resume.md says what then happens)"
        )
    run_changes = [describe(k, saved.get(k), given.get(k)) for k in changed if group_of(k) in CHANGEABLE]
    other = [describe(k, saved.get(k), given.get(k)) for k in changed if group_of(k) not in CHANGEABLE]
    return run_changes, other


def check_every_process_runs_this_command(fabric, command: Dict[str, Any], devices: int) -> None:
    """Each process of a run is started by a command of its own (on every node by hand or by its scheduler): one given
    another model, data, seed or out_dir would still join the others and train with them, its weights and batches
    mixed into theirs, so every process compares its `command` (the run's settings and how this attempt starts) with
    every other's and all stop, with the same message, where one differs. The processes of one node that Fabric
    starts itself inherit one command; the check is cheap, so it is made there too."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or fabric.world_size == 1:
        return
    mine = flat(yaml.safe_load(yaml.safe_dump(to_plain(command))))
    every: List[Dict[str, Any]] = [{} for _ in range(fabric.world_size)]
    dist.all_gather_object(every, mine)
    line = settings_across_processes(every, devices)
    if line is not None:
        raise InvalidValue(line)


def settings_across_processes(every: List[Dict[str, Any]], devices: int, shown: int = 3) -> Optional[str]:
    """The settings (dotted keys) in which the processes' commands differ, each with its values and the ranks (and
    nodes of `devices` processes) that gave them, or None where they are all alike."""
    from fabric_lin.rendezvous import listed

    keys = sorted({key for settings_ in every for key in settings_})
    differ = [key for key in keys if any(s.get(key) != every[0].get(key) for s in every)]
    if not differ:
        return None
    parts = []
    for key in differ[:shown]:
        values: List[Tuple[Any, List[int]]] = []
        for rank, settings_ in enumerate(every):
            value = settings_.get(key)
            for known, ranks in values:
                if known == value:
                    ranks.append(rank)
                    break
            else:
                values.append((value, [rank]))
        parts.append(f"{key}: " + ", ".join(
            f"{value!r} on {listed('rank', ranks)} ({listed('node', sorted({rank // devices for rank in ranks}))})"
            for value, ranks in values))
    more = f"; and {len(differ) - shown} more" if len(differ) > shown else ""
    return ("the processes of this run were started with different commands, which would train one model on mixed "
            "weights and data: " + "; ".join(parts) + more + ". Start every node with the same command and options "
            "(only NODE_RANK, or what torchrun or the scheduler sets, differs between them)")
