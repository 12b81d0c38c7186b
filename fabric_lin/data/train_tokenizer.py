"""`fabric-lin train_tokenizer`: train a SentencePiece BPE tokenizer on raw corpus files.

Inputs are `*.jsonl.zst` (SlimPajama rows, field `text`), `*.parquet` (column `content`) and `*.txt`
files found recursively. The settings follow Llama's tokenizer so that code survives a round trip:
no normalization, whitespace kept, digits split, byte fallback for unseen characters."""
import io
import json
import random
import sys
from pathlib import Path
from typing import Iterator, List, Optional

from fabric_lin.data.raw_files import (
    BadFileError,
    iter_parquet_texts,
    iter_text_file_lines,
    read_slimpajama_file,
)
from fabric_lin.errors import InvalidValue, MissingFile
from fabric_lin.files import atomic_write

SUFFIXES = (".jsonl.zst", ".parquet", ".txt")


def find_training_files(input_dir: Path) -> List[Path]:
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise MissingFile(f"Input directory {str(input_dir)!r} does not exist")
    files = sorted(p for p in input_dir.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise MissingFile(f"No {', '.join('*' + s for s in SUFFIXES)} files found under {input_dir}")
    return files


def iter_documents(files: List[Path], skipped: List[Path]) -> Iterator[str]:
    """The documents of `files`; a file that cannot be read is reported, added to `skipped` and passed over."""
    for path in files:
        try:
            if path.name.endswith(".jsonl.zst"):
                yield from (text for text, _ in read_slimpajama_file(path))
            elif path.name.endswith(".parquet"):
                for texts in iter_parquet_texts(path):
                    yield from texts
            else:
                yield "".join(iter_text_file_lines(path))
        except BadFileError as err:
            print(f"SKIPPED {err.path}: {err.reason}", file=sys.stderr, flush=True)
            skipped.append(path)


def iter_sentences(files: List[Path], max_sentence_length: int, skipped: List[Path]) -> Iterator[str]:
    # SentencePiece learns from "sentences"; lines of a document are natural ones (newlines themselves
    # are then encoded through byte fallback, as in Llama's tokenizer)
    for document in iter_documents(files, skipped):
        for line in document.split("\n"):
            if line.strip():
                yield line[:max_sentence_length]


def main(
    input_dir: Optional[Path] = None,
    output_dir: Optional[Path] = None,
    vocab_size: int = 32000,
    max_files: Optional[int] = None,
    max_sentences: int = 5_000_000,
    max_sentence_length: int = 4192,
    character_coverage: float = 0.9995,
    num_threads: Optional[int] = None,
    seed: int = 42,
) -> Path:
    """Train a SentencePiece BPE tokenizer and write tokenizer.model + tokenizer_config.json.

    Args:
        input_dir: Directory searched recursively for *.jsonl.zst, *.parquet and *.txt files.
        output_dir: Directory to write (usable as `tokenizer_dir` / `--tokenizer_path`).
        vocab_size: Number of pieces, including <unk>, <s>, </s> and the 256 byte-fallback pieces.
        max_files: Read at most this many input files, evenly spread over the sorted list (default: all).
        max_sentences: Lines sampled (uniformly, reservoir) from the inputs for training.
        max_sentence_length: Longer lines are cut to this many characters.
        character_coverage: Share of characters covered by pieces; the rest use byte fallback.
        num_threads: Trainer threads (default: all cores).
        seed: Seed of the line sampling.
    """
    import os

    import sentencepiece as spm

    if input_dir is None or output_dir is None:
        raise InvalidValue("--input_dir and --output_dir are required")
    files = find_training_files(input_dir)
    if max_files is not None and len(files) > max_files:
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    # reservoir sample: a fixed memory bound whatever the corpus size, and deterministic for a seed
    rng = random.Random(seed)
    sample: List[str] = []
    seen = 0
    skipped: List[Path] = []
    for sentence in iter_sentences(files, max_sentence_length, skipped):
        seen += 1
        if len(sample) < max_sentences:
            sample.append(sentence)
        else:
            j = rng.randrange(seen)
            if j < max_sentences:
                sample[j] = sentence
    read = len(files) - len(skipped)
    unreadable = f" ({len(skipped)} of them unreadable, skipped: see the SKIPPED lines above)" if skipped else ""
    if not sample:
        raise InvalidValue(f"No text found in the {len(files)} input file(s) under {input_dir}{unreadable}")
    print(f"Training a {vocab_size}-piece BPE tokenizer on {len(sample)} of {seen} lines from {read} file(s)"
          + (f"; {len(skipped)} unreadable file(s) skipped" if skipped else ""), flush=True)

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sample),
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
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2,
    )
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}
    # each file whole or not there: a directory with a cut tokenizer.model would load and encode wrongly
    atomic_write(output_dir / "tokenizer_config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    atomic_write(output_dir / "tokenizer.model", lambda tmp: Path(tmp).write_bytes(model.getvalue()))
    print(f"Wrote {output_dir / 'tokenizer.model'} and tokenizer_config.json", flush=True)
    return output_dir
