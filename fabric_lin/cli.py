"""The `fabric-lin` command: one subcommand per job, each a plain function whose signature is its
command line (jsonargparse turns typed arguments into flags and YAML keys).

A failure that fabric-lin anticipates (a bad value, a missing or damaged file, ...: `fabric_lin.errors.UserError`)
is reported in one line naming the key, value or file and the fix, by rank 0 (and the first process of each other
node, naming its rank), with exit code 2; an unexpected one (a bug) keeps its traceback, as does every failure with
FABRIC_LIN_DEBUG=1. Ctrl-C exits with 130, SIGTERM with 143 (but in pretrain). A run of several processes that lost one
of them (`fabric_lin.errors.PeerLost`) says so in one line on every rank that is left, with exit code 75, unless the
rank that is gone left the error it ended on: rank 0 then prints that, naming the rank. One on several nodes whose
processes do not all join within parallelism.join_timeout_minutes ends with 69 (`fabric_lin.rendezvous`).
"""
import time

# When this process reached its entry point, and the CPU time it had used by then (fabric_lin.metrics
# derives the start of Python from the two). Taken before anything else is imported.
ENTERED_AT = (time.time(), time.process_time())

import contextlib  # noqa: E402
import importlib  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable, Dict, List, Optional, Sequence, Tuple  # noqa: E402

from fabric_lin.cli_config_files import (check_config_files, check_no_empty_paths, check_no_null_values,  # noqa: E402
                                         check_no_variable_in_paths, check_sampling_values, check_stop_strings,
                                         config_file_being_read, config_file_of, files_holding_key, option_values,
                                         positional_arguments)
from fabric_lin.errors import (DEBUG_ENV, FILE_SYSTEM_ERRNOS, PEER_LOST_EXIT_CODE, debug_enabled,  # noqa: E402
                               named_for_rank, process_rank, sigterm_interrupts)

# subcommand -> "module:function". A module is imported only when its subcommand runs (or for --help).
COMMANDS: Dict[str, str] = {
    "pretrain": "fabric_lin.pretrain:setup",
    "generate": "fabric_lin.generate:main",
    "evaluate": "fabric_lin.evaluate:main",
    "train_tokenizer": "fabric_lin.data.train_tokenizer:main",
    "prepare_slimpajama": "data_prep.prepare_slimpajama:prepare",
    "prepare_starcoder": "data_prep.prepare_starcoder:prepare",
    "prepare_text": "data_prep.prepare_text:prepare",
    "convert_pretrained_checkpoint": "fabric_lin.convert.pretrained_checkpoint:convert_pretrained_checkpoint",
    "convert_to_hf": "fabric_lin.convert.hf:convert_to_hf",
    "convert_from_hf": "fabric_lin.convert.hf:convert_from_hf",
    "convert_from_llama": "fabric_lin.convert.from_llama:convert_from_llama",
}


def load_command(name: str) -> Callable:
    module_name, function_name = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module_name), function_name)


def expected_failure(error: BaseException) -> bool:
    """An anticipated failure: a `UserError` (raised where a mistake in what the user gave is found, its message
    naming the value, file or key and the fix), or a file system error that names its file (no space left, no
    permission, read-only). Anything else is a bug, and keeps its traceback."""
    from fabric_lin.errors import UserError

    if isinstance(error, OSError) and error.errno in FILE_SYSTEM_ERRNOS and error.filename:
        return True
    return isinstance(error, UserError)


def report(prog: str, message: str) -> None:
    """One message on stderr, from rank 0, and from the first process of each other node naming its rank: a terminal's
    Ctrl-C or an error every rank meets would otherwise print once per process, while another node's own files may
    fail there alone (a path missing on that node) before any process group carries the error to rank 0, and that
    node's log would say nothing of why its processes ended."""
    rank = process_rank()
    if rank == 0 or debug_enabled():
        print(f"{prog}: {message}", file=sys.stderr, flush=True)
    elif os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID")) == "0":
        print(f"{prog}: {named_for_rank(message, rank)}", file=sys.stderr, flush=True)


DATA_MODULES = ("SampleCorpus", "LongDocuments", "TokenChunks", "SlimPajamaStarcoder", "TextFiles")
# What the keys whose value is a class take, as the one-line errors say it (jsonargparse speaks of import paths)
CLASS_VALUES = {
    "data": f"a data module ({', '.join(DATA_MODULES)} or an import path)",
    "model_config": "a mapping of fabric_lin.config.Config's fields (hidden_size, num_layers, ...)",
}
# jsonargparse's words for a class key's value that names no class of the key's kind: an import path to nothing
# ("Problem with given class_path"), to another kind of class, a word that is no import path
NO_CLASS_OF_ITS_KIND = re.compile(r"Problem with given class_path|Import path does not correspond to a subclass"
                                  r"|Expected a dot import path string|Not a valid subclass of|^Expected a (?:DataModule|Config)",
                                  re.M)

