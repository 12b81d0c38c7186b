"""Reading the files a user gives (a path's leading ~ is the home directory, `expand_home`), where a file that cannot
be parsed is one error naming it (`reading`, `read_yaml`, `read_json`; a Git LFS pointer in its place is named as
one); writing a command's outputs: whole files, renamed into place, with the mode any new file gets; output
directories that a failed command removes again when it wrote nothing into them, and none inside a directory that owns
every file in it (a training checkpoint, prepared data), told by the file that marks it."""
import json
import os
import re
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Type, Union

from fabric_lin.errors import AlreadyExists, InvalidValue

DAMAGED_FILE_FIX = "it may be truncated or damaged (an interrupted copy or download): copy or write it again"
# What a Git LFS pointer file starts with; a pointer is less than this many bytes (the LFS specification)
LFS_POINTER_START = b"version https://git-lfs.github.com/spec/v1\n"
LFS_POINTER_MAX_BYTES = 1024
LFS_POINTER_FIX = "fetch it with `git lfs pull` in its clone (after `git lfs install`)"
# the directories that own every file in them, told by a file of their own: a training checkpoint (what pretrain writes
# beside its weights) and prepared data (litdata's index of its chunks)
STEP_FILE = "step.json"
MANIFEST_FILE = "manifest.json"
INDEX_FILE = "index.json"
# the name of a file that atomic_write is writing, until it is renamed to its own: one a kill left is part-written
PART_WRITTEN_PREFIX = ".tmp-"


def is_lfs_pointer(path: Union[str, Path]) -> bool:
    """Whether the file `path` is a Git LFS pointer: what a clone made without Git LFS holds in place of each large
    file (a dataset's shards, a model's weights or tokenizer.model on the Hugging Face hub)."""
    try:
        with open(path, "rb") as f:
            start = f.read(LFS_POINTER_MAX_BYTES)
    except OSError:
        return False
    return start.startswith(LFS_POINTER_START) and len(start) < LFS_POINTER_MAX_BYTES


@contextmanager
def reading(path: Union[str, Path], what: str, *parse_errors: Type[BaseException], fix: str = DAMAGED_FILE_FIX
            ) -> Iterator[None]:
    """Within the block, a reader's failure to parse the user's file `path` (one of `parse_errors`) becomes one
    InvalidValue line naming the file, what it should be and the reader's own first sentence, then `fix`: a file
    cut short or garbled is a mistake in what was given, not a bug, wherever it is read. A file system error
    that names its file (no permission, no space) stays what it is."""
    try:
        yield
    except parse_errors as error:
        if isinstance(error, OSError) and error.filename:
            raise
        if is_lfs_pointer(path):
            raise InvalidValue(f"{path} is a Git LFS pointer, not the file's content: {LFS_POINTER_FIX}") from None
        mark = getattr(error, "problem_mark", None)  # a YAML parser's place in the file
        if mark is not None and getattr(error, "problem", None):
            detail = f"{error.problem} at line {mark.line + 1}, column {mark.column + 1}"
        else:
            detail = " ".join(str(error).split()).split(". ")[0][:300] or type(error).__name__
        raise InvalidValue(f"{path} cannot be read as {what}: {detail}; {fix}") from None


