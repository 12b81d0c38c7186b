"""Readers for the raw corpora: SlimPajama `*.jsonl.zst`, Starcoder `*.parquet`, and any text corpus of JSON
lines, parquet or text files (`text_files_to_read` and `iter_text_documents`, for prepare_text and train_tokenizer).

Every reader raises `BadFileError(path, reason)` for a file it cannot use, so a preprocessor can
report the file and go on with the others.
"""
import codecs
import gzip
import json
import zlib
from pathlib import Path
from typing import Iterator, List, NamedTuple, Optional, Tuple, Union

from fabric_lin.errors import InvalidValue, MissingFile, UserError
from fabric_lin.files import LFS_POINTER_FIX, is_lfs_pointer, json_type, short_list


class BadFileError(UserError):
    """A file a reader cannot use, or cannot read to its end, and why. The reason of one that breaks off says how far it
    was read ("after 7 rows", "after line 12"): the documents before the damage were handed out already."""

    def __init__(self, path: Union[str, Path], reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


# JSON-lines files (plain or compressed) are read this many bytes at a time.
READ_BLOCK_BYTES = 1 << 20


def refuse_lfs_pointer(path: Union[str, Path]) -> None:
    """A clone of a dataset made without Git LFS holds small pointer files where the data should be (the hub's
    SlimPajama and Starcoder are such repositories): refused as what it is, where the readers would call it corrupt
    zstd or parquet, or read a .txt pointer as a document."""
    if is_lfs_pointer(path):
        raise BadFileError(path, f"a Git LFS pointer, not the file's content: {LFS_POINTER_FIX}")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def check_input_dir(input_dir: Path, has_pattern: bool = False) -> None:
    """Refuse an --input_dir that is not a directory: a file of the corpus given for its folder is named as such, with
    the --pattern that reads it alone where the command `has_pattern`."""
    if input_dir.is_file():
        alone = f" --pattern {input_dir.name} to read it alone" if has_pattern else ""
        raise InvalidValue(f"Input directory {str(input_dir)!r} is a file, expected the directory of the input files: "
                           f"give --input_dir {input_dir.parent}{alone}")
    if not input_dir.is_dir():
        raise MissingFile(f"Input directory {str(input_dir)!r} does not exist")


def listed_file(path: Path) -> bool:
    """A file, or a symbolic link to a file that is not there (a dataset whose files were never fetched, e.g. with
    git-annex): the link is kept for its reader to name as unreadable, where leaving it out would go unsaid."""
    return path.is_file() or (path.is_symlink() and not path.exists())


def find_files(input_dir: Union[str, Path], suffix: str) -> List[Path]:
    """All files under `input_dir` (recursively) whose name ends with `suffix`, sorted."""
    input_dir = Path(input_dir)
    check_input_dir(input_dir)
    files = sorted(p for p in input_dir.rglob(f"*{suffix}") if listed_file(p))
    if not files:
        # your own corpus, given to a recipe of SlimPajama's or Starcoder's files
        texts = sorted(str(p.relative_to(input_dir)) for p in input_dir.rglob("*") if p.name.endswith(TEXT_SUFFIXES)
                       and listed_file(p))
        others = (f"; it holds {len(texts)} that fabric-lin prepare_text reads ({short_list(texts, 3)}): give it these"
                  if texts else "")
        raise MissingFile(f"No *{suffix} files found under {input_dir} (searched recursively){others}")
    return files


def iter_zstd(path: Union[str, Path]) -> Iterator[bytes]:
    """The decompressed content of a (possibly multi-frame) .zst file, read READ_BLOCK_BYTES at a time; a frame
    may span reads, and a read may hold the end of one frame and the start of the next. Truncation is an error.

    zstandard's stream_reader ends a truncated stream silently, as if the file were complete, so the
    frames are decoded here and the last one must reach its end."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame = None  # the frame being decoded
    size = 0
    try:
        with open(path, "rb") as f:
            while True:
                data = f.read(READ_BLOCK_BYTES)
                if not data:
                    break
                size += len(data)
                while data:
                    if frame is None:
                        frame = decompressor.decompressobj()
                    out = frame.decompress(data)
                    if out:
                        yield out
                    if frame.eof:  # the rest of the data starts the next frame
                        data, frame = frame.unused_data, None
                    else:
                        data = b""
    except OSError as err:
        raise BadFileError(path, f"cannot read: {err.strerror or err}") from None
    except zstandard.ZstdError as err:
        raise BadFileError(path, f"corrupt zstd: {err}") from None
    if size == 0:
        raise BadFileError(path, "empty file")
    if frame is not None:
        raise BadFileError(path, "corrupt zstd: stream is truncated (the last frame never ends)")


def decompress_zstd(path: Union[str, Path]) -> bytes:
    """The whole decompressed content of a (possibly multi-frame) .zst file; truncation is an error."""
    return b"".join(iter_zstd(path))


def read_slimpajama_file(path: Union[str, Path]) -> List[Tuple[str, Optional[str]]]:
    """(text, meta.redpajama_set_name) for every JSON line of a SlimPajama `.jsonl.zst` file.

    The whole file is checked before anything is returned, so a bad file contributes nothing."""
    refuse_lfs_pointer(path)
    data = decompress_zstd(path)
    refuse_other_unicode(path, data)
    try:
        content = data.decode("utf-8-sig")  # a byte order mark starts the file, not its first row
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
    stored_type = column_type.value_type if pa.types.is_dictionary(column_type) else column_type
    if not (pa.types.is_string(stored_type) or pa.types.is_large_string(stored_type)
            or pa.types.is_string_view(stored_type)):
        raise BadFileError(path, f"column {column!r} has type {column_type}, expected a string column (string, "
                                 f"large_string, string_view or a dictionary of strings)")
    if parquet_file.metadata.num_rows == 0:
        raise BadFileError(path, "empty file: 0 rows")
    return parquet_file


def plain_strings(values):
    """A batch of a string column as string or large_string, whose bytes can be viewed as binary: polars (1.38 on)
    writes string_view columns, and a pandas categorical a dictionary of strings. The cast checks no UTF-8, so
    bytes that are not UTF-8 are found row by row as in any string column."""
    import pyarrow as pa

    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        return values
    return values.cast(pa.large_string())


def iter_parquet_texts(
    path: Union[str, Path], column: str = "content", batch_size: int = 8192
) -> Iterator[List[Optional[str]]]:
    """Lists of up to `batch_size` strings of `column` (None for a null), read batch by batch."""
    import pyarrow as pa

    refuse_lfs_pointer(path)
    parquet_file = open_parquet(path, column)
    rows_done = 0
    try:
        # row group by row group, so that a damaged row group costs only itself and the ones after it
        for row_group in range(parquet_file.num_row_groups):
            for batch in parquet_file.iter_batches(batch_size=batch_size, row_groups=[row_group], columns=[column]):
                texts = plain_strings(batch.column(0)).to_pylist()  # decoding fails here for bytes not UTF-8
                rows_done += batch.num_rows
                yield texts
    except (pa.ArrowException, OSError) as err:
        raise BadFileError(path, f"unreadable parquet after {rows_done} rows: {_one_line(err)}") from None
    except UnicodeDecodeError as err:  # a string column whose bytes are not UTF-8 (Arrow does not check on read)
        raise BadFileError(
            path, f"unreadable parquet after {rows_done} rows: column {column!r} is not UTF-8 ({err.reason})"
        ) from None


# ---- any text corpus (prepare_text, train_tokenizer): JSON lines, parquet, plain text

JSON_LINES_SUFFIXES = (".jsonl", ".jsonl.zst", ".jsonl.gz", ".json.gz")
TEXT_SUFFIXES = JSON_LINES_SUFFIXES + (".parquet", ".txt")


class DocumentBatch(NamedTuple):
    """Some documents of one file, as read. `texts[i]` is the file's document number `indices[i]`: its line
    (JSON lines) or row (parquet), counted from 0 with blank and bad ones included, so that a document keeps
    its number when another line is fixed or removed. `bad` holds (rows, reason) for each bad row, or group of
    rows, left out; `empty` the numbers of the documents left out because they hold nothing but whitespace (or
    are null): a document of no text would be an end-of-text token alone."""

    indices: List[int]
    texts: List[str]
    bad: List[Tuple[int, str]]
    empty: List[int]


def holds_no_text(text: Optional[str]) -> bool:
    """A document of nothing but whitespace, or none at all: tokenized, it would be an end-of-text token alone."""
    return not text or text.isspace()


def _add_document(batch: DocumentBatch, index: int, text: Optional[str]) -> None:
    if holds_no_text(text):
        batch.empty.append(index)
    else:
        batch.indices.append(index)
        batch.texts.append(text)


def find_text_files(input_dir: Union[str, Path], pattern: str = "**/*") -> Tuple[List[Path], List[Path]]:
    """The files under `input_dir` that match the glob `pattern` (relative to it) and end with one of
    TEXT_SUFFIXES, sorted; and the matched files of other suffixes, which are not read."""
    input_dir = Path(input_dir)
    check_input_dir(input_dir, has_pattern=True)
    if not pattern or Path(pattern).is_absolute():
        raise InvalidValue(f"--pattern {pattern!r}: expected a glob relative to --input_dir, e.g. '**/*.parquet'")
    matched = sorted(p for p in input_dir.glob(pattern) if listed_file(p))
    files = [p for p in matched if p.name.endswith(TEXT_SUFFIXES)]
    others = [p for p in matched if not p.name.endswith(TEXT_SUFFIXES)]
    if not files:
        found = (
            f"it holds {len(others)} other file(s), e.g. {', '.join(str(p.relative_to(input_dir)) for p in others[:3])}"
            if others else "no file matches it"
        )
        if pattern.endswith("**"):  # a glob's trailing ** matches folders, not the files in them
            found += f" (a trailing ** matches folders: for every file below them, --pattern '{pattern}/*')"
        raise MissingFile(
            f"No input files under {input_dir} with --pattern {pattern!r}: expected files ending in "
            f"{', '.join(TEXT_SUFFIXES)}; {found}"
        )
    return files, others


def text_files_to_read(input_dir: Union[str, Path], pattern: str = "**/*") -> List[Path]:
    """`find_text_files`' files, after one line that names the matched files it does not read (a README.md,
    .gitattributes, ...): what a command that reads a text corpus prints first."""
    files, others = find_text_files(input_dir, pattern)
    if others:
        shown = ", ".join(str(p.relative_to(input_dir)) for p in others[:3]) + (", ..." if len(others) > 3 else "")
        print(f"Not read: {len(others)} file(s) matching --pattern {pattern!r} with other suffixes ({shown})", flush=True)
    return files


def iter_text_documents(path: Union[str, Path], key: str = "text", batch_size: int = 8192) -> Iterator[DocumentBatch]:
    """The documents of one file of a text corpus, up to `batch_size` at a time: field `key` of each JSON line
    (.jsonl, .jsonl.zst, .jsonl.gz, .json.gz), column `key` of a parquet file (read row group by row group,
    batch by batch), or the whole of a .txt file (one document, its line ends made "\n"). Text is UTF-8, a byte
    order mark at the start of a file is not part of it. A bad row is reported in the batch and left out, and so
    is a blank document; a file that cannot be read on raises BadFileError (after the batches read before the
    damage)."""
    refuse_lfs_pointer(path)
    name = Path(path).name
    if name.endswith(".parquet"):
        yield from _iter_parquet_documents(path, key, batch_size)
    elif name.endswith(".txt"):
        batch = DocumentBatch([], [], [], [])
        _add_document(batch, 0, _read_text_file(path))
        yield batch
    elif name.endswith(JSON_LINES_SUFFIXES):
        yield from _iter_json_lines_documents(path, key, batch_size)
    else:
        raise BadFileError(path, f"not a file prepare_text reads: expected a name ending in {', '.join(TEXT_SUFFIXES)}")


# The byte order marks of the encodings that editors save "Unicode" text in besides UTF-8 (Windows Notepad's "Unicode"
# is UTF-16), UTF-32's first: each of its marks starts with one of UTF-16's
OTHER_UNICODE_MARKS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                       (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def refuse_other_unicode(path: Union[str, Path], start: bytes) -> None:
    """A file whose (decompressed) bytes begin with `start` and so with UTF-16's or UTF-32's byte order mark is text,
    but not in UTF-8: named as such, with the conversion, where its bytes would be refused as "not UTF-8", line by
    line in a JSON-lines file."""
    for mark, encoding in OTHER_UNICODE_MARKS:
        if start.startswith(mark):
            raise BadFileError(path, f"{encoding} text (it starts with {encoding}'s byte order mark), expected UTF-8: "
                                     f"convert it first, e.g. iconv -f {encoding} -t UTF-8")


def _read_text_file(path: Union[str, Path]) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise BadFileError(path, f"cannot read: {err.strerror or err}") from None
    if not data:
        raise BadFileError(path, "empty file")
    refuse_other_unicode(path, data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise BadFileError(path, f"not UTF-8 text: {err.reason} at byte {err.start}") from None
    return text.replace("\r\n", "\n")  # Windows line ends: the same document as on any other system


def _iter_blocks(path: Union[str, Path]) -> Iterator[bytes]:
    """The (decompressed) bytes of a JSON-lines file, block by block."""
    name = Path(path).name
    if name.endswith(".zst"):
        yield from iter_zstd(path)
        return
    try:
        with (gzip.open(path, "rb") if name.endswith(".gz") else open(path, "rb")) as f:
            # read1: what one read of the file gives; read() would wait for a whole block and so lose the
            # part of a truncated gzip stream before the break
            for block in iter(lambda: f.read1(READ_BLOCK_BYTES), b""):
                yield block
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:  # EOFError: a truncated gzip stream
        raise BadFileError(path, f"corrupt gzip: {_one_line(err)}") from None
    except OSError as err:
        raise BadFileError(path, f"cannot read: {err.strerror or err}") from None


def _iter_lines(path: Union[str, Path]) -> Iterator[bytes]:
    """The lines of a JSON-lines file (without their newline), however long: a line may span blocks."""
    pending: List[bytes] = []  # the start of a line that continues in the next block
    for block in _iter_blocks(path):
        lines = block.split(b"\n")
        if len(lines) == 1:
            pending.append(block)
            continue
        lines[0] = b"".join(pending) + lines[0]
        pending = [lines.pop()]
        yield from lines
    rest = b"".join(pending)
    if rest:
        yield rest


def _json_line_text(line: bytes, key: str) -> Tuple[Optional[str], Optional[str]]:
    """(the text of field `key`, None; None for a null), or (None, what is wrong with the line)."""
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 ({err.reason} at byte {err.start})"
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err.msg} (column {err.colno})"
    if not isinstance(row, dict):
        return None, f"a JSON {json_type(row)}, expected an object with a string field {key!r}"
    if key not in row:
        keys = ", ".join(list(row)[:8]) + (", ..." if len(row) > 8 else "")
        return None, f"no field {key!r} (fields: {keys or 'none'}; --text_key names the field to read)"
    text = row[key]
    if text is None:
        return None, None
    if not isinstance(text, str):
        return None, f"field {key!r} is a JSON {json_type(text)}, expected a string"
    try:  # JSON escapes can spell half a surrogate pair ("\ud83d"), which no tokenizer can encode
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        return None, f"field {key!r} is not valid Unicode ({err.reason} at character {err.start})"
    return text, None


def _iter_json_lines_documents(path: Union[str, Path], key: str, batch_size: int) -> Iterator[DocumentBatch]:
    refuse_other_unicode(path, next(_iter_blocks(path), b""))
    batch = DocumentBatch([], [], [], [])
    line_number = 0
    try:
        for line_number, line in enumerate(_iter_lines(path), start=1):
            if line_number == 1:
                line = line.removeprefix(codecs.BOM_UTF8)  # a byte order mark starts the file, not its first row
            if not line.strip():
                continue
            text, problem = _json_line_text(line, key)
            if problem is None:
                _add_document(batch, line_number - 1, text)
            else:
                batch.bad.append((1, f"line {line_number}: {problem}"))
            if len(batch.texts) >= batch_size:
                yield batch
                batch = DocumentBatch([], [], [], [])
    except BadFileError as err:  # the file breaks off: what was read before it is good
        if batch.texts or batch.bad or batch.empty:
            yield batch
        where = f" after line {line_number}" if line_number else ""
        raise BadFileError(path, f"{err.reason}{where}") from None
    if batch.texts or batch.bad or batch.empty:
        yield batch


def _iter_parquet_documents(path: Union[str, Path], column: str, batch_size: int) -> Iterator[DocumentBatch]:
    import pyarrow as pa

    parquet_file = open_parquet(path, column)
    groups = parquet_file.num_row_groups
    first_row = 0  # of the current row group
    for group in range(groups):
        group_rows = parquet_file.metadata.row_group(group).num_rows
        row = first_row
        try:
            # a row group is read in batches, so memory holds one batch of texts, never the whole file
            for batch in parquet_file.iter_batches(batch_size=batch_size, row_groups=[group], columns=[column]):
                yield _parquet_batch(batch.column(0), row)
                row += batch.num_rows
        except (pa.ArrowException, OSError) as err:
            # row groups are independent: a damaged one costs its own remaining rows only
            lost = first_row + group_rows - row
            yield DocumentBatch([], [], [(lost, f"row group {group} of {groups} (rows {row} to {row + lost - 1}): "
                                                f"unreadable: {_one_line(err)}")], [])
        first_row += group_rows


def _parquet_batch(values, first_row: int) -> DocumentBatch:
    """The texts of a batch of a string column whose first row is `first_row` of the file."""
    import pyarrow as pa

    batch = DocumentBatch([], [], [], [])
    values = plain_strings(values)
    try:
        texts = values.to_pylist()
    except UnicodeDecodeError:  # Arrow does not check strings on read: find the rows that are not UTF-8
        binary = pa.large_binary() if pa.types.is_large_string(values.type) else pa.binary()
        for row, raw in enumerate(values.view(binary).to_pylist(), start=first_row):
            try:
                text = None if raw is None else raw.decode("utf-8")
            except UnicodeDecodeError as err:
                batch.bad.append((1, f"row {row}: not UTF-8 ({err.reason} at byte {err.start})"))
                continue
            _add_document(batch, row, text)
        return batch
    for row, text in enumerate(texts, start=first_row):
        _add_document(batch, row, text)
    return batch
