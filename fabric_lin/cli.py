"""The `fabric-lin` command: one subcommand per job, each a plain function whose signature is its
command line (jsonargparse turns typed arguments into flags and YAML keys)."""
import importlib
import sys
from typing import Callable, Dict

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
