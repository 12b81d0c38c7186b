"""A corpus of long documents that every fabric-lin installation can build, no download: the Python sources of
the installed torch, each package's modules one document, for training and evaluating at 2K to 32K tokens of
context. It stands in for PG19's books (which cannot be fetched here): a document runs for 64K tokens or more, and
what comes late in it refers to what came far earlier (names defined in one module and used in the next).

Documents: torch's directories, deepest first. A directory's document is its own .py files and those of its
subdirectories that were too short to be documents of their own, in path order, each file after a line naming
it. It is a document once it holds MIN_DOCUMENT_TOKENS tokens; a shorter one goes up into its parent's (what
torch/ itself is left with is a document if long enough, else left out). Every VAL_EVERY-th document in path
order is held out: its first VAL_WINDOWS_PER_DOCUMENT windows of LONGEST_CONTEXT + 1 tokens form the validation
split, so that the held-out tokens come from several documents, none of which the training split holds.

Tokens: the sample corpus's 4096-piece tokenizer (the debug models' vocabulary), each document followed by EOS.
Each document is a chunk file of its own in the prepared directories train/ and val/, so that a block of any
length up to a document's comes from within one document, as a window of a book does. Cached under a name
derived from the tokenizer and the sources (their paths and bytes), built once per installed torch.
"""
import functools
import hashlib
import importlib.util
import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from fabric_lin.cpu_cores import usable_cpu_cores
from fabric_lin.data.base import DataModule, token_train_loader, token_val_loader
from fabric_lin.data.sample_corpus import (
    build_once,
    corpus_fingerprint,
    default_cache_dir,
    ensure_sample_corpus,
    stdlib_modules,
)
from fabric_lin.data.tokenizer import Tokenizer, copy_tokenizer_files, token_dtype
from fabric_lin.errors import InvalidValue, MissingFile

CORPUS_VERSION = 1
SOURCE_PACKAGE = "torch"  # a dependency of fabric-lin: its sources are on every machine that runs it
LONGEST_CONTEXT = 32768
WINDOW = LONGEST_CONTEXT + 1  # a block of the longest context: its inputs and the shifted targets
# two windows: at the longest context a document loses at most a third of its tokens to the block that does not fit
MIN_DOCUMENT_TOKENS = 2 * WINDOW
VAL_EVERY = 8
VAL_WINDOWS_PER_DOCUMENT = 4
MIN_VAL_WINDOWS = 8
CONTEXTS = (2048, 8192, 16384, 32768)  # the lengths corpus.json counts blocks at
ENCODE_GROUP_CHARS = 1 << 22  # files handed to the tokenizer at once: their tokens as lists of ints stay small


def source_root() -> Path:
    """The directory of the installed torch, found without importing it."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingFile(f"the long-document corpus is built from the Python sources of {SOURCE_PACKAGE}, which is not "
                          "installed")
    return Path(list(spec.submodule_search_locations)[0])


def python_files(root: Path) -> List[Path]:
    """The .py files under `root`, in path order."""
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise MissingFile(f"no .py files under {root}: the long-document corpus is built from them")
    return files


@functools.lru_cache(maxsize=None)
def long_documents_fingerprint(root: Path) -> str:
    """The name of the corpus of `root`'s sources: its version and settings, the sample corpus's (whose tokenizer it
    uses) and every source file's path and bytes. Computed once per process (it reads ~50 MB)."""
    digest = hashlib.sha256(f"fabric-lin long documents v{CORPUS_VERSION} min {MIN_DOCUMENT_TOKENS} val "
                            f"{VAL_EVERY}x{VAL_WINDOWS_PER_DOCUMENT}x{WINDOW}\n".encode())
    digest.update(corpus_fingerprint(stdlib_modules()).encode() + b"\n")
    for path in python_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def shown_name(root: Path, path: Path) -> str:
    """A file's or directory's path from the package's own name on: torch/nn/modules/linear.py."""
    return (Path(root.name) / path.relative_to(root)).as_posix()


def file_text(root: Path, path: Path) -> str:
    return f"# {shown_name(root, path)}\n\n" + path.read_text(encoding="utf-8", errors="replace")