# Flags that Lightning's, LitGPT's and lm-evaluation-harness's users type for what fabric-lin names otherwise, too
# unlike its flag for the closest spelling to find it: the flag -> fabric-lin's, as the "did you mean" hint gives it
# (where the command has it)
OTHER_TOOLS_FLAGS = {
    "--strategy": "--parallelism.data_parallel fsdp or ddp",
    "--fsdp": "--parallelism.data_parallel fsdp",
    "--ddp": "--parallelism.data_parallel ddp",
    "--include_path": "--task_dir",  # lm-eval's directory of task YAML files
    "--output_path": "--out_dir",  # lm-eval's
    "--save_filepath": "--out_dir",  # LitGPT evaluate's results file
    "--dtype": "--precision",  # LitGPT evaluate's
}


def one_line_parse_error(message: str, parser, argv: Sequence[str] = ()) -> str:
    """jsonargparse's message for a bad command line or config value (up to a dozen lines) as one line:
    the key, the value given and what is expected. `argv`: the command line, whose options a hint leaves out."""
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        import difflib

        given = unknown.group(1).split()
        positionals = [a.dest for a in getattr(parser, "_actions", []) if not a.option_strings and a.dest != "help"]
        if given and not any(a.startswith("-") for a in given):  # words after the positional arguments
            if given[-1].endswith("]"):  # `--data.train_dir [a, b]`: the shell gave the option `[a,` alone
                return (f"unexpected argument {' '.join(given)}: the end of a list that the shell cut at its spaces; "
                        f"quote the whole list, e.g. '[a, b]'")
            takes = f"takes {len(positionals)}: {', '.join(positionals)}" if positionals else "takes none"
            meant = option_meant(given, parser.prog.replace(" [options]", "").split()[-1], argv)
            return (f"unexpected argument {' '.join(given)}: this command {takes}; the rest are options "
                    f"(--name value)" + (f": did you mean {meant}?" if meant else ""))
        option = next((a.split("=")[0] for a in given if a.startswith("--")), given[0] if given else "")
        if option[2:] in positionals:  # `generate --checkpoint_dir DIR`, as convert_from_llama takes it
            prog = parser.prog.replace(" [options]", "")
            return (f"unknown option {option}: {option[2:]} is this command's argument, given without a name: "
                    f"{prog} {' '.join(name.upper() for name in positionals)} [options]")
        options = [o for o in getattr(parser, "_option_string_actions", {}) if o.startswith("--")]
        if option in OTHER_TOOLS_FLAGS and OTHER_TOOLS_FLAGS[option].split()[0] in options:
            return f"unknown option {option} (did you mean {OTHER_TOOLS_FLAGS[option]}?)"
        without_init_args = option.replace(".init_args.", ".")  # LitGPT's form of a class's keys
        close = ([without_init_args] if without_init_args in options
                 else difflib.get_close_matches(option, options, n=1, cutoff=0.75))
        if not close:  # a key's name without its group: --lr for --optimizer.lr
            close = [o for o in options if o.rpartition(".")[2] == option.lstrip("-")][:2]
            close = close if len(close) == 1 else []
        return f"unknown option {option}" + (f" (did you mean {close[0]}?)" if close else "") + (
            "; options are not abbreviated" if close and close[0].startswith(option) else ""
        )
    rejected = re.match(r"Subcommand '([^']+)' does not accept option '([\w.]+)'", message)
    if rejected:
        command, key = rejected.groups()
        line = " ".join(message.split()) + unknown_key_hint(key, parser) + config_of_another_command(command, argv)
        return line + files_named(files_holding_key(f"{command}.{key}", command, list(argv)), line)
    before = re.match(r"Option '([\w.]+)' is not accepted before subcommand '(\w+)'", message)  # a global --config's
    if before:
        key, command = before.groups()
        return " ".join(message.split()) + files_named(files_holding_key(key, command, list(argv)), message)
    groups = option_groups(parser)
    # a group given as LitGPT gives its optimizer: `optimizer: {class_path: torch.optim.AdamW, init_args: ...}`
    class_path = re.match(r"Subclasses are disabled for (\w+), thus '([^']+)' is not accepted as class_path", message)
    if class_path:
        key = next((k for k, (name, _) in groups.items() if name == class_path.group(1)), class_path.group(1))
        keys = ", ".join(groups[key][1]) if key in groups else ""
        return (f"{key}: class_path {class_path.group(2)} is not taken: give the keys of {key} ({keys}) themselves, "
                f"without class_path and init_args")
    # a group given a word that is no YAML file (`--optimizer AdamW`)
    unloadable = re.match(r'Parser key "([\w.]+)":\s*Unable to load config \'([^\']*)\'', message)
    if unloadable and unloadable.group(1) in groups:
        key, given = unloadable.groups()
        inner = re.search(r"^  - (Parser key .*)", message, re.M | re.S)
        if inner and Path(given).is_file():  # a YAML file of the group's keys, one of them refused
            return one_line_parse_error(re.sub(r"^    ", "", inner.group(1), flags=re.M), parser, argv) + f" (in {given})"
        switched = "enabled" in groups[key][1] and given in ("true", "false")  # `--compile true`
        switch = f" (did you mean --{key}.enabled {given}?)" if switched else ""
        return group_value_error(key, given, groups[key][1]) + ", or the path of a YAML file of them" + switch
    keyed = re.match(r'Parser key "([^"]+)":\s*(.*)', message, re.S)
    if not keyed:
        return " ".join(message.split())
    key, rest = keyed.groups()
    misspelt = misspelt_class_key(key, rest)
    if misspelt:
        return misspelt
    nested = re.findall(r'Parser key "([^"]+)"', rest)  # a data module's or model_config's own key: data.train_weights
    unknown_options = valid_keys_hints(rest, argv)
    if unknown_options:
        return f"{key}: " + "; ".join(unknown_options)
    given = re.search(r"(?:Given|Got) value: (.*)", rest)
    # the class's own key refused (data.train_weights) is not the class refused
    no_class = not nested and NO_CLASS_OF_ITS_KIND.search(rest) is not None
    expected = [CLASS_VALUES.get(key, "a class name or import path")] if no_class else []
    for what in re.findall(r"(?:Expected a|Not a valid subclass of) (.+?)(?:\. Got value:.*)?$", rest, re.M):
        if what.startswith("path but") and len(re.findall("Expected a ", rest)) > 1:
            continue  # jsonargparse also tried the value as a config file name
        if what.startswith("dot import path string") or what.startswith(("DataModule", "Config")):
            continue  # NO_CLASS_OF_ITS_KIND's
        what = re.sub(r"<class '(?:[\w.]+\.)?(\w+)'>", r"\1", what).replace("NoneType", "null")
        what = re.sub(r"typing\.Literal\[(.*)\]", r"one of \1", what)
        if what not in expected:
            expected.append(what)
    if given and expected:
        key, value = f"{key}.{nested[-1]}" if nested else key, given.group(1).strip()
        class_path = re.fullmatch(r"\{'class_path': '([^']+)'.*\}", value)  # a config file's `data: {class_path: ...}`
        value = class_path.group(1) if class_path else value
        # `--resume_changes train.max_steps`: a list is one argument in brackets, which a shell needs quoted
        numbers = value.split()  # `--seq_len '2048 4096'`: YAML's list takes commas between its items
        items = ", ".join(numbers) if len(numbers) > 1 and all(re.fullmatch(r"-?[\d.]+", n) for n in numbers) else value
        example = f"[{items}]" if "list" in expected else "[a, b]" if "tuple" in expected else None
        how = f"; in brackets, quoted for the shell: --{key} '{example}'" if example and not value.startswith("[") else ""
        if value.startswith("[") and not value.endswith("]"):  # `--seq_len [256, 512]`: the shell cut it at its spaces
            how = f"; the shell cut the list at its spaces: quote it whole, --{key} '{value} ...]'"
        if key == "data" and no_class:
            how += closest_data_module(value)
        return f"{key}: got {value}, expected {' or '.join(expected)}{how}"
    return f"{key}: " + " ".join(rest.split())