def read_yaml(path: Union[str, Path]) -> Any:
    """The YAML document in the file `path` (None for an empty file). A mapping that gives a key twice is refused:
    PyYAML keeps the last one without a word, so the edit of a recipe's `max_steps:` would be overridden by another
    `max_steps:` further down."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            first_line = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`, whose keys the mapping's own replace
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, (str, int, float, bool, type(None))):
                    continue  # an unhashable key: the SafeLoader's own error names it
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        problem=f"a second {key!r} key (the first is at line {first_line[key] + 1}; keep one)",
                        problem_mark=key_node.start_mark)
                first_line[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    with reading(path, "YAML", yaml.YAMLError, UnicodeDecodeError, fix="correct the file, or write it again"):
        return yaml.load(Path(path).read_text(encoding="utf-8"), Loader=UniqueKeyLoader)


@contextmanager
def files_taken_back_on_failure(directory: Path) -> Iterator[None]:
    """Within the block, the files of one whole (a model, a tokenizer) are written into `directory`; if it fails (a full
    disk, Ctrl-C), the files it added are removed again, so that no part of it is left to be taken for the whole."""
    there_before = set(Path(directory).iterdir())
    try:
        yield
    except BaseException:
        for path in set(Path(directory).iterdir()) - there_before:
            path.unlink()
        raise


def is_a(path: Path, kind: str) -> bool:
    """Whether `path` is a "file" or a "dir"; False for a value no file system takes as a name, as inline YAML or JSON
    longer than a file name may be (where pathlib's checks fail with "File name too long")."""
    try:
        return path.is_file() if kind == "file" else path.is_dir()
    except OSError:
        return False


def read_json(path: Union[str, Path]) -> dict:
    """The JSON object in the file `path`."""
    with reading(path, "JSON", json.JSONDecodeError, UnicodeDecodeError, fix="correct the file, or write it again"):
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise InvalidValue(f"{path}: expected a JSON object, got {json_type(data)}")
    return data


def json_type(value) -> str:
    """The JSON name of the type of `value`, as json.loads returns it (the file holds JSON, not Python)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # before the numbers: a bool is an int
        return "boolean"
    return {str: "string", list: "array", dict: "object"}.get(type(value), "number")


def expand_home(path: Union[str, Path]) -> Path:
    """`path` with a leading ~ (or ~user) replaced by that home directory, as a shell does for a word it expands: a
    shell leaves `--out_dir=~/runs/a`, a quoted path and a config file's value as they are."""
    return Path(os.path.expanduser(path))


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


@contextmanager
def naming_the_file(path: Union[str, Path]) -> Iterator[None]:
    """Within: an OSError that names no file names `path`, the file being written. Python reports a write that finds
    the disk full (or a quota reached) naming no file, and a file system's error is one line where it names its file."""
    try:
        yield
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror, str(path)) from error


def write_error(directory: Path, probe_bytes: int = 1 << 20) -> Optional[OSError]:
    """The error the file system gives a write of `probe_bytes` into `directory` (a file written and removed), or None
    where it takes them. torch.save writes through C++ and its RuntimeError for a failed write carries no OSError:
    writing again is how to learn it. (Saving into a Python file object would keep the OSError, but a Ctrl-C inside
    that object's write would then surface as torch's RuntimeError, not as the KeyboardInterrupt that a second Ctrl-C
    must be.)"""
    probe = Path(directory) / f".tmp-write-test-{os.getpid()}"  # .tmp-: a name that nothing reads as a checkpoint
    try:
        with open(probe, "ab") as file:
            file.write(bytes(probe_bytes))
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        return error
    finally:
        with suppress(OSError):
            probe.unlink()
    return None


def refused_write(error: Exception, directory: Path) -> Optional[OSError]:
    """The file system's error behind a writer's failure to write into `directory`, where the writer reports it as an
    error of its own that carries no OSError; None where it was no refusal of the file system. safetensors (Rust) names
    the OS error's number in its message (its failed write leaves no room taken that a second write would meet);
    torch.save's zip writer (C++) raises a RuntimeError about file positions, and leaves the part written taking its
    room, so a second write tells the file system's."""
    number = re.search(r"\(os error (\d+)\)", str(error))
    if number is not None:
        return OSError(int(number.group(1)), os.strerror(int(number.group(1))))
    return write_error(directory) if isinstance(error, RuntimeError) else None


