"""Writing a command's outputs: whole files, renamed into place, with the mode any new file gets; and
output directories that a failed command removes again when it wrote nothing into them."""
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Union


def default_file_mode() -> int:
    """The mode `open(path, "w")` gives a new file: 0o666 less the process's umask (0o644 under umask 022)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    # os.umask can only be read by setting it; /proc answers on Linux without that
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write(path: Union[str, Path], write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)` and rename the result to `path`, so a reader never sees half a file. The
    file gets the usual mode (safetensors, like mkstemp, creates its files readable by the owner alone)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        write(str(tmp))
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def copy_file(src: Union[str, Path], dst: Union[str, Path]) -> Path:
    """Copy the contents of `src` to `dst` atomically, as a new file of the usual mode (not `src`'s)."""
    atomic_write(dst, lambda tmp: shutil.copyfile(src, tmp))
    return Path(dst)


def missing_ancestors(path: Union[str, Path]) -> List[Path]:
    """`path` and those of its parents that do not exist yet, deepest first: what `mkdir -p path` creates."""
    path = Path(os.path.abspath(path))
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def remove_empty_dirs(created: List[Path]) -> None:
    """Remove the directories in `created` (deepest first) that hold no file, with their empty subdirectories."""
    for directory in created:
        if not directory.is_dir() or any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):
            return  # it, and so every directory above it, keeps something
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def created_dir(path: Union[str, Path]) -> Iterator[Path]:
    """Create `path` (with its parents); if the block raises, remove what this created, unless a file was
    written there: a failed command leaves no empty output directories behind."""
    created = missing_ancestors(path)
    Path(path).mkdir(parents=True, exist_ok=True)
    try:
        yield Path(path)
    except BaseException:
        remove_empty_dirs(created)
        raise


@contextmanager
def environment_variables(values: Dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set within the block (the directories a library or a child process is to use);
    afterwards each variable as it was before, or absent again."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
