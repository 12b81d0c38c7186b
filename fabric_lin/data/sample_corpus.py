"""The embedded default corpus: real text that every Python installation has, no download.

The standard library's top-level `.py` modules become Starcoder-format parquet (`content`), their
docstrings SlimPajama-format `.jsonl.zst` rows (`text`, `meta.redpajama_set_name`; every eighth row
is labelled RedPajamaGithub, which the SlimPajama recipe drops). A 4096-piece tokenizer (the vocabulary
of `gla-debug`) is trained on the training split and the SlimPajama and Starcoder recipes tokenize it. The
result is cached under a name derived from the sources, so it is built once per Python installation.
The preprocessors' output goes to `build.log` in the corpus directory.
"""
import ast
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from fabric_lin.data.slimpajama_starcoder import SlimPajamaRecipe, SlimPajamaStarcoder, StarcoderRecipe
from fabric_lin.errors import MissingFile

CORPUS_VERSION = 2
VOCAB_SIZE = 4096
VAL_EVERY = 10  # every tenth module (in sorted order) goes to the validation split
CHUNK_SIZE = 2049 * 16  # small chunks, so that loader workers and ranks get several each
BUILD_LOG = "build.log"
SLIMPAJAMA_SHARDS = 4
STARCODER_SHARDS = 2
OTHER_SETS = ("RedPajamaCommonCrawl", "RedPajamaC4", "RedPajamaBook", "RedPajamaArXiv", "RedPajamaWikipedia", "RedPajamaStackExchange")


def default_cache_dir(corpus: str = "sample_corpus") -> Path:
    """Where fabric-lin's embedded corpora are built and kept: ~/.cache/fabric-lin/<corpus> (or under $XDG_CACHE_HOME)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fabric-lin" / corpus


def stdlib_modules() -> List[Path]:
    """The standard library's top-level .py files, sorted by name (a fixed list for an installation)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if not files:
        raise MissingFile(f"No .py files found in the standard library directory {stdlib}")
    return files


