"""Any text corpus -> litdata token chunks, with a held-out validation split.

Reads the files under `input_dir` that match `--pattern` (default: all, recursively) and end with
.jsonl, .jsonl.zst, .jsonl.gz, .json.gz (JSON lines, field `--text_key`), .parquet (column `--text_key`,
read row group by row group) or .txt (a whole file is one document). Documents are tokenized with
bos=False, eos=True, many at once, and written to OUT/train and OUT/val:

    python data_prep/prepare_text.py --input_dir data/fineweb-edu/sample/10BT \
        --output_dir data/fineweb-edu-10BT --tokenizer_path checkpoints/meta-llama/Llama-2-7b-hf

Which documents are held out for OUT/val is decided by a hash of (the file's path relative to
`input_dir`, the document's line or row number) against `--val_fraction`: the same documents on every
run, whatever the number of workers, and a file added to the corpus moves no other document. The
first pass tokenizes the training documents and sets the held-out texts aside, one JSON-lines file
per input file; a second, small pass tokenizes those into OUT/val. Both are written inside a hidden
sibling of OUT that is renamed to OUT last, so an interrupted run leaves no OUT.
"""
import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Union

if __name__ == "__main__":  # run as a script: make `data_prep` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.base import TokenizeRecipe, default_num_workers, require_flags, run_recipe
from fabric_lin.data.raw_files import BadFileError, find_text_files, iter_text_documents
from fabric_lin.files import created_dir

# Documents read from a file at once (and so handed to the tokenizer together, in groups of
# base.ENCODE_GROUP_CHARS characters).
DOCUMENTS_PER_BATCH = 8192
HELD_OUT_DIR = ".held-out"
HELD_OUT_SUFFIX = ".held-out.jsonl"