def atomic_write(path: Union[str, Path], write: Callable[[str], object]) -> None:
    """Call `write(tmp_path)` and rename the result to `path`, so a reader never sees half a file. The
    file gets the usual mode (safetensors, like mkstemp, creates its files readable by the owner alone). A write
    that the file system refuses (no space left, a quota reached) fails with its OSError, naming `path`."""
    path = Path(path)
    tmp = path.with_name(f"{PART_WRITTEN_PREFIX}{path.name}")
    try:
        with naming_the_file(path):
            try:
                write(str(tmp))
            except OSError:
                raise
            except Exception as error:
                refused = refused_write(error, path.parent)
                if refused is None:
                    raise
                raise OSError(refused.errno, refused.strerror, str(path)) from error
        os.chmod(tmp, default_file_mode())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def sync_to_disk(path: Union[str, Path]) -> None:
    """Return once the file or directory `path` is on the disk (fsync), not in the page cache alone: a file whose other
    copy is to be deleted next, or a directory whose renames must survive a power cut."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def copy_file(src: Union[str, Path], dst: Union[str, Path]) -> Path:
    """Copy the contents of `src` to `dst` atomically, as a new file of the usual mode (not `src`'s)."""
    atomic_write(dst, lambda tmp: shutil.copyfile(src, tmp))
    return Path(dst)


def file_in_the_way(path: Union[str, Path]) -> Optional[Path]:
    """The file that keeps a directory from being made at `path`: `path` itself, or the nearest of its parents that
    exists, where that is not a directory; None where nothing is in the way."""
    for place in [Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents]:
        if place.exists():
            return None if place.is_dir() else place
    return None


def check_dir_can_be_made(path: Union[str, Path], named: str = "directory") -> None:
    """Refuse, before any work, a directory to write (`named` as the user gave it: "--output_dir") that a file is in
    the way of, or that cannot be made or written in (its nearest existing directory is not writable): found at the
    end, it would cost the work done (a tokenizer trained, a model's weights read)."""
    blocking = file_in_the_way(path)
    if blocking is not None:
        raise InvalidValue(f"{named} {path}: {blocking} is a file, expected a directory or nothing there")
    nearest = next(place for place in [Path(os.path.abspath(path)), *Path(os.path.abspath(path)).parents] if place.exists())
    if not os.access(nearest, os.W_OK | os.X_OK):
        shown = Path(path) if nearest == Path(os.path.abspath(path)) else nearest
        raise InvalidValue(f"{named} {path}: {shown} is not writable (no permission to write in it, or a read-only file "
                           f"system); give a directory that can be written")


def check_empty_output_dir(path: Union[str, Path]) -> None:
    """Refuse an --output_dir that holds anything (what is there would be read with what is written), that a file
    is in the way of, or that lies inside a training checkpoint or prepared data; one that is empty or not there yet
    is taken."""
    check_dir_can_be_made(path, "--output_dir")
    check_outside_checkpoint_or_data(path, "--output_dir")
    if Path(path).is_dir() and any(Path(path).iterdir()):
        raise AlreadyExists(f"Output directory {path} exists and is not empty: delete it or pick another")


def is_training_checkpoint(directory: Union[str, Path]) -> bool:
    """Whether `directory` holds what pretrain writes beside a checkpoint's weights (step.json, manifest.json): a training
    checkpoint, whole or not, and not a model directory."""
    return (Path(directory) / STEP_FILE).is_file() or (Path(directory) / MANIFEST_FILE).is_file()


def enclosing_checkpoint_or_data(path: Union[str, Path]) -> Optional[str]:
    """Where `path` lies inside a training checkpoint or a prepared data directory, what to say of it ("DIR, a
    training checkpoint, whose files ..."); else None. Both own every file in them: a checkpoint goes whole when its run
    prunes or replaces it, and prepared data when it is prepared again, taking what was written inside along."""
    for above in Path(path).absolute().parents:
        if is_training_checkpoint(above):
            return (f"{above}, a training checkpoint, whose files are the ones its manifest lists and go with it when "
                    f"its run prunes or replaces it")
        if (above / INDEX_FILE).is_file():
            return f"{above}, a prepared data directory, whose files go with it when it is prepared again"
    return None


def check_outside_checkpoint_or_data(path: Union[str, Path], named: str) -> None:
    """Refuse an output directory (given as the option `named`) inside a training checkpoint or prepared data: what is
    written there would go with them."""
    enclosing = enclosing_checkpoint_or_data(path)
    if enclosing is not None:
        raise AlreadyExists(f"{named} {path} is inside {enclosing}: give a directory outside it")


def short_list(items: Iterable, limit: int = 12) -> str:
    """The first `limit` of `items` joined by commas, and how many more there are: what a one-line error shows of a list."""
    items = list(items)
    return ", ".join(str(i) for i in items[:limit]) + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def directories_below(directory: Union[str, Path], what: Callable[[Path], Any], depth: int = 2) -> Dict[Path, Any]:
    """The directories at most `depth` levels below `directory` of which `what` tells something (neither None nor
    False), each with what it told, in name order (hidden ones and those below a match left out; `what` asked once
    of each directory): where the user who named the directory above a model or a tokenizer (a LoRA fine-tune's
    output with its adapter/ and merged/, a Hugging Face cache's snapshots/<revision>/) finds the one meant."""
    found: Dict[Path, Any] = {}
    try:
        children = sorted(p for p in Path(directory).iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:  # not a directory, or not readable: nothing to point at
        return {}
    for child in children:
        told = what(child)
        if told is not None and told is not False:
            found[child] = told
        elif depth > 1:
            found.update(directories_below(child, what, depth - 1))
    return found


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
    check_dir_can_be_made(path)
    created = missing_ancestors(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:  # what the checks cannot see: a file system that takes no new directory (/proc), a full disk
        remove_empty_dirs(created)
        raise InvalidValue(f"directory {path} could not be made: {error.strerror or error}") from None
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
