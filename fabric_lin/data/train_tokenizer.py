"""`fabric-lin train_tokenizer`: train a SentencePiece BPE tokenizer on a raw text corpus.

It reads what `fabric-lin prepare_text` reads, with the same reader (`fabric_lin.data.raw_files`): the files under
`--input_dir` that match `--pattern` and end in .jsonl, .jsonl.zst, .jsonl.gz, .json.gz (field `--text_key` of each
JSON line), .parquet (column `--text_key`) or .txt (a whole file). The settings follow Llama's tokenizer so that
code survives a round trip: no normalization, whitespace kept, digits split, byte fallback for unseen characters.

A BPE vocabulary is made of the merges its input allows: about 7,400 pieces from 100 KB of English prose, 14,500
from 300 KB, 29,000 from 1 MB; 32,000 from about 1.5 MB (the Python standard library's docstrings). A
`--vocab_size` the input cannot fill is refused with the largest that it can."""
import io
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple

from fabric_lin.cpu_cores import usable_cpu_cores
from fabric_lin.data.raw_files import BadFileError, iter_text_documents, text_files_to_read
from fabric_lin.data.tokenizer import TOKENIZER_FILES, Tokenizer
from fabric_lin.errors import AlreadyExists, InvalidValue, UserError
from fabric_lin.files import (
    atomic_write,
    check_dir_can_be_made,
    check_outside_checkpoint_or_data,
    created_dir,
    files_taken_back_on_failure,
)

MAX_SENTENCES = 5_000_000
MAX_SENTENCE_LENGTH = 4192
CHARACTER_COVERAGE = 0.9995
SEED = 42
MAX_THREADS = 1024  # the most threads SentencePiece's trainer takes
MAX_TRAINER_INT = 2**31 - 1  # the trainer's settings are 32-bit ints: a larger one is a ValueError from its parser
# the pieces every tokenizer written here has, whatever its input: <unk>, <s>, </s> and the 256 byte-fallback pieces
FIXED_PIECES = 3 + 256


class ReadCounts:
    """What reading the input files came to: the files used in full or in part, and what was left out."""

    def __init__(self) -> None:
        self.files = self.skipped = self.partial = self.bad_rows = self.empty_documents = 0

    def __str__(self) -> str:
        parts = [f"{self.files - self.skipped} file(s)"]
        if self.skipped:
            parts.append(f"{self.skipped} unreadable file(s) skipped")
        if self.partial:
            parts.append(f"{self.partial} read up to their damage")
        if self.bad_rows:
            parts.append(f"{self.bad_rows} bad row(s) left out")
        if self.empty_documents:
            parts.append(f"{self.empty_documents} empty or whitespace-only document(s) left out")
        return "; ".join(parts)


def why_no_text(counts: ReadCounts) -> str:
    """What the files read came to, where none gave a line of text (each skipped file and bad row was named on stderr)."""
    parts = [f"{counts.skipped} skipped (each named above, with why)"] if counts.skipped else []
    if counts.bad_rows:
        parts.append(f"{counts.bad_rows} bad row(s) left out (named above)")
    if counts.empty_documents:
        parts.append(f"{counts.empty_documents} empty or whitespace-only document(s) left out")
    return "; ".join(parts) or "their documents hold no line of text"


def iter_documents(files: List[Path], text_key: str, counts: ReadCounts) -> Iterator[str]:
    """The documents of `files`; a file or row that cannot be read is reported on stderr, counted in `counts` and
    passed over (a file damaged part of the way gives its documents before the damage)."""
    for path in files:
        counts.files += 1
        documents, bad_rows, named = 0, 0, []  # named: where and why, for the first three bad rows
        try:
            for batch in iter_text_documents(path, text_key):
                documents += len(batch.texts)
                bad_rows += sum(rows for rows, _ in batch.bad)
                named += [reason for _, reason in batch.bad][: 3 - len(named)]
                counts.empty_documents += len(batch.empty)
                yield from batch.texts
        except BadFileError as err:
            if documents:
                counts.partial += 1
                print(f"PARTIAL {err.path}: {err.reason} ({documents} documents kept)", file=sys.stderr, flush=True)
            else:
                counts.skipped += 1
                print(f"SKIPPED {err.path}: {err.reason}", file=sys.stderr, flush=True)
        if bad_rows:
            counts.bad_rows += bad_rows
            more = f"; and {bad_rows - len(named)} more" if bad_rows > len(named) else ""
            print(f"{path}: {bad_rows} bad row(s) left out: {'; '.join(named)}{more}", file=sys.stderr, flush=True)


