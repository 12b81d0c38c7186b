"""Readers for the raw corpora: SlimPajama `*.jsonl.zst`, Starcoder `*.parquet`, plain `*.txt`.

Every reader raises `BadFileError(path, reason)` for a file it cannot use, so a preprocessor can
report the file and go on with the others.
"""
import json
from pathlib import Path
from typing import Iterator, List, Optional, Tuple, Union


class BadFileError(Exception):
    def __init__(self, path: Union[str, Path], reason: str, rows_done: int = 0) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason
        # rows already handed out before the error (a parquet file is streamed, so a late error is
        # found after earlier batches were used)
        self.rows_done = rows_done


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def find_files(input_dir: Union[str, Path], suffix: str) -> List[Path]:
    """All files under `input_dir` (recursively) whose name ends with `suffix`, sorted."""
    input_dir = Path(input_dir)
    if not input_dir.is_dir():
        raise FileNotFoundError(f"Input directory {str(input_dir)!r} does not exist")
    files = sorted(p for p in input_dir.rglob(f"*{suffix}") if p.is_file())
    if not files:
        raise FileNotFoundError(f"No *{suffix} files found under {input_dir} (searched recursively)")
    return files


def decompress_zstd(path: Union[str, Path]) -> bytes:
    """The whole decompressed content of a (possibly multi-frame) .zst file; truncation is an error."""
    import zstandard

    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise BadFileError(path, f"cannot read: {err.strerror or err}") from None
    if not raw:
        raise BadFileError(path, "empty file")
    pieces = []
    rest = raw
    decompressor = zstandard.ZstdDecompressor()
    try:
        while rest:
            frame = decompressor.decompressobj()
            pieces.append(frame.decompress(rest))
            if not frame.eof:
                raise BadFileError(path, "corrupt zstd: stream is truncated (the last frame never ends)")
            rest = frame.unused_data
    except zstandard.ZstdError as err:
        raise BadFileError(path, f"corrupt zstd: {err}") from None
    return b"".join(pieces)


def read_slimpajama_file(path: Union[str, Path]) -> List[Tuple[str, Optional[str]]]:
    """(text, meta.redpajama_set_name) for every JSON line of a SlimPajama `.jsonl.zst` file.

    The whole file is checked before anything is returned, so a bad file contributes nothing."""
    data = decompress_zstd(path)
    try:
        content = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadFileError(path, f"not UTF-8 text after decompression: {err}") from None
    rows = []
    for line_number, line in enumerate(content.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise BadFileError(path, f"invalid JSON on line {line_number}: {err.msg} (column {err.colno})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise BadFileError(path, f"line {line_number} has no string field 'text'")
        try:  # JSON escapes can spell half a surrogate pair ("\ud83d"), which no tokenizer can encode
            row["text"].encode("utf-8")
        except UnicodeEncodeError as err:
            raise BadFileError(
                path, f"line {line_number}: field 'text' is not valid Unicode ({err.reason} at character {err.start})"
            ) from None
        meta = row.get("meta")
        set_name = meta.get("redpajama_set_name") if isinstance(meta, dict) else None
        rows.append((row["text"], set_name))
    if not rows:
        raise BadFileError(path, "empty file: no JSON lines")
    return rows


def open_parquet(path: Union[str, Path], column: str = "content"):
    """Open a parquet file and check that it has a string column `column` and at least one row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if Path(path).stat().st_size == 0:
            raise BadFileError(path, "empty file")
        parquet_file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise BadFileError(path, f"unreadable parquet: {_one_line(err)}") from None
    schema = parquet_file.schema_arrow
    if column not in schema.names:
        raise BadFileError(path, f"missing column {column!r} (columns: {', '.join(schema.names)})")
    column_type = schema.field(column).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise BadFileError(path, f"column {column!r} has type {column_type}, expected string")
    if parquet_file.metadata.num_rows == 0:
        raise BadFileError(path, "empty file: 0 rows")
    return parquet_file


def iter_parquet_texts(
    path: Union[str, Path], column: str = "content", batch_size: int = 8192
) -> Iterator[List[str]]:
    """Lists of up to `batch_size` non-null strings of `column`, read batch by batch."""
    import pyarrow as pa

    parquet_file = open_parquet(path, column)
    rows_done = 0
    try:
        # row group by row group, so that a damaged row group costs only itself and the ones after it
        for row_group in range(parquet_file.num_row_groups):
            for batch in parquet_file.iter_batches(batch_size=batch_size, row_groups=[row_group], columns=[column]):
                texts = [text for text in batch.column(0).to_pylist() if text is not None]
                rows_done += batch.num_rows
                yield texts
    except (pa.ArrowException, OSError) as err:
        raise BadFileError(path, f"unreadable parquet after {rows_done} rows: {_one_line(err)}", rows_done) from None
    except UnicodeDecodeError as err:  # a string column whose bytes are not UTF-8 (Arrow does not check on read)
        raise BadFileError(
            path, f"unreadable parquet after {rows_done} rows: column {column!r} is not UTF-8 ({err.reason})", rows_done
        ) from None


def iter_text_file_lines(path: Union[str, Path]) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from f
