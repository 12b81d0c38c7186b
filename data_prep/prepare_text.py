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
workers tokenize every document; the tokens of the held-out ones go to one token file per input file,
which this process then writes, in input file order, as the chunks of OUT/val. Both directories are
written inside a hidden sibling of OUT that is renamed to OUT last, so an interrupted run leaves no OUT.
"""
import hashlib
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Iterator, List, Optional, Union

import numpy as np

from fabric_lin.errors import AlreadyExists, InvalidValue, sigterm_interrupts

if __name__ == "__main__":  # run as a script: make `data_prep` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_lin.data.prepared import check_prepared_dir, write_prepared_info
from fabric_lin.data.raw_files import BadFileError, find_text_files, iter_text_documents, text_files_to_read
from fabric_lin.data.recipe import (
    EMPTY_DOCUMENTS_ARE,
    TokenizeRecipe,
    check_chunk_size,
    check_fast_dev_run,
    check_num_workers,
    check_output_dir_is_free,
    default_num_workers,
    file_record,
    format_summary,
    note_killed_preparations,
    require_flags,
    run_recipe,
    stage_id,
    summarize,
)
from fabric_lin.data.tokenizer import Tokenizer, token_dtype
from fabric_lin.files import created_dir

# Documents read from a file at once (and so handed to the tokenizer together, in groups of
# recipe.ENCODE_GROUP_CHARS characters).
DOCUMENTS_PER_BATCH = 8192
# A sample of config_hub's recipes: a 2048-token sequence and the token after it (the default chunk_size holds
# 16384 of them). A validation split smaller than one is said to be at the end of a run.
RECIPE_SAMPLE_TOKENS = 2049
HELD_OUT_DIR = ".held-out"
HELD_OUT_SUFFIX = ".tokens"  # <held-out dir>/<input file's relative path>.tokens: EOS-separated token ids


def held_out(relative_path: str, index: int, val_fraction: float) -> bool:
    """Whether document `index` (line or row number) of the input file `relative_path` belongs to the
    validation split: a hash of the two below `val_fraction`, so no state or seed decides it."""
    if val_fraction <= 0:
        return False
    digest = hashlib.blake2b(f"{relative_path}\n{index}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < val_fraction * 2**64


class TextRecipe(TokenizeRecipe):
    """Tokenizes field or column `text_key` of every document of the files of `input_dir` that match
    `pattern`. The tokens of the documents `held_out` picks go to one token file per input file under
    `held_out_dir`, the others to the chunks. Empty and whitespace-only documents are left out and counted; bad
    rows are counted and named."""

    name = "text"

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
        read = 0  # documents read
        for batch in iter_text_documents(path, self.text_key, DOCUMENTS_PER_BATCH):
            for rows, reason in batch.bad:
                self.skip_bad_rows(rows, reason)
            self._empty_documents += len(batch.empty)
            read += len(batch.texts)
            texts, held = [], []
            for index, text in zip(batch.indices, batch.texts):
                (held if held_out(relative, index, self.val_fraction) else texts).append(text)
            if held:
                self._hold_out(relative, held)
            if texts:
                yield texts
        if read == 0:
            left_out = []
            if self._bad_rows:
                left_out.append(f"{self._bad_rows} bad row(s)")
            if self._empty_documents:
                left_out.append(f"{self._empty_documents} {EMPTY_DOCUMENTS_ARE}")
            raise BadFileError(path, f"no usable document: {', '.join(left_out)}" if left_out else "empty file: no documents")

    def _hold_out(self, relative: str, texts: List[str]) -> None:
        """Append the tokens of `texts`, each followed by EOS, to the held-out token file of input file `relative`."""
        path = Path(self.held_out_dir) / (relative + HELD_OUT_SUFFIX)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            for tokens in self.tokenize(texts):
                tokens.tofile(f)
        self._held_out += len(texts)


def prepare(
    input_dir: Optional[Path] = None,
    output_dir: Optional[Path] = None,
    tokenizer_path: Optional[Path] = None,
    text_key: str = "text",
    pattern: str = "**/*",
    val_fraction: float = 0.001,
    chunk_size: int = RECIPE_SAMPLE_TOKENS * 16384,
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
        raise InvalidValue(f"--val_fraction {val_fraction}: expected a share of the documents, at least 0 and below 1")
    check_chunk_size(chunk_size)
    check_num_workers(num_workers)
    check_fast_dev_run(fast_dev_run)
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    # never mixed with the chunks of an earlier run: the trainer would read both
    check_output_dir_is_free(output_dir, tokenizer_path)
    note_killed_preparations(output_dir)
    text_files_to_read(input_dir, pattern)  # a missing or empty input directory fails here
    num_workers = num_workers or default_num_workers()

    with created_dir(output_dir.parent), sigterm_interrupts():
        stage = output_dir.parent / f".tmp-{stage_id(output_dir)}"
        stage.mkdir()
        try:
            splits = _prepare_into(stage, input_dir, output_dir, tokenizer_path, text_key, pattern, val_fraction,
                                   chunk_size, num_workers, fast_dev_run)
            if output_dir.exists() and any(output_dir.iterdir()):
                raise AlreadyExists(f"Output directory {output_dir} was written by another run while this one ran")
            if output_dir.exists():
                output_dir.rmdir()
            os.rename(stage, output_dir)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    val = splits["val"]
    print(f"Wrote {output_dir}: train/ {splits['train']['tokens']} tokens of {splits['train']['documents']} documents"
          + (f", val/ {val['tokens']} tokens of {val['documents']} documents" if val else ", no val/"), flush=True)
    if val and val["tokens"] < RECIPE_SAMPLE_TOKENS:
        # a sample is max_seq_length + 1 tokens of one chunk file: fewer tokens hold no sample of that length
        print(f"Note: {output_dir / 'val'} holds {val['tokens']} tokens, too few for validation at train.max_seq_length "
              f"{val['tokens']} or more (config_hub's recipes train at {RECIPE_SAMPLE_TOKENS - 1}): raise --val_fraction "
              f"({val_fraction} held out {val['documents']} of {val['documents'] + splits['train']['documents']} documents)",
              flush=True)
    return splits


def _prepare_into(stage: Path, input_dir: Path, output_dir: Path, tokenizer_path: Path, text_key: str, pattern: str,
                  val_fraction: float, chunk_size: int, num_workers: int, fast_dev_run: Union[bool, int]) -> dict:
    """stage/train and, when any document was held out, stage/val; the summaries of both."""
    held_out_dir = stage / HELD_OUT_DIR
    recipe = TextRecipe(tokenizer_path, chunk_size, input_dir, text_key, pattern, val_fraction, held_out_dir)
    settings = {"text_key": text_key, "pattern": pattern, "val_fraction": val_fraction}
    train = run_recipe(recipe, input_dir, stage / "train", num_workers, fast_dev_run, info={"split": "train", **settings},
                       shown_as=output_dir / "train")
    info = {"split": "val", "recipe": TextRecipe.name, "input_dir": str(input_dir), "chunk_size": chunk_size,
            "fast_dev_run": 10 if fast_dev_run is True else int(fast_dev_run or 0), **settings}
    if fast_dev_run:  # a --fast_dev_run slice says of how many files, as the train/ split does
        info["input_files"] = len(recipe.inputs)
    val = write_held_out_split(held_out_dir, stage / "val", input_dir, Tokenizer(tokenizer_path, "--tokenizer_path"), chunk_size, info,
                               shown_as=output_dir / "val")
    if val is None:
        why = "--val_fraction is 0" if val_fraction == 0 else (
            f"none of the {train['documents']} documents fell into the --val_fraction {val_fraction} share (raise it)")
        print(f"No validation split: {why}, so {output_dir / 'val'} is not written", flush=True)
    shutil.rmtree(held_out_dir, ignore_errors=True)
    return {"train": train, "val": val}


def write_held_out_split(held_out_dir: Path, out_dir: Path, input_dir: Path, tokenizer: Tokenizer, chunk_size: int,
                         info: dict, shown_as: Path) -> Optional[dict]:
    """Write the prepared directory `out_dir` from the token files under `held_out_dir`, in the order of the
    input files they came from; return its summary (None, and nothing written, when there are none).

    litdata's Cache writes the chunks, as its DataProcessor's workers do, here in this one process: the
    documents are tokenized already, and a second DataProcessor would cost seconds of worker start-up."""
    from litdata.streaming.cache import Cache
    from litdata.streaming.item_loader import TokensLoader

    def source(path: Path) -> Path:  # the input file's path relative to input_dir
        return path.relative_to(held_out_dir).with_name(path.name[: -len(HELD_OUT_SUFFIX)])

    files = sorted(held_out_dir.rglob(f"*{HELD_OUT_SUFFIX}"), key=source)
    if not files:
        return None
    start = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    cache = Cache(str(out_dir), chunk_size=chunk_size, item_loader=TokensLoader())
    records, items = [], 0
    for path in files:
        tokens = np.fromfile(path, dtype=dtype)
        for offset in range(0, len(tokens), chunk_size):
            cache[items] = tokens[offset : offset + chunk_size]
            items += 1
        documents = int(np.count_nonzero(tokens == tokenizer.eos_id))  # each document ends with EOS
        records.append(file_record(str(input_dir / source(path)), documents=documents, tokens=len(tokens)))
    cache.done()
    cache.merge()
    summary = summarize(records)
    write_prepared_info(out_dir, tokenizer=tokenizer, **info, summary=summary)
    check_prepared_dir(out_dir, tokenizer)
    print(format_summary(summary, f"Prepared {shown_as}", time.perf_counter() - start), flush=True)
    return summary


if __name__ == "__main__":
    from jsonargparse import CLI

    # call the imported module's function so the recipe pickles as data_prep.prepare_text.*, not __main__.*
    from data_prep.prepare_text import prepare as prepare_from_module

    CLI(prepare_from_module, as_positional=False)