def held_out(relative_path: str, index: int, val_fraction: float) -> bool:
    """Whether document `index` (line or row number) of the input file `relative_path` belongs to the
    validation split: a hash of the two below `val_fraction`, so no state or seed decides it."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{relative_path}\n{index}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2**64


class TextRecipe(TokenizeRecipe):
    """Tokenizes field or column `text_key` of every document of the files of `input_dir` that match
    `pattern`, except the documents `held_out` picks, which go to one JSON-lines file per input file under
    `held_out_dir`. Empty documents are dropped (counted as skipped rows); bad rows are counted and named."""

    def __init__(self, tokenizer_path: Union[str, Path], chunk_size: int, input_dir: Union[str, Path],
                 text_key: str = "text", pattern: str = "**/*", val_fraction: float = 0.0,
                 held_out_dir: Optional[Union[str, Path]] = None) -> None:
        super().__init__(tokenizer_path=tokenizer_path, chunk_size=chunk_size)
        self.input_dir = str(input_dir)
        self.text_key = text_key
        self.pattern = pattern
        self.val_fraction = val_fraction
        self.held_out_dir = None if held_out_dir is None else str(held_out_dir)

    def find_inputs(self, input_dir: str) -> List[str]:
        files, _ = find_text_files(input_dir, self.pattern)
        return [str(p) for p in files]

    def read_documents(self, path: str) -> Iterator[List[str]]:
        relative = Path(path).relative_to(self.input_dir).as_posix()
        held_out_file = None
        read = 0  # documents read, empty ones included
        try:
            for batch in iter_text_documents(path, self.text_key, DOCUMENTS_PER_BATCH):
                for rows, reason in batch.bad:
                    self.skip_bad_rows(rows, reason)
                read += len(batch.texts)
                texts = []
                for index, text in zip(batch.indices, batch.texts):
                    if not text:
                        self._skipped_rows += 1
                    elif held_out(relative, index, self.val_fraction):
                        if held_out_file is None:
                            held_out_file = self._open_held_out_file(relative)
                        held_out_file.write(json.dumps({"text": text}) + "\n")
                        self._held_out += 1
                    else:
                        texts.append(text)
                if texts:
                    yield texts
        finally:
            if held_out_file is not None:
                held_out_file.close()
        if read == 0:
            raise BadFileError(path, f"no usable document: {self._bad_rows} bad row(s)" if self._bad_rows else "empty file: no documents")

    def _open_held_out_file(self, relative: str):
        path = Path(self.held_out_dir) / (relative + HELD_OUT_SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w", encoding="utf-8")


class HeldOutRecipe(TextRecipe):
    """The second pass: tokenizes the documents a TextRecipe held out, from its `held_out_dir`, and names
    each file in its reports by the input file the documents came from."""

    def __init__(self, tokenizer_path: Union[str, Path], chunk_size: int, held_out_dir: Union[str, Path],
                 source_dir: Union[str, Path]) -> None:
        super().__init__(tokenizer_path, chunk_size, input_dir=held_out_dir, pattern=f"**/*{HELD_OUT_SUFFIX}")
        self.source_dir = str(source_dir)

    def shown_path(self, path: str) -> str:
        relative = Path(path).relative_to(self.input_dir).as_posix()
        return str(Path(self.source_dir) / relative[: -len(HELD_OUT_SUFFIX)])


def prepare(
    input_dir: Optional[Path] = None,
    output_dir: Optional[Path] = None,
    tokenizer_path: Optional[Path] = None,
    text_key: str = "text",
    pattern: str = "**/*",
    val_fraction: float = 0.001,
    chunk_size: int = 2049 * 16384,
    num_workers: Optional[int] = None,
    fast_dev_run: Union[bool, int] = False,
) -> dict:
    """Tokenize a corpus of JSON-lines, parquet or text files into litdata chunks: OUT/train and OUT/val.

    Args:
        input_dir: Directory of the corpus (e.g. fineweb-edu's sample/10BT parquet shards, or a folder of jsonl).
        output_dir: Directory to create, with train/ and val/; written under a temporary name and renamed when complete.
        tokenizer_path: Directory holding the tokenizer.model (and optional tokenizer_config.json).
        text_key: The JSON field or parquet column that holds each document's text.
        pattern: Glob, relative to input_dir, of the files to read (default: all, recursively); of those, the
            ones ending in .jsonl, .jsonl.zst, .jsonl.gz, .json.gz, .parquet or .txt are read.
        val_fraction: Share of the documents held out for output_dir/val (0: no validation split), picked by a
            hash of (file, line or row), so the same documents on every run.
        chunk_size: Tokens per chunk file.
        num_workers: Worker processes (default: one per CPU core).
        fast_dev_run: Process only the first files (True: 10, or this many) to try the pipeline.
    """
    require_flags(input_dir=input_dir, output_dir=output_dir, tokenizer_path=tokenizer_path)
    if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
        raise ValueError(f"--val_fraction {val_fraction}: expected a share of the documents, at least 0 and below 1")
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    if output_dir.exists() and any(output_dir.iterdir()):
        # never mixed with the chunks of an earlier run: the trainer would read both
        raise FileExistsError(f"Output directory {output_dir} exists and is not empty: delete it or pick another")
    files, others = find_text_files(input_dir, pattern)  # a missing or empty input directory fails here
    if others:
        shown = ", ".join(str(p.relative_to(input_dir)) for p in others[:3]) + (", ..." if len(others) > 3 else "")
        print(f"Not read: {len(others)} file(s) matching --pattern {pattern!r} with other suffixes ({shown})", flush=True)
    num_workers = num_workers or default_num_workers()

    with created_dir(output_dir.parent):
        stage = output_dir.parent / f".tmp-{output_dir.name}-{uuid.uuid4().hex[:8]}"
        stage.mkdir()
        try:
            splits = _prepare_into(stage, input_dir, output_dir, tokenizer_path, text_key, pattern, val_fraction,
                                   chunk_size, num_workers, fast_dev_run)
            if output_dir.exists() and any(output_dir.iterdir()):
                raise FileExistsError(f"Output directory {output_dir} was written by another run while this one ran")
            if output_dir.exists():
                output_dir.rmdir()
            os.rename(stage, output_dir)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    val = splits["val"]
    print(f"Wrote {output_dir}: train/ {splits['train']['tokens']} tokens of {splits['train']['documents']} documents"
          + (f", val/ {val['tokens']} tokens of {val['documents']} documents" if val else ", no val/"), flush=True)
    return splits


def _prepare_into(stage: Path, input_dir: Path, output_dir: Path, tokenizer_path: Path, text_key: str, pattern: str,
                  val_fraction: float, chunk_size: int, num_workers: int, fast_dev_run: Union[bool, int]) -> dict:
    """stage/train and, when any document was held out, stage/val; the summaries of both."""
    held_out_dir = stage / HELD_OUT_DIR
    recipe = TextRecipe(tokenizer_path, chunk_size, input_dir, text_key, pattern, val_fraction, held_out_dir)
    settings = {"text_key": text_key, "pattern": pattern, "val_fraction": val_fraction}
    train = run_recipe(recipe, input_dir, stage / "train", num_workers, fast_dev_run, recipe_name="text",
                       info={"split": "train", **settings}, shown_as=output_dir / "train")
    held_out_files = sorted(held_out_dir.rglob(f"*{HELD_OUT_SUFFIX}"))
    if not held_out_files:
        why = "--val_fraction is 0" if val_fraction == 0 else (
            f"none of the {train['documents']} documents fell into the --val_fraction {val_fraction} share (raise it)")
        print(f"No validation split: {why}, so {output_dir / 'val'} is not written", flush=True)
        return {"train": train, "val": None}
    print(f"Validation split: the {train['held_out']} documents held out from {len(held_out_files)} file(s)", flush=True)
    val = run_recipe(
        HeldOutRecipe(tokenizer_path, chunk_size, held_out_dir, source_dir=input_dir), held_out_dir, stage / "val",
        min(num_workers, len(held_out_files)), recipe_name="text",
        # the held-out documents of the input files the training pass read
        info={"split": "val", "input_dir": str(input_dir), "fast_dev_run": 10 if fast_dev_run is True else int(fast_dev_run or 0),
              **settings},
        shown_as=output_dir / "val",
    )
    shutil.rmtree(held_out_dir)
    return {"train": train, "val": val}


if __name__ == "__main__":
    from jsonargparse import CLI

    # call the imported module's function so the recipe pickles as data_prep.prepare_text.*, not __main__.*
    from data_prep.prepare_text import prepare as prepare_from_module

    CLI(prepare_from_module, as_positional=False)