def sample_sentences(documents: Iterable[str], max_sentences: int = MAX_SENTENCES,
                     max_sentence_length: int = MAX_SENTENCE_LENGTH, seed: int = SEED) -> Tuple[List[str], int]:
    """Up to `max_sentences` of the documents' lines (a uniform reservoir sample: a fixed memory bound whatever the
    corpus size, and the same for a seed), each cut to `max_sentence_length` characters; and how many there were.

    SentencePiece learns from "sentences"; lines of a document are natural ones (newlines themselves are then
    encoded through byte fallback, as in Llama's tokenizer)."""
    rng = random.Random(seed)
    sample: List[str] = []
    seen = 0
    for document in documents:
        for line in document.split("\n"):
            if not line.strip():
                continue
            seen += 1
            if len(sample) < max_sentences:
                sample.append(line[:max_sentence_length])
            else:
                j = rng.randrange(seen)
                if j < max_sentences:
                    sample[j] = line[:max_sentence_length]
    return sample, seen


def write_tokenizer(sentences: List[str], output_dir: Path, vocab_size: int, source: str = "the input",
                    max_sentence_length: int = MAX_SENTENCE_LENGTH, character_coverage: float = CHARACTER_COVERAGE,
                    num_threads: Optional[int] = None) -> Path:
    """Train the BPE tokenizer on `sentences` and write output_dir/tokenizer.model and tokenizer_config.json. A
    vocabulary size that `sentences` (read from `source`) cannot give is refused in one line that says which can."""
    import sentencepiece as spm

    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=model,
            model_type="bpe",
            vocab_size=vocab_size,
            character_coverage=character_coverage,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            max_sentence_length=max_sentence_length * 4,  # the trainer counts bytes
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            num_threads=num_threads or min(usable_cpu_cores(), MAX_THREADS),
            minloglevel=2,
        )
    except RuntimeError as err:
        refusal = vocab_size_error(err, vocab_size, f"the {len(sentences)} lines read from {source}")
        if refusal is None:
            raise
        raise refusal from None
    output_dir = Path(output_dir)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}
    # each file whole or not there (a directory with a cut tokenizer.model would load and encode wrongly), and both
    # or neither: a tokenizer_config.json alone would stop the same command run again; the directories made for
    # them go too
    with created_dir(output_dir), files_taken_back_on_failure(output_dir):
        atomic_write(output_dir / "tokenizer_config.json",
                     lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
        atomic_write(output_dir / "tokenizer.model", lambda tmp: Path(tmp).write_bytes(model.getvalue()))
    print(f"Wrote {output_dir / 'tokenizer.model'} and tokenizer_config.json", flush=True)
    return output_dir


# SentencePiece's refusals of a vocabulary size (the size that works in the pattern's group), and what is said instead
VOCAB_SIZE_REFUSALS = (
    (r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)",
     "--vocab_size {given}: {source} make at most {size} pieces; give --vocab_size {size} or less, or more text "
     "(about 1.5 MB of prose for 32,000 pieces)"),
    (r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)",
     "--vocab_size {given}: this input needs at least {size} pieces (the 256 byte-fallback pieces, <unk>, <s>, </s> "
     "and the characters that --character_coverage keeps); give --vocab_size {size} or more, or a lower "
     "--character_coverage"),
)


def vocab_size_error(err: RuntimeError, vocab_size: int, source: str) -> Optional[InvalidValue]:
    """SentencePiece's refusal of a vocabulary size, as one line with the size that works; None for another error."""
    for pattern, message in VOCAB_SIZE_REFUSALS:
        found = re.search(pattern, str(err))
        if found:
            return InvalidValue(message.format(given=vocab_size, source=source, size=int(found.group(1))))
    return None


def check_settings(vocab_size: int, max_files: Optional[int], max_sentences: int, max_sentence_length: int,
                   character_coverage: float, num_threads: Optional[int] = None) -> None:
    """Refuse, before any file is read, the values the sampling or SentencePiece's trainer cannot take (its own
    checks end in a C++ assertion, or in its parser's error for a number past 32 bits)."""
    fixed = " (the 256 byte-fallback pieces, <unk>, <s> and </s>)"
    for name, value, least, why in (("vocab_size", vocab_size, FIXED_PIECES, fixed), ("max_files", max_files, 1, ""),
                                    ("max_sentences", max_sentences, 1, ""),
                                    ("max_sentence_length", max_sentence_length, 10, "")):
        if value is not None and value < least:
            raise InvalidValue(f"--{name} must be at least {least}{why}, got {value}")
    if vocab_size > MAX_TRAINER_INT:
        raise InvalidValue(f"--vocab_size must be at most {MAX_TRAINER_INT} (SentencePiece's limit), got {vocab_size}")
    if max_sentence_length > MAX_TRAINER_INT // 4:  # the trainer is given it in bytes (write_tokenizer)
        raise InvalidValue(f"--max_sentence_length must be at most {MAX_TRAINER_INT // 4} (SentencePiece's limit of "
                           f"2**31 - 1 bytes, 4 per character), got {max_sentence_length}")
    if not 0.98 <= character_coverage <= 1.0:
        raise InvalidValue(f"--character_coverage must be in [0.98, 1] (SentencePiece's range; the rest of the characters "
                           f"use byte fallback), got {character_coverage}")
    if num_threads is not None and not 0 <= num_threads <= MAX_THREADS:
        raise InvalidValue(f"--num_threads must be 0 (every core) or at most {MAX_THREADS} (SentencePiece's limit), got {num_threads}")


