"""The YAML files of a `fabric-lin` command line (`--config FILE`, a group's or a class key's file: `--optimizer
opt.yaml`, `--model_config model.yaml`): read before jsonargparse reads them, for the errors its own messages leave
unnamed, after it refused one of their keys or values, to name the file that holds it, and after it took their values,
for those it lets through unchecked (null, `$VARIABLE` in a path)."""
import importlib
import os
import re
from pathlib import Path
from typing import Any, List, Optional, Tuple


def option_values(argv: List[str], option: str) -> List[str]:
    """The values given to `option` on the command line (`--option VALUE` or `--option=VALUE`), in order."""
    return [value if arg == option else arg[len(option) + 1:]
            for arg, value in zip(argv, argv[1:] + [""]) if arg == option or arg.startswith(option + "=")]


def positional_arguments(argv: List[str]) -> List[str]:
    """The words of a subcommand's command line `argv` (its name first) that are its arguments: every option of a
    fabric-lin command takes one value (`--name value` or `--name=value`), but --help."""
    words, rest = [], argv[1:]
    while rest:
        word, rest = rest[0], rest[1:]
        if not word.startswith("-"):
            words.append(word)
        elif "=" not in word and word not in ("--help", "-h"):
            rest = rest[1:]  # the option's value
    return words


def check_config_files(argv: List[str]) -> None:
    """Each `--config FILE` and `--model_config FILE` read before jsonargparse reads it: its own messages for a file
    that is not YAML, is empty or holds a list name no file ("<unicode string>", "Unexpected config"), and it keeps
    the last of a key given twice without a word."""
    from fabric_lin.config import CONFIG_FILE
    from fabric_lin.errors import InvalidValue, MissingFile
    from fabric_lin.files import is_a, read_yaml

    for value in option_values(argv, "--model_config"):
        path = Path(value).expanduser()
        if is_a(path, "file"):
            read_yaml(path)
        elif is_a(path, "dir"):
            has_config = (path / CONFIG_FILE).is_file()
            raise InvalidValue(f"--model_config {value} is a directory: "
                               + (f"give its {CONFIG_FILE}, {path / CONFIG_FILE}" if has_config else "expected a YAML file"))
        elif value.endswith((".yaml", ".yml")) or (os.sep in value and not value.lstrip().startswith("{")):  # a path
            raise MissingFile(f"--model_config {value} does not exist: expected a YAML file of the model's fields "
                              f"(`fabric-lin pretrain list NAME > model.yaml` writes one to edit)")
    for value in option_values(argv, "--config"):
        if not is_a(Path(value).expanduser(), "file"):  # inline YAML, or a path that jsonargparse says is missing
            continue
        content = read_yaml(Path(value).expanduser())
        if not isinstance(content, dict):
            what = "nothing" if content is None else f"a {type(content).__name__}"
            raise InvalidValue(f"--config {value} holds {what}: expected YAML keys and their values, as in config_hub/debug.yaml")


def config_file_being_read() -> Optional[str]:
    """The YAML file jsonargparse is reading (a --config file, a --model_config file or one that a file names), where a
    value it refuses comes from one: as given where the command line gave it, else its absolute path. jsonargparse's
    own messages name the key and the value only; its stack of files being read is no public API, so where it is not
    there (another version) no file is named."""
    try:
        files = importlib.import_module("jsonargparse._util").config_load_stack.get()
    except (ImportError, AttributeError):
        return None
    if not files:
        return None
    absolute, as_given = files[-1]
    return as_given if len(files) == 1 else absolute


def config_file_of(error: Optional[BaseException]) -> Optional[str]:
    """The file that a refusal of a nested parser (a class key's own keys: model_config's) was read from, carried by
    the errors that jsonargparse raises from it."""
    while error is not None:
        if getattr(error, "config_file", None) is not None:
            return error.config_file
        error = error.__cause__ or error.__context__
    return None