def tokenize_files(tokenizer: Tokenizer, root: Path, files: List[Path]) -> List[np.ndarray]:
    """Each file's tokens (after the line that names it), without EOS."""
    dtype = token_dtype(tokenizer.vocab_size)
    threads = usable_cpu_cores()
    tokens: List[np.ndarray] = []
    start = 0
    while start < len(files):
        end, chars, texts = start, 0, []
        while end < len(files) and (end == start or chars < ENCODE_GROUP_CHARS):
            texts.append(file_text(root, files[end]))
            chars += len(texts[-1])
            end += 1
        tokens += [np.array(ids, dtype=dtype) for ids in tokenizer.encode_batch(texts, eos=False, num_threads=threads)]
        start = end
    return tokens


def group_documents(root: Path, files: List[Path], file_tokens: List[int]) -> List[Tuple[str, List[int]]]:
    """(name, indices of its files in path order) of each document, in name order: see the module's docstring."""
    own: Dict[Path, List[int]] = {}
    for i, path in enumerate(files):
        own.setdefault(path.parent, []).append(i)
    directories = {d for path in files for d in (path.parent, *path.parent.parents) if d == root or root in d.parents}
    passed_up: Dict[Path, List[int]] = {}
    documents = []
    for directory in sorted(directories, key=lambda d: (-len(d.parts), d.as_posix())):  # children before parents
        members = sorted(own.get(directory, []) + passed_up.pop(directory, []))  # indices are in path order
        if sum(file_tokens[i] for i in members) >= MIN_DOCUMENT_TOKENS:
            documents.append((shown_name(root, directory), members))
        elif directory != root:
            passed_up.setdefault(directory.parent, []).extend(members)
    return sorted(documents)


def write_documents(out_dir: Path, documents: List[np.ndarray], tokenizer: Tokenizer, info: dict) -> None:
    """A prepared directory whose chunk files are the documents, one each, in order.

    litdata's writer closes a chunk once it holds more tokens than its chunk size, and writes an item longer than
    that alone: with the chunk size below the shortest document, each document is a chunk."""
    from litdata.streaming.cache import Cache
    from litdata.streaming.item_loader import TokensLoader

    from fabric_lin.data.prepared import check_prepared_dir, chunk_tokens, write_prepared_info

    cache = Cache(str(out_dir), chunk_size=MIN_DOCUMENT_TOKENS - 1, item_loader=TokensLoader())
    for i, tokens in enumerate(documents):
        cache[i] = tokens
    cache.done()
    cache.merge()
    written = chunk_tokens(out_dir).tolist()
    if written != [len(tokens) for tokens in documents]:
        raise RuntimeError(f"{out_dir}: litdata did not write one chunk file per document (chunk sizes {written[:5]}...)")
    write_prepared_info(out_dir, tokenizer, recipe="long documents", **info)
    check_prepared_dir(out_dir, tokenizer)


