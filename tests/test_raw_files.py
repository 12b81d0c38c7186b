"""fabric_lin/data/raw_files.py's readers on files shaped as real shards are, against the documents written: a last
JSON line without a newline, lines and zstd frames across read blocks (the block made small), zstd frames cut
mid-line, and more documents than one batch (JSON lines, and parquet row groups read in several batches); a line or
field of another JSON type named by it; UTF-16 and UTF-32 text named with its conversion; what a file broken off
or damaged part of the way gives and says, with the readers' other cases no command's test meets. The
preprocessors' end-to-end tests (test_data_prep.py, test_prepare_text.py) read small files whole, in one block
and one batch."""
import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

import fabric_lin.data.raw_files as raw_files
from fabric_lin.data.raw_files import iter_parquet_texts, iter_text_documents, read_slimpajama_file
from helpers import paragraphs, write_json_lines

COMPRESSION = {".jsonl": None, ".jsonl.zst": "zst", ".jsonl.gz": "gz", ".json.gz": "gz"}
READ_BLOCK = 16  # bytes: each line, and each zstd frame, spans several blocks


@pytest.fixture
def small_read_blocks(monkeypatch):
    monkeypatch.setattr(raw_files, "READ_BLOCK_BYTES", READ_BLOCK)


def documents():
    """Ten texts, the last one a line of several hundred bytes on its own."""
    texts = paragraphs(9, 40) + ["the last document, " + "long " * 100]
    assert len(texts[-1]) > 20 * READ_BLOCK
    return texts


@pytest.mark.parametrize("final_newline", [False, True], ids=["no final newline", "final newline"])
@pytest.mark.parametrize("suffix", COMPRESSION)
def test_every_json_line_is_read_in_order_whatever_the_blocks(tmp_path, small_read_blocks, suffix, final_newline):
    texts = documents()
    path = tmp_path / f"shard{suffix}"
    write_json_lines(path, [{"id": i, "text": t} for i, t in enumerate(texts)], COMPRESSION[suffix], frames=3,
                     final_newline=final_newline)
    batches = list(iter_text_documents(path, batch_size=4))
    assert [t for b in batches for t in b.texts] == texts
    assert [i for b in batches for i in b.indices] == list(range(len(texts)))  # line numbers, from 0
    assert [len(b.texts) for b in batches] == [4, 4, 2] and not any(b.bad for b in batches)


@pytest.mark.parametrize("final_newline", [False, True], ids=["no final newline", "final newline"])
def test_a_slimpajama_file_gives_every_row(tmp_path, small_read_blocks, final_newline):
    texts = documents()
    rows = [{"text": t, "meta": {"redpajama_set_name": "RedPajamaC4" if i % 2 else "RedPajamaBook"}} for i, t in enumerate(texts)]
    path = tmp_path / "chunk_0.jsonl.zst"
    write_json_lines(path, rows, "zst", frames=3, final_newline=final_newline)
    assert read_slimpajama_file(path) == [(r["text"], r["meta"]["redpajama_set_name"]) for r in rows]


def test_a_byte_order_mark_and_windows_line_ends_are_read_alike_by_every_json_lines_reader(tmp_path):
    """A JSON-lines file saved by a Windows editor (a UTF-8 byte order mark, CRLF line ends): prepare_text read it,
    and prepare_slimpajama skipped it whole, 'invalid JSON on line 1: Unexpected UTF-8 BOM'."""
    rows = [{"text": "first document", "meta": {"redpajama_set_name": "RedPajamaC4"}}, {"text": "second", "meta": {}}]
    data = b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n" for r in rows)
    (tmp_path / "chunk_0.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    assert read_slimpajama_file(tmp_path / "chunk_0.jsonl.zst") == [("first document", "RedPajamaC4"), ("second", None)]
    (batch,) = iter_text_documents(tmp_path / "chunk_0.jsonl.zst")
    assert batch.texts == ["first document", "second"] and not batch.bad


def test_parquet_row_groups_read_in_several_batches(tmp_path):
    texts = paragraphs(12, 41)
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=5)  # row groups of 5, 5 and 2 rows
    batches = list(iter_text_documents(path, batch_size=2))
    assert [t for b in batches for t in b.texts] == texts
    assert [i for b in batches for i in b.indices] == list(range(12))  # row numbers of the file, from 0
    assert [len(b.texts) for b in batches] == [2, 2, 1, 2, 2, 1, 2]
    assert [t for batch in iter_parquet_texts(path, column="text", batch_size=2) for t in batch] == texts



