"""What the preprocessors (SlimPajama, Starcoder, any text corpus) share: `TokenizeRecipe`, whose batched
tokenization turns raw files into token arrays with a report per file, and `run_recipe`, which runs a recipe with
litdata's DataProcessor into a temporary directory and renames it to the output directory only once everything
was written. The commands that run them are in `data_prep/`; the sample corpus runs them too.
"""
import glob
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Union

import numpy as np
from litdata.processing.data_processor import DataChunkRecipe, DataProcessor
from litdata.streaming.item_loader import TokensLoader

from fabric_lin.cpu_cores import usable_cpu_cores
from fabric_lin.data.prepared import PREPARED_INFO_FILE, SMALLEST_CHUNK, check_prepared_dir, write_prepared_info
from fabric_lin.data.raw_files import BadFileError, check_input_dir
from fabric_lin.data.tokenizer import Tokenizer, describe_tokenizer, token_dtype, tokenizer_identity
from fabric_lin.errors import AlreadyExists, InvalidValue, UserError, sigterm_interrupts
from fabric_lin.files import check_empty_output_dir, created_dir, environment_variables

# Documents are encoded in groups of about this many characters: large enough for SentencePiece's
# threads to share, small enough that the Python lists of ids stay a few hundred MB at most.
ENCODE_GROUP_CHARS = 4_000_000
REPORTS_DIR = ".reports"
# A file's bad rows are counted; this many of them are named in its report line and in prepared.json.
BAD_ROWS_NAMED = 3
# The summary names this many of the files that held empty documents.
FILES_NAMED = 3
EMPTY_DOCUMENTS_ARE = "empty or whitespace-only document(s)"
EMPTY_DOCUMENTS = f"{EMPTY_DOCUMENTS_ARE} left out"


