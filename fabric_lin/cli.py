"""The `fabric-lin` command: one subcommand per job, each a plain function whose signature is its
command line (jsonargparse turns typed arguments into flags and YAML keys)."""
import importlib
import sys
from typing import Callable, Dict, List, Optional

# subcommand -> "module:function". A module is imported only when its subcommand runs (or for --help).
COMMANDS: Dict[str, str] = {
    "pretrain": "fabric_lin.pretrain:setup",
    "generate": "fabric_lin.generate:main",
    "train_tokenizer": "fabric_lin.data.train_tokenizer:main",
    "prepare_slimpajama": "data_prep.prepare_slimpajama:prepare",
    "prepare_starcoder": "data_prep.prepare_starcoder:prepare",
    "convert_pretrained_checkpoint": "fabric_lin.convert.pretrained_checkpoint:convert_pretrained_checkpoint",
    "convert_to_hf": "fabric_lin.convert.hf:convert_to_hf",
    "convert_from_hf": "fabric_lin.convert.hf:convert_from_hf",
    "convert_from_llama": "fabric_lin.convert.from_llama:convert_from_llama",
}


def load_command(name: str) -> Callable:
    module_name, function_name = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module_name), function_name)


def valid_keys_hint(message: str) -> str:
    """jsonargparse names an unknown key inside a nested class (`model_config:`, `data.init_args:`) but not
    the keys the class accepts: add them."""
    import dataclasses
    import inspect
    import re

    hints = []
    for class_path, key in re.findall(r"class_path '([\w.]+)':\s*Option '(\w+)' is not accepted", message):
        module_name, _, class_name = class_path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError, ValueError):
            continue
        if dataclasses.is_dataclass(cls):
            valid = [f.name for f in dataclasses.fields(cls) if f.init]
        else:
            valid = [n for n in inspect.signature(cls).parameters if n not in ("self", "args", "kwargs")]
        hints.append(f"{class_path} has no option {key!r}; valid options are: {', '.join(valid)}")
    return message + "".join(f"\n  {hint}" for hint in hints)


def renamed_keys_message(argv: List[str], renamed: Dict[str, str]) -> Optional[str]:
    """One line naming the new key of each old key in `argv` (`--old value`, `--old=value`) or at the top
    of a `--config` file given there; None when there is none. An old key that is now the name of a
    group (`compile`) is old only with the values it had (true, false, null), not with a mapping or a file."""
    import yaml

    def is_old(key: str, value) -> bool:
        if renamed.get(key, "").startswith(key + "."):  # a group now: its old values were true, false, null
            return value is None or isinstance(value, bool)
        return key in renamed

    found = []  # (where, key)
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if key == "config":
            try:
                with open(value, encoding="utf-8") as f:
                    content = yaml.safe_load(f)
            except (OSError, yaml.YAMLError):
                continue  # jsonargparse reports an unreadable config file
            if isinstance(content, dict):
                found += [(value, k) for k, v in content.items() if is_old(k, v)]
            continue
        if key in renamed:
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError:
                pass
            if is_old(key, value):
                found.append((None, key))
    parts = []
    for where in dict.fromkeys(where for where, _ in found):  # the command line or a config file, in argv's order
        renames = ", ".join(f"{key} is now {renamed[key]}" for w, key in found if w == where)
        parts.append(f"{where}: {renames}" if where else renames)
    return "; ".join(parts) or None


def main(argv=None) -> None:
    from jsonargparse import CLI, ArgumentParser, set_parsing_settings

    class Parser(ArgumentParser):
        def error(self, message, *args, **kwargs):
            return super().error(valid_keys_hint(str(message)), *args, **kwargs)

    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[1] == "list" and argv[0] in ("pretrain", "generate"):
        from fabric_lin.config import name_to_config

        print("\n".join(name_to_config))
        return
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    if argv and argv[0] in COMMANDS:
        components = {argv[0]: load_command(argv[0])}
        renamed = getattr(importlib.import_module(components[argv[0]].__module__), "RENAMED_KEYS", {})
        message = renamed_keys_message(argv[1:], renamed)
        if message:
            print(f"fabric-lin {argv[0]}: error: {message}", file=sys.stderr)
            raise SystemExit(2)
    else:  # `fabric-lin --help` or an unknown subcommand: list every one that imports
        components = {}
        for name in COMMANDS:
            try:
                components[name] = load_command(name)
            except (ImportError, AttributeError):
                pass
    CLI(components, args=argv, as_positional=True, parser_class=Parser)


if __name__ == "__main__":
    main()