# How other tools store a text column: polars (1.38 on) writes string_view, a pandas categorical a dictionary of
# strings, polars before 1.38 large_string. Each is text, read as such.
STRING_COLUMN_TYPES = {
    "string_view": lambda texts: pa.array(texts, type=pa.string_view()),
    "dictionary": lambda texts: pa.array(texts).dictionary_encode(),
    "large_string": lambda texts: pa.array(texts, type=pa.large_string()),
}


@pytest.mark.parametrize("column_type", STRING_COLUMN_TYPES)
def test_every_kind_of_string_column_is_read_as_text(tmp_path, column_type):
    texts = paragraphs(5, 43) + [paragraphs(1, 43)[0]]  # a repeated text: a dictionary holds it once
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": STRING_COLUMN_TYPES[column_type](texts)}), path, row_group_size=4)
    batches = list(iter_text_documents(path, batch_size=3))
    assert [t for b in batches for t in b.texts] == texts and not any(b.bad for b in batches)
    assert [t for batch in iter_parquet_texts(path, column="text", batch_size=3) for t in batch] == texts


@pytest.mark.parametrize("column_type", ["string_view", "dictionary"])
def test_a_row_that_is_not_utf8_in_any_kind_of_string_column_is_named(tmp_path, column_type):
    # Arrow writes bytes that are not UTF-8 in a string column unchecked
    strings = pa.array([b"first row", b"\xff second row", b"third row"], pa.binary()).view(pa.string())
    column = strings.cast(pa.string_view()) if column_type == "string_view" else strings.dictionary_encode()
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": column}), path)
    (batch,) = iter_text_documents(path)
    assert batch.texts == ["first row", "third row"] and batch.indices == [0, 2]
    assert batch.bad == [(1, "row 1: not UTF-8 (invalid start byte at byte 0)")]


def test_a_column_of_another_type_names_the_types_read(tmp_path):
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": pa.array([b"bytes"], pa.binary())}), path)
    with pytest.raises(raw_files.BadFileError, match=r"column 'text' has type binary, expected a string column "
                                                      r"\(string, large_string, string_view or a dictionary of strings\)"):
        list(iter_text_documents(path))

def test_a_link_to_a_file_that_is_not_there_is_found_and_named_by_its_reader(tmp_path):
    """A dataset whose files were never fetched (git-annex's links into its object store) was read as if those files
    did not exist: left out of the run and of its summary, unsaid."""
    from fabric_lin.data.raw_files import BadFileError, find_files, find_text_files

    (tmp_path / "a.txt").write_text("a document")
    for name in ("b.txt", "c.jsonl.zst", "d.parquet"):
        (tmp_path / name).symlink_to(tmp_path / "not-fetched" / name)
    assert find_text_files(tmp_path) == ([tmp_path / name for name in ("a.txt", "b.txt", "c.jsonl.zst", "d.parquet")], [])
    assert find_files(tmp_path, ".jsonl.zst") == [tmp_path / "c.jsonl.zst"]
    for name in ("b.txt", "c.jsonl.zst", "d.parquet"):
        with pytest.raises(BadFileError, match="No such file or directory"):
            list(iter_text_documents(tmp_path / name))


def test_a_git_lfs_pointer_is_named_as_one_by_every_reader(tmp_path):
    """A dataset cloned without Git LFS holds pointer files: the readers called them corrupt zstd or parquet, and a
    .txt pointer became a training document."""
    from fabric_lin.data.raw_files import BadFileError

    pointer = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 12345678\n")
    readers = {"a.jsonl.zst": read_slimpajama_file, "b.parquet": lambda p: list(iter_parquet_texts(p)),
               **{f"c{suffix}": lambda p: list(iter_text_documents(p)) for suffix in (".txt", ".jsonl", ".jsonl.zst",
                                                                                       ".json.gz", ".parquet")}}
    for name, read in readers.items():
        (tmp_path / name).write_text(pointer)
        with pytest.raises(BadFileError, match=r"a Git LFS pointer, not the file's content: fetch it with "
                                               r"`git lfs pull` in its clone"):
            read(tmp_path / name)
    (tmp_path / "notes.txt").write_text(pointer + "and a document that goes on " * 40)  # past a pointer's 1024 bytes
    assert list(iter_text_documents(tmp_path / "notes.txt"))[0].texts == [(tmp_path / "notes.txt").read_text()]