def generate_config_values(argv: List[str], key: str) -> List[Tuple[Any, str, bool]]:
    """generate's `key` as each --config of the command line `argv` gives it (a file or inline YAML; one before the
    subcommand under `generate:`), also one that a later one replaces: (the value as YAML reads it, the --config value,
    whether that is a file). A --config that is not YAML gives none: jsonargparse names what is wrong with it."""
    import yaml

    from fabric_lin.errors import UserError
    from fabric_lin.files import is_a, read_yaml

    at = subcommand_at(argv, "generate")
    found = []
    for before, value in [(True, value) for value in option_values(argv[:at], "--config")] + [
            (False, value) for value in option_values(argv[at + 1:], "--config")]:
        path = Path(value).expanduser()
        try:
            content = read_yaml(path) if is_a(path, "file") else yaml.safe_load(value)
        except (UserError, yaml.YAMLError):
            continue
        if before:
            content = content.get("generate") if isinstance(content, dict) else None
        if isinstance(content, dict) and key in content:
            found.append((content[key], value, is_a(path, "file")))
    return found


def check_sampling_values(argv: List[str]) -> None:
    """generate's temperatures and top_p refused as generate refuses them, before jsonargparse reads them: it takes no
    inf or nan for a float and says only "expected float" (argparse takes -inf for an option), while a file's `.inf` or
    -1 reached generate, which named the option. Each --temperature and --top_p value and the value of each --config (a
    file, named in the error, or inline YAML), each as jsonargparse reads it."""
    from fabric_lin.errors import InvalidValue
    from fabric_lin.generate import check_generation_args

    def check(key: str, value: float, option_prefix: str) -> None:
        check_generation_args(0, value if key == "temperature" else 1.0, None, option_prefix,
                              top_p=value if key == "top_p" else 1.0)

    for key in ("temperature", "top_p"):
        for value in option_values(argv[subcommand_at(argv, "generate") + 1:], f"--{key}"):
            try:
                number = float(value)
            except ValueError:
                continue  # not a number: jsonargparse says so
            check(key, number, "--")
        for given, value, is_file in generate_config_values(argv, key):
            if isinstance(given, bool) or not isinstance(given, (int, float, str)):
                continue  # none given, or no number: jsonargparse says so
            try:
                number = float(given)
            except ValueError:
                continue  # a word that is no number: jsonargparse says so
            try:
                check(key, number, "")
            except InvalidValue as refused:
                raise InvalidValue(f"{refused} (in {value})" if is_file else str(refused)) from None


def one_plain_item(value: str) -> Optional[str]:
    """The item of `value` where it is YAML's list of one string written without quotes (`[END]`, `[/INST]`), which
    jsonargparse reads as that list, where a stop string may well be the bracketed text itself; else None."""
    import yaml

    try:
        items = yaml.safe_load(value)
    except yaml.YAMLError:
        return None
    if isinstance(items, list) and len(items) == 1 and isinstance(items[0], str) and not re.search("[\"']", value):
        return items[0]
    return None


def check_stop_strings(argv: List[str]) -> None:
    """generate's --stop of one plain item in brackets (`--stop '[END]'`, and `stop: '[END]'`, text in a YAML file),
    which jsonargparse reads as a list of that one stop string, refused with how to give either: the text in brackets,
    or the item. A list of several (`[a, b]`) is a list; so is a YAML list (`stop: [END]`)."""
    from fabric_lin.errors import InvalidValue

    for value in option_values(argv[subcommand_at(argv, "generate") + 1:], "--stop"):
        item = one_plain_item(value)
        if item is not None:
            raise InvalidValue(f"--stop {value} reads as a list of one stop string, {item}: to stop at the text "
                               f"{value.strip()}, give it quoted in a list, --stop '[\"{value.strip()}\"]'; to stop at "
                               f"{item}, --stop {item}")
    for given, value, is_file in generate_config_values(argv, "stop"):
        item = one_plain_item(given) if isinstance(given, str) else None
        if item is not None:
            raise InvalidValue(f"stop: '{given}'{f' (in {value})' if is_file else ''} reads as a list of one stop "
                               f"string, {item}: to stop at the text {given.strip()}, write it quoted in a list, "
                               f"stop: ['{given.strip()}']; to stop at {item}, stop: {item}")