def check_output_dir(output_dir: Path) -> None:
    """Refuse a directory that holds a tokenizer already (a tokenizer's, a model's, a prepared data directory's):
    what was made with it reads its ids through it, and would read other pieces through a new one. And one inside a
    training checkpoint or prepared data, which would take the tokenizer along when replaced."""
    check_dir_can_be_made(output_dir, "--output_dir")
    check_outside_checkpoint_or_data(output_dir, "--output_dir")
    held = [name for name in TOKENIZER_FILES if (output_dir / name).exists()]
    if not held:
        return
    if held == ["tokenizer_config.json"]:  # written first: a run killed (SIGKILL) before tokenizer.model leaves it
        raise AlreadyExists(
            f"--output_dir {output_dir} holds a tokenizer_config.json without a tokenizer.model (what an interrupted "
            f"train_tokenizer leaves, or another library's tokenizer): write the new one to another --output_dir, or "
            f"delete that tokenizer_config.json first"
        )
    try:
        there = Tokenizer(output_dir).describe()
    except UserError:  # a damaged one
        there = ", ".join(str(output_dir / name) for name in held)
    raise AlreadyExists(
        f"--output_dir {output_dir} holds a tokenizer already: {there}; the data and models made with it read their "
        f"ids through it. Write the new one to another --output_dir, or delete its {' and '.join(held)} first"
    )


def main(
    input_dir: Optional[Path] = None,
    output_dir: Optional[Path] = None,
    text_key: str = "text",
    pattern: str = "**/*",
    vocab_size: int = 32000,
    max_files: Optional[int] = None,
    max_sentences: int = MAX_SENTENCES,
    max_sentence_length: int = MAX_SENTENCE_LENGTH,
    character_coverage: float = CHARACTER_COVERAGE,
    num_threads: Optional[int] = None,
    seed: int = SEED,
) -> Path:
    """Train a SentencePiece BPE tokenizer and write tokenizer.model + tokenizer_config.json.

    Args:
        input_dir: Directory of the corpus (the files prepare_text reads).
        output_dir: Directory to write (usable as `tokenizer_dir` / `--tokenizer_path`); one that holds a tokenizer
            already is refused.
        text_key: The JSON field or parquet column that holds each document's text.
        pattern: Glob, relative to input_dir, of the files to read (default: all, recursively); of those, the
            ones ending in .jsonl, .jsonl.zst, .jsonl.gz, .json.gz, .parquet or .txt are read.
        vocab_size: Number of pieces, including <unk>, <s>, </s> and the 256 byte-fallback pieces. At most what
            the input allows: about 1.5 MB of prose for 32,000.
        max_files: Read at most this many input files, evenly spread over the sorted list (default: all).
        max_sentences: Lines sampled (uniformly, reservoir) from the inputs for training.
        max_sentence_length: Longer lines are cut to this many characters.
        character_coverage: Share of characters covered by pieces; the rest use byte fallback.
        num_threads: Trainer threads, at most 1024 (default or 0: all cores).
        seed: Seed of the line sampling.
    """
    if input_dir is None or output_dir is None:
        raise InvalidValue("--input_dir and --output_dir are required")
    check_settings(vocab_size=vocab_size, max_files=max_files, max_sentences=max_sentences,
                   max_sentence_length=max_sentence_length, character_coverage=character_coverage, num_threads=num_threads)
    check_output_dir(Path(output_dir))
    files = text_files_to_read(input_dir, pattern)
    if max_files is not None and len(files) > max_files:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    counts = ReadCounts()
    sample, seen = sample_sentences(iter_documents(files, text_key, counts), max_sentences, max_sentence_length, seed)
    if not sample:
        raise InvalidValue(f"No text found in the {len(files)} input file(s) under {input_dir}: {why_no_text(counts)}; "
                           "a tokenizer is trained on the text of its input")
    print(f"Training a {vocab_size}-piece BPE tokenizer on {len(sample)} of {seen} lines from {counts}", flush=True)
    return write_tokenizer(sample, output_dir, vocab_size, source=str(input_dir), max_sentence_length=max_sentence_length,
                           character_coverage=character_coverage, num_threads=num_threads)