def split_summary(documents: List[np.ndarray]) -> dict:
    """Documents, tokens, and the blocks of each context that the split gives (blocks stay within a document)."""
    lengths = np.array([len(tokens) for tokens in documents], dtype=np.int64)
    return {"documents": len(documents), "tokens": int(lengths.sum()),
            "blocks": {str(n): int((lengths // (n + 1)).sum()) for n in CONTEXTS}}


def build_long_documents(out_dir: Path, root: Path, files: List[Path], sample_corpus: Path, fingerprint: str) -> None:
    """Tokenize `files` with the sample corpus's tokenizer, group them into documents and write train/, val/,
    tokenizer/ and corpus.json (what the corpus is made of, its documents and the size of each split)."""
    tokenizer_dir = out_dir / "tokenizer"
    copy_tokenizer_files(sample_corpus / "tokenizer", tokenizer_dir)
    tokenizer = Tokenizer(tokenizer_dir, f"the sample corpus's tokenizer ({sample_corpus / 'tokenizer'})")
    file_tokens = tokenize_files(tokenizer, root, files)
    documents = group_documents(root, files, [len(tokens) for tokens in file_tokens])
    splits: Dict[str, List[np.ndarray]] = {"train": [], "val": []}
    records = []
    for i, (name, members) in enumerate(documents):
        tokens = np.concatenate([file_tokens[j] for j in members] + [np.array([tokenizer.eos_id], dtype=file_tokens[0].dtype)])
        split = "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train"
        if split == "val":
            tokens = tokens[: VAL_WINDOWS_PER_DOCUMENT * WINDOW]
        splits[split].append(tokens)
        records.append({"name": name, "split": split, "tokens": len(tokens),
                        "files": [shown_name(root, files[j]) for j in members]})
    val_windows = sum(len(tokens) // WINDOW for tokens in splits["val"])
    version = metadata.version(SOURCE_PACKAGE)
    if val_windows < MIN_VAL_WINDOWS:
        raise InvalidValue(
            f"the Python sources of {SOURCE_PACKAGE} {version} in {root} make {len(documents)} documents of "
            f"{MIN_DOCUMENT_TOKENS}+ tokens, whose held-out ones give {val_windows} windows of {WINDOW} tokens, fewer "
            f"than the {MIN_VAL_WINDOWS} a long-context evaluation needs"
        )
    source = {"package": SOURCE_PACKAGE, "version": version, "root": str(root), "files": len(files)}
    for split, split_documents in splits.items():
        write_documents(out_dir / split, split_documents, tokenizer, {"split": split, "source": source})
    info = {"version": CORPUS_VERSION, "fingerprint": fingerprint, "source": source,
            "tokenizer_sha256": tokenizer.model_hash,
            "train": split_summary(splits["train"]), "val": split_summary(splits["val"]), "documents": records,
            "left_out_files": len(files) - sum(len(r["files"]) for r in records)}
    (out_dir / "corpus.json").write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")


def ensure_long_documents(cache_dir: Optional[Path] = None) -> Path:
    """Directory of the long-document corpus, built first if this installation has none yet (`build_once`)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir("long_documents")
    root = source_root()
    fingerprint = long_documents_fingerprint(root)
    target = cache_dir / fingerprint
    if (target / "corpus.json").is_file():
        return target
    sample_corpus = ensure_sample_corpus()  # its tokenizer; built first, so its own messages come before ours

    def build(out_dir: Path) -> None:
        build_long_documents(out_dir, root, python_files(root), sample_corpus, fingerprint)

    return build_once(target, build, "the long-document corpus", f"the Python sources of {SOURCE_PACKAGE} in {root}")


@dataclass
class LongDocuments(DataModule):
    """Long documents for long-context training and evaluation: the installed torch's Python sources, each package
    a document of 64K tokens or more, held-out documents for validation (fabric_lin/data/long_documents.py).

    Built on first use with the sample corpus's 4096-piece tokenizer (`tokenizer_dir`), then read from the cache.
    A block of max_seq_length + 1 tokens is always cut from within one document, up to 32768 + 1."""

    cache_dir: Optional[Path] = None
    """Where the corpus is built and cached (default: ~/.cache/fabric-lin/long_documents)."""
    seed: int = 42
    num_workers: int = 0

    data_path: Path = field(default=Path(), init=False)

    def __post_init__(self) -> None:
        root = Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir("long_documents")
        self.data_path = root / long_documents_fingerprint(source_root())  # known before it is built

    @property
    def tokenizer_dir(self) -> Path:
        return self.data_path / "tokenizer"

    @property
    def train_path(self) -> Path:
        return self.data_path / "train"

    @property
    def val_path(self) -> Path:
        return self.data_path / "val"

    def prepare_data(self) -> None:
        self.data_path = ensure_long_documents(self.cache_dir)

    def setup(self) -> None:
        self.prepare_data()  # a no-op once built; lets a rank that skipped prepare_data wait on the lock
        self.check_prepared([self.train_path, self.val_path])

    def train_dataloader(self):
        return token_train_loader([self.train_path], self.block_size, self.batch_size, self.num_workers, self.seed)

    def val_dataloader(self):
        return token_val_loader(self.val_path, self.block_size, self.batch_size, self.num_workers)