def subcommand_at(argv: List[str], command: str) -> int:
    """Where the subcommand `command` is named on the command line `argv` (after the top-level options, as
    `--config global.yaml`), len(argv) where it is not."""
    return next((i for i, arg in enumerate(argv) if arg == command and (i == 0 or argv[i - 1] != "--config")), len(argv))


def files_holding_key(key: str, command: str, argv: List[str]) -> List[str]:
    """The YAML files of the command line `argv` that give `key`, a key of the top-level parser (`pretrain.trian`: the
    subcommand `command`'s own keys under its name), each named as the command line gives it: a --config file before
    the subcommand (its keys under the subcommand's name), the subcommand's --config files, an option given a file
    (`--optimizer opt.yaml` gives optimizer's keys), and the files that these name in a key's place. jsonargparse
    checks the keys once it has merged every file's, and names none; [] where no file gives the key (it came from
    the command line: `--optimizer '{bogus: 1}'`)."""
    from fabric_lin.files import is_a

    at = subcommand_at(argv, command)
    sources = [("", value) for value in option_values(argv[:at], "--config")]
    for arg, following in zip(argv[at + 1:], argv[at + 2:] + [""]):
        option, equals, value = arg.partition("=")
        if option.startswith("--"):
            sources.append((f"{command}." if option == "--config" else f"{command}.{option[2:]}.", value if equals else following))
    found = []
    for prefix, value in sources:
        path = Path(value).expanduser()
        holder = yaml_file_holding(path, key[len(prefix):], value) if key.startswith(prefix) and is_a(path, "file") else None
        if holder is not None and holder not in found:
            found.append(holder)
    return found


def yaml_file_holding(path: Path, key: str, name: str) -> Optional[str]:
    """`name` (the YAML file `path`) if the file gives `key` (nested, `train: {max_steps: ..}`, or dotted,
    `train.max_steps:`); the name of a file that it gives in the place of a part of the key (`optimizer: opt.yaml`,
    read from the directory of the file naming it, as jsonargparse reads it) if that file gives the rest; else None."""
    from fabric_lin.errors import UserError
    from fabric_lin.files import is_a, read_yaml

    try:
        content = read_yaml(path)
    except UserError:  # not YAML: jsonargparse refused it before any key
        return None
    while isinstance(content, dict):
        if key in content:
            return name
        # the first part of the key that the mapping gives; the key is shorter at each step, so files naming each
        # other end too
        given = next((part for part in content if isinstance(part, str) and key.startswith(part + ".")), None)
        if given is None:
            return None
        content, key = content[given], key[len(given) + 1:]
        if isinstance(content, str) and is_a(path.parent / Path(content).expanduser(), "file"):
            return yaml_file_holding(path.parent / Path(content).expanduser(), key, str(Path(name).parent / content))
    return None


def option_name(key: str, command: Optional[str]) -> str:
    """A parsed value's key as its option is written: `pretrain.data.init_args.data_path` -> `data.data_path`."""
    return key.removeprefix(f"{command}.").replace(".init_args.", ".")


ENVIRONMENT_VARIABLE = re.compile(r"\$(\w+|\{\w+\})")


def check_no_variable_in_paths(cfg, argv: List[str]) -> None:
    """Refuse a path that names an environment variable (`out_dir: $SCRATCH/runs/a`, `${HOME}/data`): a shell expands
    one on the command line, but nothing does in a config file or in quotes, and taken as it is a run's checkpoints
    would go into a directory named `$SCRATCH` under the current one. `cfg`: the command's parsed values, under the
    subcommand's name (`pretrain.out_dir`); the key, its value and the file giving it are named."""
    from fabric_lin.errors import InvalidValue

    command = cfg.get("subcommand") if hasattr(cfg, "get") else None
    for key, value in cfg.items():
        for path in value if isinstance(value, (list, tuple)) else [value]:
            found = ENVIRONMENT_VARIABLE.search(str(path)) if isinstance(path, Path) else None
            if found is None:
                continue
            shown = option_name(key, command)
            given_on_the_command_line = bool(option_values(argv, f"--{shown}"))
            files = files_holding_key(key, command, argv) if command and not given_on_the_command_line else []
            raise InvalidValue(
                f"{shown}: {path} names the environment variable {found.group(0)}, which a config file's (or a quoted) "
                f"value does not expand: the path would be a directory named {found.group(0)} under the current one; "
                f"write the path out, or give it on the command line, where the shell expands it"
                + (f" (in {', '.join(files)})" if files else "")
            )