def missing_arguments(message: str, parser) -> Optional[Tuple[object, str]]:
    """A subcommand's arguments missing (`fabric-lin generate` alone), which jsonargparse's top-level parser names as
    `generate.checkpoint_dir`: the subcommand's parser, to name the command and its --help, and the line naming them
    with the command's usage; None for any other message."""
    missing = re.fullmatch(r"the following arguments are required: (.*)", message.strip())
    subcommands = getattr(parser, "_subcommands_action", None)
    if not missing or subcommands is None:
        return None
    keys = missing.group(1).split(", ")
    command = keys[0].partition(".")[0]
    subparser = subcommands._name_parser_map.get(command)
    if subparser is None or not all(key.startswith(command + ".") for key in keys):
        return None
    names = [key[len(command) + 1:] for key in keys]
    positionals = [a.dest for a in subparser._actions if not a.option_strings and a.dest != "help"]
    usage = " ".join([subparser.prog.replace(" [options]", "")] + [name.upper() for name in positionals] + ["[options]"])
    return subparser, f"{', '.join(names)} {'is' if len(names) == 1 else 'are'} required: {usage}"


def option_meant(words: List[str], command: str, argv: Sequence[str]) -> Optional[str]:
    """The option that `words`, given where the command takes no more arguments, were most likely meant for, with its
    value, or None: a YAML file's --config, else the command's first option that the command line `argv` does not give
    (the parameter after its arguments: convert_from_llama's --checkpoint_dir, prepare_text's --input_dir, then
    --output_dir, convert_to_hf's --output_dir, generate's --prompt, pretrain's --model_name, as `litgpt pretrain
    <model>` takes it) where its type takes the first word: a path, or text that is no path (several words of it, as an
    unquoted prompt reaches the command, quoted), or, for text, the file of its `<option>_file` (generate's
    --prompt_file) where the word names a file."""
    import inspect
    import typing

    word = words[0]
    if word.endswith((".yaml", ".yml")):
        return f"--config {word}"
    if command not in COMMANDS:
        return None
    parameters = inspect.signature(load_command(command)).parameters.values()
    # options of text: a str, or a str or a list of them (generate's --stop), not an optional one (--device)
    text_options = [p.name for p in parameters if str in (typing.get_args(p.annotation) or (p.annotation,))
                    and type(None) not in typing.get_args(p.annotation)]
    cut = text_cut_at_its_spaces(words, text_options, list(argv))
    if cut is not None:
        return cut
    first_option = next((p for p in parameters if p.default is not inspect.Parameter.empty
                         and not option_values(list(argv), f"--{p.name}")), None)
    if first_option is None:
        return None
    kinds = typing.get_args(first_option.annotation) or (first_option.annotation,)
    if Path in kinds:
        return f"--{first_option.name} {word}"
    from_a_file = f"{first_option.name}_file"  # generate's --prompt_file: the text of a file given by its name
    if str in kinds and len(words) == 1 and Path(word).expanduser().is_file() and any(
            p.name == from_a_file for p in parameters):
        return f"--{from_a_file} {word}"
    if str in kinds and not (os.sep in word or Path(word).expanduser().exists()):
        return f"--{first_option.name} " + (f"'{' '.join(words)}'" if len(words) > 1 else word)
    return None