def corpus_fingerprint(files: List[Path]) -> str:
    digest = hashlib.sha256(f"fabric-lin sample corpus v{CORPUS_VERSION} vocab {VOCAB_SIZE}\n".encode())
    for path in files:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def module_docstrings(path: Path) -> List[Tuple[str, str]]:
    """(qualified name, docstring) of the module and of every class and function in it."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    found = []

    def visit(node, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child)
                if doc:
                    found.append((name, doc))
                visit(child, name)

    module_doc = ast.get_docstring(tree)
    if module_doc:
        found.append((path.stem, module_doc))
    visit(tree, path.stem)
    return found


def _write_jsonl_zst(path: Path, rows: List[dict]) -> None:
    import zstandard

    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(row) + "\n" for row in rows).encode("utf-8")
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(data))


def _write_parquet(path: Path, files: List[Path]) -> List[str]:
    """A Starcoder-format parquet file of the modules `files`; returns their texts (its column `content`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    contents = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    pq.write_table(pa.table({"max_stars_repo_path": [f"Lib/{p.name}" for p in files], "content": contents}), path)
    return contents


def _docstring_rows(files: List[Path], row_offset: int = 0) -> List[dict]:
    rows = []
    for path in files:
        for name, doc in module_docstrings(path):
            i = row_offset + len(rows)
            set_name = "RedPajamaGithub" if i % 8 == 0 else OTHER_SETS[i % len(OTHER_SETS)]
            rows.append({"text": f"{name}\n\n{doc}", "meta": {"redpajama_set_name": set_name}})
    return rows


def write_raw_corpus(raw_dir: Path, files: List[Path]) -> Tuple[Dict[str, int], List[str]]:
    """raw_dir/train/{slimpajama,starcoder} and raw_dir/val/slimpajama from the given modules; returns their counts,
    and the training split's documents in the order of its files (what the tokenizer learns from: the docstrings'
    `text`, then the modules' `content`)."""
    val = [p for i, p in enumerate(files) if i % VAL_EVERY == VAL_EVERY - 1]
    train = [p for i, p in enumerate(files) if i % VAL_EVERY != VAL_EVERY - 1]
    train_rows = _docstring_rows(train)
    documents = []
    for shard in range(SLIMPAJAMA_SHARDS):
        rows = train_rows[shard::SLIMPAJAMA_SHARDS]
        _write_jsonl_zst(raw_dir / "train" / "slimpajama" / f"chunk_{shard}.jsonl.zst", rows)
        documents += [row["text"] for row in rows]
    val_rows = _docstring_rows(val)
    _write_jsonl_zst(raw_dir / "val" / "slimpajama" / "chunk_0.jsonl.zst", val_rows)
    for shard in range(STARCODER_SHARDS):
        documents += _write_parquet(raw_dir / "train" / "starcoder" / f"train-{shard:05d}-of-{STARCODER_SHARDS:05d}.parquet",
                                    train[shard::STARCODER_SHARDS])
    counts = {"train_modules": len(train), "val_modules": len(val), "train_rows": len(train_rows), "val_rows": len(val_rows)}
    return counts, documents


def build_sample_corpus(out_dir: Path, files: List[Path], moved_to: Optional[Path] = None) -> None:
    """Write the raw corpus, train the tokenizer and run both preprocessors into `out_dir`, which the caller renames
    `moved_to` where given: the data's prepared.json names the tokenizer there."""
    from fabric_lin.data import train_tokenizer
    from fabric_lin.data.recipe import run_recipe

    raw = out_dir / "raw"
    counts, documents = write_raw_corpus(raw, files)
    tokenizer_dir = out_dir / "tokenizer"
    sentences, _ = train_tokenizer.sample_sentences(documents)
    train_tokenizer.write_tokenizer(sentences, tokenizer_dir, VOCAB_SIZE, source=str(raw / "train"), num_threads=1)
    for recipe, source, prepared in ((SlimPajamaRecipe, raw / "train" / "slimpajama", out_dir / "slimpajama" / "train"),
                                     (SlimPajamaRecipe, raw / "val" / "slimpajama", out_dir / "slimpajama" / "val"),
                                     (StarcoderRecipe, raw / "train" / "starcoder", out_dir / "starcoder")):
        run_recipe(recipe(tokenizer_dir, CHUNK_SIZE), source, prepared, num_workers=1,
                   tokenizer_shown_as=(moved_to or out_dir) / tokenizer_dir.name)
    info = {"version": CORPUS_VERSION, "python": sys.version, "sources": [p.name for p in files], **counts}
    (out_dir / "corpus.json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


@contextmanager
def output_to(path: Path) -> Iterator[None]:
    """Send this process's stdout and stderr, and so those of the processes it starts, to the file `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def build_once(target: Path, build: Callable[[Path], None], what: str, source: str) -> Path:
    """`target`, built first by `build(directory)` if it holds no complete build (its corpus.json) yet.

    Concurrent callers (DDP ranks, parallel tests) wait on a file lock; the build runs in a temporary directory
    beside `target`, its output going to build.log there, and is renamed to `target` last, so a killed build
    leaves nothing that looks complete. `what` names the build in messages ("the sample corpus"), `source` says
    what it is made of."""
    from filelock import FileLock

    if (target / "corpus.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if (target / "corpus.json").is_file():
            return target  # another process built it while this one waited
        tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
        sentence_start = what[:1].upper() + what[1:]
        print(f"Building {what} (first use): {source}, tokenized into {target}", flush=True)
        start = time.perf_counter()
        try:
            tmp.mkdir()
            try:
                with output_to(tmp / BUILD_LOG):
                    build(tmp)
            except KeyboardInterrupt:
                print(f"{sentence_start} build was interrupted: nothing was kept; the next run builds it again", file=sys.stderr)
                raise
            except BaseException:
                log = (tmp / BUILD_LOG).read_text(encoding="utf-8", errors="replace").splitlines()
                print(f"{sentence_start} build failed; the end of its log:\n" + "\n".join(log[-20:]), file=sys.stderr)
                raise
            if target.exists():  # an interrupted build without corpus.json
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"Built {what} in {target} in {time.perf_counter() - start:.1f}s (log: {target / BUILD_LOG})", flush=True)
    return target


def ensure_sample_corpus(cache_dir: Optional[Path] = None) -> Path:
    """Directory of the sample corpus, built first if this installation has none yet (`build_once`)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    files = stdlib_modules()
    target = cache_dir / corpus_fingerprint(files)
    return build_once(target, lambda out_dir: build_sample_corpus(out_dir, files, moved_to=target), "the sample corpus",
                      "Python's standard library")


@dataclass
class SampleCorpus(SlimPajamaStarcoder):
    """The embedded default: Python's standard library as a small SlimPajama and Starcoder corpus.

    Built on first use, with its own 4096-piece tokenizer (`tokenizer_dir`), then read from the cache."""

    data_path: Path = field(default=Path(), init=False)
    cache_dir: Optional[Path] = None
    """Where the corpus is built and cached (default: ~/.cache/fabric-lin/sample_corpus)."""
    use_starcoder: bool = True
    seed: int = 42
    num_workers: int = 0

    def __post_init__(self) -> None:
        root = Path(self.cache_dir) if self.cache_dir is not None else default_cache_dir()
        # where ensure_sample_corpus puts it: known before it is built
        self.data_path = root / corpus_fingerprint(stdlib_modules())

    @property
    def tokenizer_dir(self) -> Path:
        return Path(self.data_path) / "tokenizer"

    def prepare_data(self) -> None:
        self.data_path = ensure_sample_corpus(self.cache_dir)

    def setup(self) -> None:
        self.prepare_data()  # a no-op once built; lets a rank that skipped prepare_data wait on the lock
        super().setup()