def test_a_json_line_of_another_type_is_named_by_its_json_type(tmp_path):
    """A line or a field of the wrong type was named by its Python type: "a JSON NoneType", "a JSON str"."""
    path = tmp_path / "rows.jsonl"
    path.write_text('[1, 2]\n"a string"\nnull\n7\ntrue\n'
                    '{"text": {"a": 1}}\n{"text": [1]}\n{"text": 2.5}\n{"text": "kept"}\n')
    (batch,) = iter_text_documents(path, batch_size=16)
    assert batch.texts == ["kept"]
    expected_an_object = "expected an object with a string field 'text'"
    assert [reason for _, reason in batch.bad] == [
        f"line 1: a JSON array, {expected_an_object}", f"line 2: a JSON string, {expected_an_object}",
        f"line 3: a JSON null, {expected_an_object}", f"line 4: a JSON number, {expected_an_object}",
        f"line 5: a JSON boolean, {expected_an_object}", "line 6: field 'text' is a JSON object, expected a string",
        "line 7: field 'text' is a JSON array, expected a string",
        "line 8: field 'text' is a JSON number, expected a string",
    ]


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32"])
@pytest.mark.parametrize("name", ["a.txt", "a.jsonl", "a.jsonl.gz", "slimpajama.jsonl.zst"])
def test_utf16_or_utf32_text_is_named_with_its_conversion(tmp_path, name, encoding):
    """Text saved as Windows Notepad's "Unicode" (UTF-16, with its byte order mark) was refused as "not UTF-8: invalid
    start byte at byte 0", and a JSON-lines file line by line as bad rows."""
    text = "\n".join(json.dumps({"text": f"document {i}"}) for i in range(3)) + "\n"
    data = text.encode(encoding)  # Python's utf-16 and utf-32 write the byte order mark first
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else
                     zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data)
    upper = encoding.upper()
    with pytest.raises(raw_files.BadFileError) as info:
        list(read_slimpajama_file(path) if name.endswith(".zst") else iter_text_documents(path))
    assert info.value.reason == (f"{upper} text (it starts with {upper}'s byte order mark), expected UTF-8: convert it "
                                 f"first, e.g. iconv -f {upper} -t UTF-8")


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_a_truncated_json_lines_file_gives_its_whole_lines_and_says_after_which(tmp_path, small_read_blocks, suffix):
    """The reason of a file that breaks off names the last line read whole: the documents before it are kept."""
    import zlib

    texts = documents()
    path = tmp_path / f"shard{suffix}"
    write_json_lines(path, [{"text": t} for t in texts], COMPRESSION[suffix], frames=3)
    cut = path.read_bytes()[: int(path.stat().st_size * 0.6)]
    path.write_bytes(cut)
    if suffix.endswith(".gz"):
        data = zlib.decompressobj(wbits=31).decompress(cut)
    else:
        data = zstandard.ZstdDecompressor().stream_reader(cut, read_across_frames=True).read()
    whole = [json.loads(line)["text"] for line in data.split(b"\n")[:-1]]
    assert 0 < len(whole) < len(texts)
    batches = []
    with pytest.raises(raw_files.BadFileError) as info:
        for batch in iter_text_documents(path, batch_size=4):
            batches.append(batch)
    assert [t for b in batches for t in b.texts] == whole
    assert info.value.reason.endswith(f" after line {len(whole)}")


def test_a_parquet_file_damaged_part_of_the_way_gives_its_rows_before_and_says_how_many(tmp_path):
    from helpers import write_parquet_with_a_damaged_row_group

    texts = paragraphs(21, 44)
    path = tmp_path / "part-0.parquet"
    write_parquet_with_a_damaged_row_group(path, "content", texts, row_group=2)  # row groups of 7 rows
    read = []
    with pytest.raises(raw_files.BadFileError) as info:
        for batch in iter_parquet_texts(path, batch_size=3):
            read += batch
    assert read == texts[:14]
    assert info.value.reason.startswith("unreadable parquet after 14 rows: ")


def test_a_row_group_damaged_after_its_first_pages_loses_the_rows_after_those_read(tmp_path):
    """A row group of 7 rows in pages of one row each, its later pages scrambled: the batch read before the damage is
    kept, and the rows lost are the group's rest, not all of its rows."""
    texts = paragraphs(21, 44)
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=7, compression="none", use_dictionary=False,
                   data_page_size=1, write_batch_size=1)
    chunk = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    for i in range(chunk.data_page_offset + chunk.total_compressed_size // 2,
                   chunk.data_page_offset + chunk.total_compressed_size - 4):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    batches = list(iter_text_documents(path, batch_size=3))
    assert [i for b in batches for i in b.indices] == [*range(10), *range(14, 21)]
    ((lost, reason),) = [bad for b in batches for bad in b.bad]
    assert lost == 4 and reason.startswith("row group 1 of 3 (rows 10 to 13): unreadable: ")


def test_a_null_among_rows_that_are_not_utf8_is_an_empty_document(tmp_path):
    strings = pa.array([b"first row", None, b"\xff third row", b"fourth row"], pa.binary()).view(pa.string())
    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"text": strings}), path)
    (batch,) = iter_text_documents(path)
    assert (batch.indices, batch.texts, batch.empty) == ([0, 3], ["first row", "fourth row"], [1])
    assert batch.bad == [(1, "row 2: not UTF-8 (invalid start byte at byte 0)")]


