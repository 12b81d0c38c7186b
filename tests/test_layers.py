"""The floors of the package: a module imports only modules of its own floor or of the floors below, and no
import circle runs between modules. Every import counts, also one inside a function. README.md's "Where things
live" shows the same floors."""
import ast
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parents[1]

# lowest first; a name stands for the module and every module under it (the longest name that fits wins)
FLOORS = [
    # helpers that know nothing of models or data
    ["fabric_lin.files", "fabric_lin.errors", "fabric_lin.args", "fabric_lin.lr_schedule", "fabric_lin.stopping",
     "fabric_lin.batches", "fabric_lin.fp8", "fabric_lin.cpu_cores", "fabric_lin.parallelism"],
    # the kernels and their references
    ["fabric_lin.ops"],
    # the model: its configuration, the network, its weights on disk, its FLOPs, its first step's kernels compiled
    ["fabric_lin.config"],
    ["fabric_lin.model", "fabric_lin.flops"],
    ["fabric_lin.weights", "fabric_lin.precompile"],
    # data: tokenizer, raw files, the recipes that tokenize them, prepared directories, the training stream, the data
    # modules, the sample corpus and the long-document corpus
    ["fabric_lin.data"],
    # a run's files: checkpoints (whole or sharded), metrics, model directories
    ["fabric_lin.sharded_checkpoint", "fabric_lin.model_bytes", "fabric_lin.metrics", "fabric_lin.save_failures"],
    ["fabric_lin.checkpoint"],
    ["fabric_lin.convert.model_dir", "fabric_lin.run_identity", "fabric_lin.run_start", "fabric_lin.rendezvous"],
    # the model a training run trains and its optimizer, as Fabric sets them up
    ["fabric_lin.model_setup"],
    # the jobs
    ["fabric_lin.convert", "fabric_lin.generate", "fabric_lin.evaluate", "fabric_lin.harness", "fabric_lin.checkpoint_kinds"],
    ["fabric_lin.pretrain"],
    # the preprocessing commands (fabric_lin imports none of them: the command line names them by module path)
    ["data_prep"],
    ["fabric_lin.cli", "fabric_lin.cli_config_files", "fabric_lin"],
]


def package_modules() -> Dict[str, Path]:
    modules = {}
    for package in ("fabric_lin", "data_prep"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path
    return modules


def imports(path: Path, modules: Dict[str, Path]) -> Set[str]:
    """The package's modules that the file imports (`from a.b import c` counts as a.b.c where that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def floor_of(module: str) -> int:
    best, floor = "", None
    for level, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, floor = name, level
    assert floor is not None, f"{module} is on no floor: add it to FLOORS in {Path(__file__).name}"
    return floor


def import_graph() -> Dict[str, Set[str]]:
    modules = package_modules()
    return {name: imports(path, modules) - {name} for name, path in modules.items()}


def test_every_import_stays_on_its_floor_or_goes_down():
    upward = [f"{module} (floor {floor_of(module)}) imports {target} (floor {floor_of(target)})"
              for module, targets in sorted(import_graph().items()) for target in sorted(targets)
              if floor_of(target) > floor_of(module)]
    assert not upward, "\n".join(upward)


def circles(graph: Dict[str, Set[str]]) -> List[str]:
    """Each import circle met in a depth-first walk of `graph`, as "a -> b -> a"."""
    state: Dict[str, int] = defaultdict(int)  # 0 unseen, 1 on the path, 2 done
    found = []

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state[target] == 1:
                found.append(" -> ".join(path[path.index(target):] + [target]))
            elif state[target] == 0:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if state[module] == 0:
            visit(module, [module])
    return found


def test_no_import_circle():
    found = circles(import_graph())
    assert not found, "\n".join(found)


def test_the_check_finds_an_upward_import_and_a_circle(tmp_path):
    """The checks themselves: an import from the model up to the loop is reported, and so is a circle."""
    modules = {"fabric_lin.model": tmp_path / "model.py", "fabric_lin.pretrain": tmp_path / "pretrain.py"}
    modules["fabric_lin.model"].write_text("def f():\n    from fabric_lin.pretrain import setup\n")
    modules["fabric_lin.pretrain"].write_text("from fabric_lin import model\n")
    assert imports(modules["fabric_lin.model"], modules) == {"fabric_lin.pretrain"}
    assert imports(modules["fabric_lin.pretrain"], modules) == {"fabric_lin.model"}
    assert floor_of("fabric_lin.pretrain") > floor_of("fabric_lin.model")
    assert floor_of("fabric_lin.ops.gla.chunk") == floor_of("fabric_lin.ops")
    graph = {name: imports(path, modules) for name, path in modules.items()}
    assert circles(graph) == ["fabric_lin.model -> fabric_lin.pretrain -> fabric_lin.model"]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