def text_cut_at_its_spaces(words: List[str], text_options: List[str], argv: List[str]) -> Optional[str]:
    """`--prompt The capital of`: where `words` follow the value of an option of text (one of `text_options`) on the
    command line `argv`, the shell cut that value at its spaces; the option with the whole value quoted, else None."""
    for at in range(len(argv) - len(words), 0, -1):
        if argv[at:at + len(words)] != words:
            continue
        before = argv[at - 1]
        option, value = (before.split("=", 1) if before.startswith("--") and "=" in before
                         else (argv[at - 2], before) if at >= 2 else ("", ""))
        if option.startswith("--") and option[2:] in text_options:
            return f"{option} '{value} {' '.join(words)}'"
        return None
    return None


def misspelt_class_key(key: str, message: str) -> Optional[str]:
    """For the data module's mapping in a config file with its class_path or init_args misspelt (`init_arg:`), that
    key named with the one meant, or None. jsonargparse takes `init_arg.num_workers` for an option of the base class,
    and a mapping without class_path for no data module at all."""
    import ast
    import difflib

    given = re.search(r"Given value: (\{.*\})\s*$", message, re.S)
    if key != "data" or given is None:
        return None
    try:
        mapping = ast.literal_eval(given.group(1))
    except (ValueError, SyntaxError):
        return None
    class_keys = ("class_path", "init_args")
    for name in mapping:
        close = difflib.get_close_matches(str(name), class_keys, n=1, cutoff=0.75)
        if name not in class_keys and close:
            return (f"{key}: got the key {name} (did you mean {close[0]}?), expected class_path (the data module) and "
                    f"init_args (its options)")
    return None


def closest_data_module(given: str) -> str:
    """' (did you mean NAME?)' for a --data value whose last part is close to a data module's name ('' if none is)."""
    import difflib

    close = difflib.get_close_matches(given.rpartition(".")[2], DATA_MODULES, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_key_hint(key: str, parser) -> str:
    """For a key that a config file gives and the command does not take (`train.max_step`): the key it most likely
    meant, and the keys of the key's group (the command's own keys for one outside any group). The key meant is the
    one of that name in another group where one group alone has it (LitGPT's `train.weight_decay`, `train.lr`) and
    the closest spelling, one or both; never the key itself (`train.epochs`, which no key of fabric-lin's resembles)."""
    import difflib

    keys = [option[2:] for option in getattr(parser, "_option_string_actions", {})
            if option.startswith("--") and option not in ("--help", "--config", "--print_config")
            and not option.endswith((".help", "+"))]
    # the group of the key: its longest start that is one (optimizer, for LitGPT's optimizer.init_args.lr)
    parts = key.split(".")
    group = next((g for g in (".".join(parts[:n]) for n in range(len(parts) - 1, 0, -1))
                  if any(k.startswith(g + ".") for k in keys)), "")
    leaf = key.rpartition(".")[2]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == leaf and k != key]
    close = elsewhere if len(elsewhere) == 1 else []
    close += [k for k in difflib.get_close_matches(key, keys, n=1, cutoff=0.75) if k not in close]
    first, _, others = key.partition(".")
    top_level = [k for k in keys if "." not in k]
    for top in difflib.get_close_matches(first, top_level, n=1, cutoff=0.75) if others and not group else []:
        children = [k for k in keys if k.startswith(top + ".")]
        if not children:  # a class key, whose own keys the parser does not list: dta.init_args.num_workers
            close = close or [f"{top}.{others}"]
        else:  # a misspelt group (trian.max_steps): the key meant among its keys, if any is close
            close = close or difflib.get_close_matches(f"{top}.{others}", children, n=1, cutoff=0.75)
    members = [k[len(group) + 1:] for k in keys if group and k.startswith(group + ".")]
    listed = (f"the keys of {group} are: {', '.join(members)}" if members
              else f"the keys are: {', '.join(top_level)}")
    return (f" (did you mean {' or '.join(close)}?)" if close else "") + "; " + listed