def test_files_that_hold_nothing_are_named_as_empty(tmp_path):
    """A directory without the files a recipe reads, a SlimPajama file of blank lines, a parquet file of no rows and an
    empty .txt file: each said in its words, not as a bad row or an empty document."""
    from fabric_lin.data.raw_files import BadFileError, find_files

    with pytest.raises(FileNotFoundError, match=rf"^No \*\.jsonl\.zst files found under {tmp_path} \(searched "
                                                r"recursively\)$"):
        find_files(tmp_path, ".jsonl.zst")
    (tmp_path / "blank.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b"\n  \n\n"))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "norows.parquet")
    (tmp_path / "nothing.txt").write_bytes(b"")
    reads = {"blank.jsonl.zst": read_slimpajama_file, "norows.parquet": lambda p: list(iter_text_documents(p)),
             "nothing.txt": lambda p: list(iter_text_documents(p))}
    reasons = {}
    for name, read in reads.items():
        with pytest.raises(BadFileError) as info:
            read(tmp_path / name)
        reasons[name] = info.value.reason
    assert reasons == {"blank.jsonl.zst": "empty file: no JSON lines", "norows.parquet": "empty file: 0 rows",
                       "nothing.txt": "empty file"}


def test_a_recipe_that_finds_none_of_its_files_names_those_prepare_text_reads(tmp_path):
    """Your own .jsonl (or parquet, text) given to prepare_slimpajama or prepare_starcoder: the error named the suffix
    it looked for only, not the files that are there nor the command that reads them."""
    from fabric_lin.data.raw_files import find_files

    (tmp_path / "2024").mkdir()
    for name in ("2024/a.jsonl", "2024/b.jsonl", "notes.txt", "README.md"):
        (tmp_path / name).write_text('{"text": "a"}\n')
    with pytest.raises(FileNotFoundError, match=rf"^No \*\.parquet files found under {tmp_path} \(searched "
                                                r"recursively\); it holds 3 that fabric-lin prepare_text reads "
                                                r"\(2024/a.jsonl, 2024/b.jsonl, notes.txt\): give it these$"):
        find_files(tmp_path, ".parquet")


def test_a_slimpajama_row_without_a_meta_object_has_no_set_name(tmp_path):
    rows = [{"text": "no meta"}, {"text": "meta null", "meta": None}, {"text": "meta a string", "meta": "RedPajamaC4"},
            {"text": "named", "meta": {"redpajama_set_name": "RedPajamaBook"}}]
    write_json_lines(tmp_path / "chunk_0.jsonl.zst", rows, "zst")
    assert read_slimpajama_file(tmp_path / "chunk_0.jsonl.zst") == [
        ("no meta", None), ("meta null", None), ("meta a string", None), ("named", "RedPajamaBook")]


def test_a_json_line_without_the_field_lists_its_first_eight_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    write_json_lines(path, [{name: 1 for name in "abcdefghi"}, {}, {"text": "kept"}])
    (batch,) = iter_text_documents(path)
    assert batch.texts == ["kept"] and [reason for _, reason in batch.bad] == [
        "line 1: no field 'text' (fields: a, b, c, d, e, f, g, h, ...; --text_key names the field to read)",
        "line 2: no field 'text' (fields: none; --text_key names the field to read)"]


def test_the_files_not_read_are_counted_and_three_named(tmp_path, capsys):
    from fabric_lin.data.raw_files import text_files_to_read

    for name in ("a.txt", "b.md", "c.md", "d.md", "e.md", "f.md"):
        (tmp_path / name).write_text("x")
    assert text_files_to_read(tmp_path) == [tmp_path / "a.txt"]
    assert capsys.readouterr().out == "Not read: 5 file(s) matching --pattern '**/*' with other suffixes (b.md, c.md, d.md, " \
                                      "...)\n"


def test_an_arrow_error_of_several_lines_is_named_in_one(tmp_path, monkeypatch):
    import pyarrow.parquet

    def unreadable(path):
        raise pa.ArrowInvalid("Parquet magic bytes not found in footer.\nEither the file is corrupted or this is not "
                              "a parquet file.")

    (tmp_path / "a.parquet").write_bytes(b"not parquet")
    monkeypatch.setattr(pyarrow.parquet, "ParquetFile", unreadable)
    with pytest.raises(raw_files.BadFileError) as info:
        list(iter_text_documents(tmp_path / "a.parquet"))
    assert info.value.reason == ("unreadable parquet: Parquet magic bytes not found in footer. Either the file is "
                                 "corrupted or this is not a parquet file.")