def check_no_empty_paths(cfg, argv: List[str]) -> None:
    """Refuse a path given on the command line as an empty word (`--output_dir "$OUT"` with OUT unset): Path("") is
    the current directory, where a converter with --overwrite true would write (and remove) a model's files. `cfg`:
    the command's parsed values, under the subcommand's name; a path written "." is taken as it is."""
    from fabric_lin.errors import InvalidValue

    command = cfg.get("subcommand") if hasattr(cfg, "get") else None
    empty_positional = "" in positional_arguments(argv)
    for key, value in cfg.items():
        if not (isinstance(value, Path) and str(value) == "."):
            continue
        shown = option_name(key, command)
        given = option_values(argv, f"--{shown}")
        if "" in given or (not given and empty_positional):
            raise InvalidValue(f"{shown}: an empty path (an unset shell variable, as in \"$OUT\"?) would be the current "
                               f"directory; give the path, or . for the current directory")


def check_no_null_values(cfg, argv: List[str], function) -> None:
    """Refuse a config file's key left empty or given null (`seed:`, `out_dir:`, `optimizer: {lr: }`) where the option
    takes no null: jsonargparse checks the type of a file's values but lets null through as "not set", and the command
    then met it as its value, to fail on it with a TypeError far from the file (`None < 1`), or to read null as false
    or nothing (`eval.final_validation:`, `text_key:`). `cfg`: the command's parsed values, under the subcommand's name;
    `function`: the command's; the key, what it takes and the file giving it are named."""
    import dataclasses
    import inspect

    from fabric_lin.errors import InvalidValue

    command = cfg.get("subcommand") if hasattr(cfg, "get") else None
    if command is None:
        return
    for name, parameter in inspect.signature(function).parameters.items():
        annotation = type_hints(function).get(name, parameter.annotation)
        options = [(name, annotation, parameter.default)]
        if dataclasses.is_dataclass(annotation) and dataclasses.is_dataclass(parameter.default):  # an option group
            hints = type_hints(annotation)
            options = [(f"{name}.{field.name}", hints.get(field.name, field.type), getattr(parameter.default, field.name))
                       for field in dataclasses.fields(annotation) if field.init]
        for key, kind, default in options:
            if cfg.get(f"{command}.{key}", "unset") is not None or default is None or takes_null(kind):
                continue
            files = files_holding_key(f"{command}.{key}", command, argv)
            keeps = "" if default is inspect.Parameter.empty else f", or leave the key out for its default ({shown(default)})"
            raise InvalidValue(f"{key}: got null, expected {described(kind)}: give a value{keeps}"
                               + (f" (in {', '.join(files)})" if files else ""))


def type_hints(obj) -> dict:
    """The type hints of a function or class, their names resolved; {} where one names what cannot be imported."""
    import typing

    try:
        return typing.get_type_hints(obj)
    except Exception:  # a name imported for type checkers alone: its option is not looked into
        return {}


def takes_null(kind) -> bool:
    import typing

    if kind is typing.Any or kind is type(None) or kind is None or isinstance(kind, str):  # str: an unresolved hint
        return True
    return typing.get_origin(kind) is typing.Union and type(None) in typing.get_args(kind)


def described(kind) -> str:
    """A type as the one-line errors say what a key takes: int, a path, true or false, 'auto'."""
    import typing
    from pathlib import PurePath

    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Union:
        return " or ".join(described(arg) for arg in args)
    if origin is typing.Literal:
        return " or ".join(repr(arg) for arg in args)
    if origin in (list, tuple):
        return "a list"
    if kind is bool:
        return "true or false"
    if isinstance(kind, type) and issubclass(kind, PurePath):
        return "a path"
    return getattr(kind, "__name__", str(kind))


def shown(value) -> str:
    """A default value as YAML writes it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(shown, value)) + "]"
    return str(value)