def files_named(files: List[str], line: str) -> str:
    """' (in FILE)' for the files that hold a key refused in `line` ('' for none, or where `line` names one)."""
    if not files or any(file in line for file in files):
        return ""
    return f" (in {' and '.join(files)})"


def config_of_another_command(command: str, argv: Sequence[str]) -> str:
    """For a --config file that `command` refuses a key of: '; FILE holds the options of fabric-lin OTHER' where another
    command takes every key of the file (a run's hyperparameters.yaml given to evaluate, an evaluate config given to
    pretrain), else ''."""
    import inspect

    from fabric_lin.files import is_a, read_yaml

    for value in option_values(list(argv), "--config"):
        path = Path(value).expanduser()
        keys = set(read_yaml(path)) if is_a(path, "file") else set()
        others = [other for other in COMMANDS if other != command and keys
                  and keys <= set(inspect.signature(load_command(other)).parameters)]
        if others:
            how = (": evaluate reads a training checkpoint's own hyperparameters.yaml, given the checkpoint directory"
                   if command == "evaluate" and path.name == "hyperparameters.yaml" else "")
            return f"; --config {value} holds the options of fabric-lin {others[0]}{how}"
    return ""


def option_groups(parser) -> Dict[str, Tuple[str, List[str]]]:
    """The command's option groups (`train`, `optimizer`, ...): the key of each -> (its class's name, its keys)."""
    groups = {}
    for group in getattr(parser, "_action_groups", []):
        keys = dataclass_fields(getattr(group, "group_class", None))
        if keys:
            groups[group.dest] = (group.group_class.__name__, keys)
    return groups


def group_value_error(key: str, given: str, keys: List[str]) -> str:
    return f"{key}: got {given}, expected a mapping of its keys ({', '.join(keys)})"


def dataclass_fields(cls) -> List[str]:
    """The names of the fields that the dataclass `cls` takes as arguments ([] for anything else)."""
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if f.init] if dataclasses.is_dataclass(cls) else []


def valid_keys_hints(message: str, argv: Sequence[str] = ()) -> List[str]:
    """For each unknown key that jsonargparse names inside a nested class (`model_config:`, `data.init_args:`),
    the keys the class accepts; for a data module's option given without its module, where the module goes (on the
    command line `argv`, or in a config file)."""
    import difflib
    import inspect

    hints = []
    for class_path, key in re.findall(r"class_path '([\w.]+)':\s*Option '([\w.]+)' is not accepted", message):
        module_name, _, class_name = class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError):
            hints.append(f"{class_path} has no option {key!r}")
            continue
        valid = dataclass_fields(cls) or [n for n in inspect.signature(cls).parameters if n not in ("self", "args", "kwargs")]
        takers = modules_taking(key) if cls.__name__ == "DataModule" else []
        on_the_command_line = [*option_values(list(argv), f"--data.{key}"),
                               *option_values(list(argv), f"--data.init_args.{key}")]
        if takers and not on_the_command_line:  # a config file's `data:` without class_path
            beside = f"class_path: {takers[0]}" if len(takers) == 1 else "the class_path of one of them"
            hints.append(f"{key} is an option of {' and '.join(takers)}: in a config file, give it under data's "
                         f"init_args, beside {beside}")
            continue
        if takers:  # an option read before its module, as jsonargparse reads the flags in order
            give = f"--data {takers[0]}" if len(takers) == 1 else "--data with one of them"
            hints.append(f"--data.{key} is an option of {' and '.join(takers)}: give {give} before it")
            continue
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.75)
        meant = f" (did you mean {close[0]}?)" if close else ""
        hints.append(f"{class_path} has no option {key!r}{meant}; valid options are: {', '.join(valid)}")
    return hints