class TokenizeRecipe(DataChunkRecipe):
    """A DataChunkRecipe whose items are raw files and whose output is EOS-separated token arrays.

    Subclasses implement `find_inputs(input_dir)` (the sorted file list) and `read_documents(path)`
    (lists of texts, raising BadFileError for a bad file). While reading, a subclass may count the rows
    its filter drops (`_skipped_rows`, described by `filtered_rows`), the bad rows it leaves out
    (`skip_bad_rows`), the empty documents it leaves out (`_empty_documents`) and the documents it holds out for
    a validation split (`_held_out`); each file's report and the summary show them."""

    is_generator = True
    name = ""  # recorded in prepared.json as the recipe that wrote the directory
    filtered_rows = "rows left out by the recipe's filter"  # after their count: which rows, and why

    def __init__(self, tokenizer_path: Union[str, Path], chunk_size: int, num_threads: int = 1) -> None:
        check_chunk_size(chunk_size)
        super().__init__(chunk_size=chunk_size)
        self.tokenizer_path = str(tokenizer_path)
        self.num_threads = num_threads
        self.report_dir: Optional[str] = None  # set by run_recipe
        self._tokenizer: Optional[Tokenizer] = None
        self._skipped_rows = 0  # rows of the current file that the recipe's filter dropped
        self._empty_documents = 0  # documents of the current file left out for holding no text
        self._bad_rows = 0  # rows of the current file left out as bad (invalid JSON, not UTF-8, ...)
        self._bad_rows_named: List[str] = []  # where and why, for the first BAD_ROWS_NAMED reports
        self._bad_rows_more = 0  # reports of bad rows beyond those
        self._held_out = 0  # documents of the current file held out for the validation split
        self.first_files: Optional[int] = None  # only the first this many files (fast_dev_run; set by run_recipe)
        self.inputs: Optional[List[str]] = None  # what find_inputs found, before litdata starts (set by run_recipe)

    @property
    def tokenizer(self) -> Tokenizer:
        # loaded in the worker process: the recipe travels to spawned workers by pickling
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.tokenizer_path, "--tokenizer_path")
        return self._tokenizer

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_tokenizer"] = None
        state["inputs"] = None  # the workers get their files from litdata
        return state

    def find_inputs(self, input_dir: str) -> List[str]:
        raise NotImplementedError

    def prepare_structure(self, input_dir: Optional[str]) -> List[str]:
        files = self.inputs if self.inputs is not None else self.find_inputs(input_dir)
        return files[: self.first_files] if self.first_files else files

    def read_documents(self, path: str) -> Iterator[List[str]]:
        raise NotImplementedError

    def skip_bad_rows(self, rows: int, reason: str) -> None:
        """Count `rows` bad rows of the current file, left out; `reason` says where and why."""
        self._bad_rows += rows
        if len(self._bad_rows_named) < BAD_ROWS_NAMED:
            self._bad_rows_named.append(reason)
        else:
            self._bad_rows_more += 1

    def tokenize(self, texts: List[str]) -> Iterator[np.ndarray]:
        """Token arrays (each at most `chunk_size` tokens) of `texts`, every document followed by EOS."""
        dtype = token_dtype(self.tokenizer.vocab_size)
        start = 0
        while start < len(texts):
            end, chars = start, 0
            while end < len(texts) and (end == start or chars < ENCODE_GROUP_CHARS):
                chars += len(texts[end])
                end += 1
            ids = self.tokenizer.encode_batch(texts[start:end], bos=False, eos=True, num_threads=self.num_threads)
            count = sum(len(x) for x in ids)
            tokens = np.fromiter(itertools.chain.from_iterable(ids), dtype=dtype, count=count)
            for offset in range(0, count, self.chunk_size):
                yield tokens[offset : offset + self.chunk_size]
            start = end

    def prepare_item(self, path: str) -> Iterator[np.ndarray]:
        record = file_record(path)
        self._skipped_rows = self._empty_documents = self._bad_rows = self._bad_rows_more = self._held_out = 0
        self._bad_rows_named = []
        try:
            for texts in self.read_documents(path):
                record["documents"] += len(texts)
                for tokens in self.tokenize(texts):
                    record["tokens"] += len(tokens)
                    yield tokens
        except BadFileError as err:
            # partial: the documents read before the damage are kept, in the training split or held out
            record["status"] = "partial" if record["documents"] or self._held_out else "skipped"
            record["reason"] = err.reason
        record.update(skipped_rows=self._skipped_rows, empty_documents=self._empty_documents, bad_rows=self._bad_rows,
                      bad_rows_named=self._bad_rows_named, bad_rows_more=self._bad_rows_more, held_out=self._held_out)
        self._write_report(record)

    def _write_report(self, record: dict) -> None:
        held_out = f", {record['held_out']} held out for validation" if record["held_out"] else ""
        if record["status"] == "ok":
            line = f"{record['path']}: {record['documents']} documents, {record['tokens']} tokens{held_out}"
        elif record["status"] == "skipped":
            line = f"SKIPPED {record['path']}: {record['reason']}"
        else:
            line = f"PARTIAL {record['path']}: {record['reason']} ({record['documents']} documents kept{held_out})"
        if record["skipped_rows"]:
            line += f"; {record['skipped_rows']} {self.filtered_rows}"
        # unless the reason counts them: that of a file with no usable document does (TextRecipe's), not that of one
        # broken off after blank documents alone
        empty = record["empty_documents"]
        if empty and f"{empty} {EMPTY_DOCUMENTS_ARE}" not in record.get("reason", ""):
            line += f"; {empty} {EMPTY_DOCUMENTS}"
        if record["bad_rows"]:
            line += f"; {bad_rows_text(record)}"
        stream = sys.stderr if record["status"] != "ok" or record["bad_rows"] else sys.stdout
        print(on_a_line_of_its_own(stream) + line, file=stream, flush=True)
        if self.report_dir is not None:
            with open(os.path.join(self.report_dir, f"worker-{os.getpid()}.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < SMALLEST_CHUNK:
        raise InvalidValue(f"--chunk_size {chunk_size}: expected at least {SMALLEST_CHUNK} tokens per chunk file (pretrain "
                           f"reads each sample, train.max_seq_length + 1 tokens, from within one chunk file)")


def check_num_workers(num_workers: Optional[int]) -> None:
    if num_workers is not None and num_workers < 0:
        raise InvalidValue(f"--num_workers {num_workers}: expected a number of worker processes (0 or none given: one "
                           f"per CPU core)")


def check_output_dir_is_free(output_dir: Path, tokenizer_path: Union[str, Path]) -> None:
    """`check_empty_output_dir`, never overwritten: where --output_dir holds prepared data (prepare_text's in train/),
    the refusal names the tokenizer that made it beside this run's, so a directory being prepared again with another
    tokenizer is seen to be so (the other directories of its run hold the ids of the first one)."""
    try:
        check_empty_output_dir(output_dir)
    except AlreadyExists as refused:
        held = next((d / PREPARED_INFO_FILE for d in (output_dir, output_dir / "train") if (d / PREPARED_INFO_FILE).is_file()), None)
        try:
            info = json.loads(held.read_text(encoding="utf-8")) if held else None
            ours = Tokenizer(tokenizer_path, "--tokenizer_path").record() if info else None
        except (OSError, ValueError, UserError):  # only what the line says of it is lost: the refusal stands
            info = None
        if not isinstance(info, dict) or not tokenizer_identity(info)[1]:
            raise
        this = ("the same tokenizer" if tokenizer_identity(info) == tokenizer_identity({"tokenizer": ours})
                else describe_tokenizer({"tokenizer": ours}))
        raise AlreadyExists(
            f"Output directory {output_dir} exists and is not empty: it holds data prepared with the tokenizer "
            f"{describe_tokenizer(info)}{'' if held.parent == output_dir else f' (in {held.parent.name}/)'}, and this run's "
            f"--tokenizer_path is {this}; "
            "delete it to prepare it again, or pick another") from None


def check_fast_dev_run(fast_dev_run: Union[bool, int]) -> None:
    if not isinstance(fast_dev_run, bool) and fast_dev_run < 0:
        raise InvalidValue(f"--fast_dev_run {fast_dev_run}: expected true (the first 10 files), a number of files to read "
                           f"(the first ones, sorted by path) or false (0: every file)")


def on_a_line_of_its_own(stream) -> str:
    """What a worker's line to `stream` starts with, so that it does not run into litdata's progress bar. The bar
    is drawn on stderr, each update over the last after a carriage return, with no newline until it ends: on a
    terminal the line erases it (the next update draws it again below); where `stream` goes to the same file as the
    bar, the line starts a new line."""
    if stream.isatty():
        return "\r\033[K"
    try:
        here, bar = os.fstat(stream.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # a stream of no file (captured in memory)
        return "\n" if stream is sys.stderr else ""
    return "\n" if (here.st_dev, here.st_ino) == (bar.st_dev, bar.st_ino) else ""


def file_record(path: str, documents: int = 0, tokens: int = 0) -> dict:
    """What the report says of one input file (the counts the summary adds up); a recipe fills it in."""
    return {"path": path, "status": "ok", "documents": documents, "skipped_rows": 0, "empty_documents": 0, "tokens": tokens,
            "bad_rows": 0, "bad_rows_named": [], "bad_rows_more": 0, "held_out": 0}


class InterruptibleDataProcessor(DataProcessor):
    """litdata's DataProcessor answers Ctrl-C (SIGINT) with `os._exit(0)`: the job ends with status 0,
    as if it had succeeded, and nothing after it runs; SIGTERM (`kill`, `timeout`, a scheduler) it leaves to the
    default action, which ends this process alone and leaves the workers running. Here both stop the workers and
    raise KeyboardInterrupt, so the caller cleans up and the process exits with an error."""

    def run(self, data_recipe: DataChunkRecipe) -> None:
        self._main_pid = os.getpid()
        signal.signal(signal.SIGTERM, self._signal_handler)  # litdata's run sets this handler for SIGINT
        try:
            super().run(data_recipe)
        except KeyboardInterrupt:
            # litdata's progress bar, left open by the interruption, ends its line now: the line that says the run
            # was stopped starts a line of its own, and no bar is drawn again after it when the bar is freed at exit
            from tqdm import tqdm

            for bar in list(tqdm._instances):
                bar.close()
            raise

    def _signal_handler(self, signum, frame) -> None:
        if os.getpid() != self._main_pid:
            # a worker, forked with this handler, reached by a signal to the whole job: the main process stops it
            os._exit(128 + signum)
        for stop_queue in self.stop_queues:
            stop_queue.put(None)
        for worker in self.workers:
            worker.terminate()
        for worker in self.workers:
            worker.join(5)
        raise KeyboardInterrupt("" if signum == signal.SIGINT else signal.Signals(signum).name)

    def check_workers_finished(self, output_dir: Path) -> None:
        """A worker that ended early (killed: the out-of-memory killer sends SIGKILL) leaves its remaining files
        unread and the chunk it was filling unwritten, while litdata's run ends as if all went well."""
        failed = [worker.exitcode for worker in self.workers if worker.exitcode != 0]
        if failed:
            how = ", ".join(f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                            for code in failed)
            raise UserError(
                f"{len(failed)} of the {len(self.workers)} worker processes ended before finishing their files ({how}; "
                f"the out-of-memory killer sends SIGKILL): their files' tokens would be missing, so {output_dir} was not "
                f"written; run again, with fewer --num_workers if memory is short"
            )


def _read_reports(report_dir: Path) -> List[dict]:
    records = []
    for path in sorted(report_dir.glob("*.jsonl")):
        records.extend(json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line)
    return sorted(records, key=lambda r: r["path"])


def bad_rows_text(record: dict) -> str:
    """"3 bad rows left out: line 4: invalid JSON ...; line 9: ..." for a file's record."""
    more = f"; and {record['bad_rows_more']} more" if record["bad_rows_more"] else ""
    return f"{record['bad_rows']} bad row(s) left out: " + "; ".join(record["bad_rows_named"]) + more


def summarize(records: List[dict], filtered_rows: str = "") -> dict:
    """The counts of the file records, added up; `filtered_rows`: the recipe's description of its skipped rows."""
    bad = [r for r in records if r["status"] != "ok"]
    return {
        "files": len(records),
        # a partial file is read up to its damage: its documents before it are kept
        "files_read": sum(r["status"] != "skipped" for r in records),
        "files_partial": sum(r["status"] == "partial" for r in records),
        "documents": sum(r["documents"] for r in records),
        "skipped_rows": sum(r["skipped_rows"] for r in records),
        "skipped_rows_are": filtered_rows,
        "files_with_skipped_rows": sum(1 for r in records if r["skipped_rows"]),
        "empty_documents": sum(r["empty_documents"] for r in records),
        "files_with_empty_documents": [{"path": r["path"], "empty_documents": r["empty_documents"]}
                                       for r in records if r["empty_documents"]],
        "tokens": sum(r["tokens"] for r in records),
        "held_out": sum(r["held_out"] for r in records),
        "bad_files": [{"path": r["path"], "status": r["status"], "reason": r["reason"]} for r in bad],
        "bad_rows": sum(r["bad_rows"] for r in records),
        "files_with_bad_rows": [
            {key: r[key] for key in ("path", "bad_rows", "bad_rows_named", "bad_rows_more")}
            for r in records if r["bad_rows"]
        ],
    }


def format_summary(summary: dict, heading: str, seconds: float) -> str:
    """`heading` (e.g. "Prepared <output_dir>"), then the counts, the rows and documents left out and each bad file."""
    partial = f" ({summary['files_partial']} partial)" if summary["files_partial"] else ""
    lines = [
        f"{heading}: {summary['files_read']}/{summary['files']} files{partial}, {summary['documents']} documents,"
        f" {summary['tokens']} tokens in {seconds:.1f}s ({summary['tokens'] / max(seconds, 1e-9):,.0f} tokens/s)"
    ]
    if summary["skipped_rows"]:
        lines.append(f"{summary['skipped_rows']} {summary['skipped_rows_are'] or TokenizeRecipe.filtered_rows}, in "
                     f"{summary['files_with_skipped_rows']} of the {summary['files']} files")
    if summary["empty_documents"]:
        files = summary["files_with_empty_documents"]
        named = ", ".join(f"{f['path']} ({f['empty_documents']})" for f in files[:FILES_NAMED])
        lines.append(f"{summary['empty_documents']} {EMPTY_DOCUMENTS}, in {len(files)} file(s): {named}"
                     + (f", and {len(files) - FILES_NAMED} more" if len(files) > FILES_NAMED else ""))
    if summary["held_out"]:
        lines.append(f"{summary['held_out']} documents held out for the validation split")
    if summary["bad_files"]:
        lines.append(f"{len(summary['bad_files'])} bad file(s):")
        lines += [f"  {b['status']}: {b['path']}: {b['reason']}" for b in summary["bad_files"]]
    if summary["bad_rows"]:
        lines.append(f"{summary['bad_rows']} bad row(s) left out, in {len(summary['files_with_bad_rows'])} file(s):")
        lines += [f"  {f['path']}: {bad_rows_text(f)}" for f in summary["files_with_bad_rows"]]
    return "\n".join(lines)


def require_flags(**values) -> None:
    # the command-line functions take these as --flags (defaults None) rather than positionals
    missing = [f"--{name}" for name, value in values.items() if value is None]
    if missing:
        raise InvalidValue(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required")


def default_num_workers() -> int:
    """One worker per CPU core this process may use (a scheduler's allocation or taskset: not the whole machine's)."""
    return usable_cpu_cores()


def run_recipe(
    recipe: TokenizeRecipe,
    input_dir: Union[str, Path],
    output_dir: Union[str, Path],
    num_workers: Optional[int] = None,
    fast_dev_run: Union[bool, int] = False,
    info: Optional[dict] = None,
    shown_as: Optional[Path] = None,
    tokenizer_shown_as: Optional[Path] = None,
) -> dict:
    """Run `recipe` over `input_dir` with litdata's DataProcessor; return the summary.

    Chunks are written into a hidden sibling `.tmp-<name>-<id>` of `output_dir`; `prepared.json`
    (tokenizer identity, summary, and the fields of `info`) is written last and the directory renamed to
    `output_dir`, so an interrupted run leaves no directory that `check_prepared_dir` accepts. Messages
    name the output `shown_as` when given (where a caller moves `output_dir` to afterwards), and prepared.json the
    tokenizer `tokenizer_shown_as` (where a caller moves it to afterwards)."""
    input_dir, output_dir = Path(input_dir).resolve(), Path(output_dir).resolve()
    check_input_dir(input_dir)
    check_output_dir_is_free(output_dir, recipe.tokenizer_path)
    note_killed_preparations(output_dir)
    check_num_workers(num_workers)
    check_fast_dev_run(fast_dev_run)
    tokenizer = Tokenizer(recipe.tokenizer_path, "--tokenizer_path")
    if tokenizer.eos_id is None:  # found here, not in a worker, where it would end the job in litdata's traceback
        raise InvalidValue(
            f"--tokenizer_path {recipe.tokenizer_path}: {tokenizer.model_path} defines no end-of-text (EOS) token, which "
            "follows every document (the trainer reads documents joined by it); give a tokenizer that has one, or name "
            "one of its pieces as eos_token in a tokenizer_config.json beside it"
        )
    num_workers = num_workers or default_num_workers()
    # the first files in sorted order, taken here: litdata's own fast_dev_run keeps that many files per
    # worker (not the first ones once there are several workers) and reads True as 1
    fast_dev_run = 10 if fast_dev_run is True else int(fast_dev_run or 0)
    recipe.first_files = fast_dev_run or None
    recipe.num_threads = max(1, usable_cpu_cores() // num_workers)
    # before litdata's processor starts (and prints its set-up lines): an input without the recipe's files fails here
    recipe.inputs = recipe.find_inputs(str(input_dir))
    found = len(recipe.inputs)
    if fast_dev_run:
        print(f"fast_dev_run: the first {min(fast_dev_run, found)} of the {found} input files (sorted by path)", flush=True)

    info = {"recipe": recipe.name or type(recipe).__name__, "input_dir": str(input_dir), "fast_dev_run": fast_dev_run,
            "chunk_size": recipe.chunk_size, **(info or {})}
    if fast_dev_run:  # so a run on the slice can say how much of the input it misses
        info["input_files"] = found
    with created_dir(output_dir.parent), sigterm_interrupts():
        return _run_into(recipe, input_dir, output_dir, tokenizer, num_workers, fast_dev_run, info, shown_as or output_dir,
                         tokenizer_shown_as)


def stage_id(output_dir: Path) -> str:
    """`<output_dir's name>-<8 hex digits>`: what names the hidden working directories of one run beside output_dir,
    `.tmp-<id>` (its output) and `.tmp-cache-<id>` (litdata's cache), so that no two runs share one."""
    return f"{output_dir.name}-{uuid.uuid4().hex[:8]}"


def note_killed_preparations(output_dir: Path) -> None:
    """Name the working directories that earlier runs into `output_dir` left beside it: a run killed outright (SIGKILL,
    the OOM killer, a lost node) removes none. Nothing reads them, but each keeps up to a whole output's disk space,
    hidden, and every run killed so adds one."""
    hex_digits = "[0-9a-f]" * 8
    for prefix in (".tmp-", ".tmp-cache-"):
        for path in sorted(output_dir.parent.glob(f"{prefix}{glob.escape(output_dir.name)}-{hex_digits}")):
            print(f"Note: {path} was left by a preparation of {output_dir} that was killed (or is running now): "
                  "delete it to free its space once none is running", flush=True)


def _run_into(recipe: TokenizeRecipe, input_dir: Path, output_dir: Path, tokenizer: Tokenizer, num_workers: int,
              fast_dev_run: int, info: dict, shown_as: Path, tokenizer_shown_as: Optional[Path]) -> dict:
    run_id = stage_id(output_dir)
    tmp_dir = output_dir.parent / f".tmp-{run_id}"
    cache_dir = output_dir.parent / f".tmp-cache-{run_id}"
    report_dir = tmp_dir / REPORTS_DIR
    report_dir.mkdir(parents=True)
    recipe.report_dir = str(report_dir)

    # DataProcessor wipes its cache folders (default /tmp/chunks, shared by every run on the machine),
    # forces the multiprocessing start method and takes over SIGINT: keep all three to this run.
    cache_folders = {"DATA_OPTIMIZER_CACHE_FOLDER": str(cache_dir / "chunks"),
                     "DATA_OPTIMIZER_DATA_CACHE_FOLDER": str(cache_dir / "data")}
    saved_start_method = multiprocessing.get_start_method(allow_none=True)
    saved_signals = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    start = time.perf_counter()
    try:
        with environment_variables(cache_folders):
            processor = InterruptibleDataProcessor(
                input_dir=str(input_dir),
                output_dir=str(tmp_dir),
                num_workers=num_workers,
                # the recipe lists only the first fast_dev_run files, so litdata's own cut (as many per worker)
                # keeps them all; given, its log line shows the value asked for (left out, litdata would read
                # an environment variable whose default is 1 file)
                fast_dev_run=fast_dev_run or False,
                item_loader=TokensLoader(),
                reorder_files=False,  # keep the sorted file order
                # litdata starts its workers with spawn by default: a new Python importing torch, ~3 s each (most
                # of building the sample corpus). Forked, they start at once; macOS keeps spawn (fork is unsafe there)
                start_method="fork" if sys.platform == "linux" else None,
            )
            processor.run(recipe)
        processor.check_workers_finished(shown_as)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    finally:
        multiprocessing.set_start_method(saved_start_method, force=True)
        for signum, handler in saved_signals.items():
            signal.signal(signum, handler)
        shutil.rmtree(cache_dir, ignore_errors=True)
    seconds = time.perf_counter() - start

    summary = summarize(_read_reports(report_dir), recipe.filtered_rows)
    shutil.rmtree(report_dir)
    if summary["tokens"] == 0:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise UserError(
            f"No tokens were produced from {input_dir}: every file was bad or empty, so {shown_as} was not written\n"
            + format_summary(summary, f"Read {input_dir}", seconds)
        )
    write_prepared_info(tmp_dir, tokenizer=tokenizer, tokenizer_shown_as=tokenizer_shown_as, **info, summary=summary)
    check_prepared_dir(tmp_dir, tokenizer)
    if output_dir.exists() and any(output_dir.iterdir()):  # another run finished first
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise AlreadyExists(f"Output directory {output_dir} was written by another run while this one ran")
    if output_dir.exists():
        output_dir.rmdir()
    os.rename(tmp_dir, output_dir)
    print(format_summary(summary, f"Prepared {shown_as}", seconds), flush=True)
    return summary