def modules_taking(key: str) -> List[str]:
    """The data modules that take the option `key`."""
    import fabric_lin.data

    return [name for name in DATA_MODULES if key in dataclass_fields(getattr(fabric_lin.data, name))]


def main(argv=None) -> None:
    try:
        run_and_report(argv)
    except SystemExit as ending:  # a reported error's exit code (2, 130, a lost peer's...): the same ending as success
        if ending.code is None or isinstance(ending.code, int):
            end_process_of_several(ending.code or 0)
        raise
    end_process_of_several(0)


def run_and_report(argv=None) -> None:
    """The command, its anticipated errors reported in one line each and turned into exit codes."""
    argv = sys.argv[1:] if argv is None else list(argv)
    prog = f"fabric-lin {argv[0]}" if argv and argv[0] in COMMANDS else "fabric-lin"
    try:  # SIGTERM ends every command as Ctrl-C does, but pretrain, which checkpoints on it (fabric_lin.stopping)
        with sigterm_interrupts() if prog != "fabric-lin pretrain" else contextlib.nullcontext():
            run(argv)
    except KeyboardInterrupt as e:
        if debug_enabled():
            raise
        said = str(e)
        # a KeyboardInterrupt that names a signal at most (a first Ctrl-C, the preprocessors' SIGTERM) says no more:
        # every command that writes leaves nothing half-written (pretrain's own stops say what they saved), or says what
        # it wrote whole before it stopped (`kept`: evaluate's results of the data, where its tasks were interrupted)
        writes = bool(argv) and argv[0] in COMMANDS and argv[0] != "generate"
        kept = getattr(e, "kept", None)
        what_now = (f": {kept}" if kept else ": nothing half-written is left; run the same command again"
                    if writes and (not said or said.startswith("SIG")) else "")
        if said == "SIGTERM" and prog != "fabric-lin pretrain":  # 143: what a scheduler expects of a job it stopped
            report(prog, "stopped by SIGTERM" + what_now)
            raise SystemExit(128 + signal.SIGTERM) from None
        report(prog, "interrupted" + (f" ({said})" if said else "") + what_now)
        raise SystemExit(130) from None
    except BrokenPipeError:
        if debug_enabled() or not stdout_reader_gone():
            raise
        # `fabric-lin pretrain list | head -1`: what is left goes nowhere, as for a program ended by SIGPIPE (whose
        # exit code this is); the interpreter's last flush of stdout would otherwise fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(128 + signal.SIGPIPE) from None
    except Exception as e:
        from fabric_lin.errors import PeerLost, error_left_by_another_rank, leave_error_for_rank_0

        if isinstance(e, PeerLost) and not debug_enabled():
            left = error_left_by_another_rank() if process_rank() == 0 else None
            if left is not None:  # the peer ended on an error of its own, which no one else prints
                rank, line, exit_code = left
                print(f"{prog}: error on rank {rank}: {line}", file=sys.stderr, flush=True)
                raise SystemExit(exit_code) from None
            # from every rank that is left: rank 0, which speaks for the others, may be the one that is gone
            print(e.line(prog, process_rank()), file=sys.stderr, flush=True)
            raise SystemExit(PEER_LOST_EXIT_CODE) from None
        failure = anticipated_cause(e)
        if failure is not None:
            leave_error_for_rank_0(str(failure), 2)
        elif not isinstance(e, PeerLost):
            said = " ".join(str(e).split())[:300]
            leave_error_for_rank_0(f"{type(e).__name__}: {said} (a bug: its traceback is in rank {process_rank()}'s "
                                   f"output)", 1)
        if debug_enabled() or failure is None:
            raise
        report(prog, f"error: {failure}")
        raise SystemExit(2) from None


def end_process_of_several(exit_code: int) -> None:
    """The end of a command that ran as one process of several (a torch.distributed process group in this process):
    the process group destroyed (after success), the atexit functions run, stdout and stderr flushed, and the process
    ended with `exit_code` without the interpreter's finalization. Nothing where there is no process group.

    The process group cannot be freed here: torch's DTensor caches keep FSDP2's device mesh, and with it the group, for
    as long as the interpreter lives. Its gloo worker threads then run into the finalization, and one that drops a
    finished collective's tensors there must take the GIL to free their Python objects, which a finalizing interpreter
    answers by ending the thread (pthread_exit) inside a C++ destructor: "terminate called without an active
    exception", a SIGABRT after the run had saved everything. Ending the process as multiprocessing ends its children
    leaves those threads to the kernel. Lightning Fabric destroys the group at exit for NCCL only."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    import atexit

    # after success each process's own part of the group ends here (gloo's teardown is local); after an error a peer
    # may be gone, and NCCL's teardown could wait for it: the group is left to Fabric's atexit function
    if exit_code == 0:
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # Fabric's, logging's, multiprocessing's (DataLoader workers), temporary files'
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(exit_code)


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe that its reader has closed (a BrokenPipeError from anywhere else is a bug):
    the pipe then polls as an error."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() on this system, or stdout no file
        return False


def anticipated_cause(error: BaseException) -> Optional[BaseException]:
    """`error` if it is an anticipated failure, else the first one it was raised from (jsonargparse wraps
    the ValueError of a data module's own check in one of its own), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if expected_failure(error):
            return error
        seen.add(id(error))
        error = error.__cause__
    return None


def expand_home_in_paths() -> None:
    """A path that an argument, a config file or a data module's option gives (each typed Path) begins with the home
    directory where it begins with ~, as in a shell. A shell leaves `--out_dir=~/runs/a` and a config file's
    `out_dir: ~/runs/a` as they are: taken literally, a run's checkpoints would go into a directory named ~ under the
    current one, while its loggers (which expand ~ themselves) write into the home directory."""
    from jsonargparse.typing import register_type

    from fabric_lin.files import expand_home

    register_type(Path, str, expand_home, type_check=isinstance)


def print_model_names_or_config(names: List[str]) -> None:
    """`fabric-lin pretrain list`: the model names; `fabric-lin pretrain list NAME`: that model's whole config as YAML,
    to edit and give as `--model_config FILE` (a model_config given field by field, with no model named before it,
    starts from Config's defaults)."""
    import yaml

    from fabric_lin.config import Config, name_to_config
    from fabric_lin.errors import InvalidValue

    if not names:
        print("\n".join(name_to_config))
        return
    if len(names) > 1:
        raise InvalidValue(f"list takes one model name at the most, got {' '.join(names)}")
    print(yaml.safe_dump(Config.from_name(names[0]).to_dict(), sort_keys=False), end="")


def command_line_model_replaces_the_config_files(argv: List[str]) -> List[str]:
    """`argv` with the command line's choice of model replacing a --config file's: a recipe names its model by
    model_name (or model_config), and the other key given on the command line (`--config config_hub/gla_340M.yaml
    --model_config model.yaml`) would otherwise leave both set, which setup refuses. The file's key is set to null
    just before the command line's, so a --config given after it still names the model."""

    def first_given(option: str) -> Optional[int]:
        return next((i for i, arg in enumerate(argv) if arg == option or arg.startswith((option + "=", option + "."))), None)

    argv = model_config_fields_change_the_named_model(argv)
    name_at, config_at = first_given("--model_name"), first_given("--model_config")
    if (name_at is None) == (config_at is None):  # neither (the file's stands) or both (setup names the conflict)
        return argv
    at, replaced = (config_at, "--model_name") if name_at is None else (name_at, "--model_config")
    return argv[:at] + [f"{replaced}=null"] + argv[at:]


def model_config_fields_change_the_named_model(argv: List[str]) -> List[str]:
    """`--config config_hub/debug.yaml --model_config.hidden_size 256`: --model_config.* options change the model that
    the recipe names by model_name (or that --model_name names before them), each the one field it gives, as they
    change a model_config that a file gives: the named model's whole config is put before them as --model_config's
    value, and model_name is set to null. Alone, they would build Config's defaults (another model, another
    vocabulary) with those fields changed."""
    import json

    from fabric_lin.config import Config

    first = next((i for i, arg in enumerate(argv) if arg.startswith("--model_config.")), None)
    if first is None or option_values(argv[:first], "--model_config"):
        return argv  # no fields given, or they change a whole model_config given before them
    name = model_named_before(argv, first)
    if name is None:
        return argv
    named_model = json.dumps(Config.from_name(name).to_dict())
    return argv[:first] + ["--model_name=null", f"--model_config={named_model}"] + argv[first:]


def model_named_before(argv: List[str], at: int) -> Optional[str]:
    """The model_name in effect before `argv[at]`: that of the last --config file (or inline YAML) or --model_name that
    names the run's model; None where none does, or the last of them gives a whole model_config."""
    import yaml

    from fabric_lin.errors import UserError
    from fabric_lin.files import is_a, read_yaml

    named = None
    given = argv[:at]
    for i, arg in enumerate(given):
        option, equals, value = arg.partition("=")
        if not equals:
            value = given[i + 1] if i + 1 < len(given) else ""
        if option == "--model_name":
            named = None if value == "null" else value
        elif option == "--config":
            path = Path(value).expanduser()
            try:
                content = read_yaml(path) if is_a(path, "file") else yaml.safe_load(value)
            except (UserError, yaml.YAMLError):
                continue  # jsonargparse names what is wrong with it
            if isinstance(content, dict) and ("model_name" in content or "model_config" in content):
                named = None if content.get("model_config") is not None else content.get("model_name")
    return named


def data_options_change_the_run_s_data(argv: List[str]) -> List[str]:
    """`evaluate CHECKPOINT --data.num_workers 0`: --data.* options given without --data change the data module that
    the training checkpoint's hyperparameters.yaml records, each the one setting it names, as they change a --config
    file's data: the recorded module is put before them as --data's value. Alone, they would make a data module of
    their own, of those settings only."""
    import json

    from fabric_lin.checkpoint import HPARAMS_FILE
    from fabric_lin.checkpoint_kinds import read_hparams, run_data_entry
    from fabric_lin.errors import UserError

    first = next((i for i, arg in enumerate(argv) if arg.startswith("--data.") and not arg.startswith("--data.help")), None)
    if first is None or option_values(argv, "--data") or option_values(argv, "--config"):
        return argv
    checkpoint = positional_arguments(argv)[:1]
    hparams_path = Path(checkpoint[0]).expanduser() / HPARAMS_FILE if checkpoint else None
    if hparams_path is None or not hparams_path.is_file():
        return argv  # no run's data: the options need a data module, as evaluate says
    try:
        hparams = read_hparams(hparams_path)
    except UserError:
        return argv  # evaluate names what is wrong with the checkpoint
    return argv[:first] + [f"--data={json.dumps(run_data_entry(hparams, hparams_path))}"] + argv[first:]


def run(argv: List[str]) -> None:
    from jsonargparse import CLI, ArgumentParser, Namespace, set_parsing_settings

    class Parser(ArgumentParser):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("allow_abbrev", False)  # --train.max_step is not taken for --train.max_steps
            super().__init__(*args, **kwargs)

        def error(self, message, ex=None):
            from jsonargparse._common import debug_mode_active

            if not self.exit_on_error or debug_mode_active() or debug_enabled():
                try:
                    return super().error(message, ex)
                except Exception as raised:  # passed up to the parser that reports it, which no longer reads the file
                    raised.config_file = config_file_of(ex) or config_file_being_read()
                    raise
            parser = getattr(ex, "subcommand_parser", None) or self
            missing = missing_arguments(str(message), parser)
            parser, line = missing if missing else (parser, one_line_parse_error(str(message), parser, argv))
            prog = parser.prog.replace(" [options]", "")
            in_file = None if missing else config_file_of(ex) or config_file_being_read()
            if in_file is not None and in_file not in line:
                line += f" (in {in_file})"
            print(f"{prog}: error: {line}\n({prog} --help lists the options)", file=sys.stderr)
            raise SystemExit(2)

        def instantiate(self, cfg, *args, **kwargs):
            # jsonargparse takes any value for an option group's key in a config file (`train: 5`, or `train:` whose
            # keys are all commented out, a null) and fails on it with a TypeError of its own when it builds the group
            for key, (_, keys) in option_groups(self).items():
                value = cfg.get(key)
                if key in cfg and not isinstance(value, Namespace):
                    self.error(group_value_error(key, "null" if value is None else repr(value), keys)
                               + ("; to keep their defaults, leave the key out" if value is None else ""))
            check_no_variable_in_paths(cfg, argv)
            check_no_empty_paths(cfg, argv)
            command = cfg.get("subcommand")
            if command in COMMANDS:
                check_no_null_values(cfg, argv, load_command(command))
            return super().instantiate(cfg, *args, **kwargs)

    if len(argv) >= 2 and argv[1] == "list" and argv[0] in ("pretrain", "generate"):
        print_model_names_or_config(argv[2:])
        return
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    expand_home_in_paths()
    check_config_files(argv)
    if argv and argv[0] == "pretrain":
        argv = command_line_model_replaces_the_config_files(argv)
    if argv and argv[0] == "evaluate":
        argv = data_options_change_the_run_s_data(argv)
    if argv and argv[0] == "generate" and option_values(argv, "--prompt") and option_values(argv, "--prompt_file"):
        from fabric_lin.errors import InvalidValue  # generate itself cannot tell --prompt given as its default

        raise InvalidValue("--prompt and --prompt_file both give the prompt: give one of them")
    if "generate" in argv:  # also after a --config given before it
        check_sampling_values(argv)
        check_stop_strings(argv)
    if argv and argv[0] == "pretrain" and not option_values(argv, "--out_dir"):
        from fabric_lin.run_start import check_config_of_a_moved_run

        check_config_of_a_moved_run([Path(value).expanduser() for value in option_values(argv, "--config")])
    if argv and argv[0] in COMMANDS:
        components = {argv[0]: load_command(argv[0])}
    else:  # `fabric-lin --help` or an unknown subcommand: list every one that imports
        components = {}
        for name in COMMANDS:
            try:
                components[name] = load_command(name)
            except (ImportError, AttributeError):
                pass
    CLI(
        components, args=argv, as_positional=True, parser_class=Parser, prog="fabric-lin",
        description=f"Pretrain linear-attention language models. {DEBUG_ENV}=1 shows the traceback of an error.",
    )


if __name__ == "__main__":
    main()
