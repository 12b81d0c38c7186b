"""The SlimPajama, Starcoder and text-corpus preprocessors, end to end through litdata's DataProcessor."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.prepare_slimpajama import prepare as prepare_slimpajama
from data_prep.prepare_text import prepare as prepare_text
from fabric_lin.cli import main as cli_main
from fabric_lin.data import Tokenizer, check_prepared_dir
from fabric_lin.data.train_tokenizer import main as train_tokenizer

REPO = Path(__file__).resolve().parents[1]


def paragraphs(n, seed):
    """n distinct real paragraphs (pieces of stdlib modules)."""
    import sysconfig

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = sources[int(rng.integers(len(sources)))].read_text(encoding="utf-8", errors="replace")
        start = int(rng.integers(max(1, len(text) - 800)))
        out.append(f"doc {seed}-{i}: " + text[start : start + int(rng.integers(50, 600))])
    return out


def write_jsonl_zst(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data))


def slimpajama_rows(seed, n=24):
    rows = []
    for i, text in enumerate(paragraphs(n, seed)):
        github = i % 4 == 1
        rows.append({"text": ("GITHUB ROW " if github else "") + text, "meta": {"redpajama_set_name": "RedPajamaGithub" if github else "RedPajamaC4"}})
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("prep")
    sp, sc = root / "slimpajama-raw", root / "starcoder-raw"
    good_sp = {"a/part-0.jsonl.zst": slimpajama_rows(1), "b.jsonl.zst": slimpajama_rows(2), "c/d/part-1.jsonl.zst": slimpajama_rows(3)}
    for name, rows in good_sp.items():
        write_jsonl_zst(sp / name, rows)
    # the bad SlimPajama files, one per kind
    (sp / "corrupt.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage that is not a zstd frame")
    whole = zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in slimpajama_rows(4)).encode())
    (sp / "truncated.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    lines = "".join(json.dumps(r) + "\n" for r in slimpajama_rows(5, 3)) + '{"text": "unterminated\n'
    (sp / "badjson.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    rows = slimpajama_rows(6, 3)
    rows[1] = {"content": "no text field", "meta": {}}
    write_jsonl_zst(sp / "notext.jsonl.zst", rows)
    (sp / "empty.jsonl.zst").write_bytes(b"")
    rows = slimpajama_rows(10, 3)
    rows[2]["text"] = "half an emoji \ud83d"  # a lone surrogate: json.dumps writes it as the escape \ud83d
    write_jsonl_zst(sp / "surrogate.jsonl.zst", rows)

    good_sc = {"python/train-0.parquet": paragraphs(30, 7), "train-1.parquet": paragraphs(20, 8)}
    for name, texts in good_sc.items():
        (sc / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"max_stars_repo_path": ["x.py"] * len(texts), "content": texts}), sc / name, row_group_size=7)
    (sc / "garbage.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    # readable footer and first row group, corrupt second row group: found only while streaming
    partial = paragraphs(14, 9)
    pq.write_table(pa.table({"content": partial}), sc / "partial.parquet", row_group_size=7, compression="zstd", use_dictionary=False)
    column = pq.ParquetFile(sc / "partial.parquet").metadata.row_group(1).column(0)
    data = bytearray((sc / "partial.parquet").read_bytes())
    for i in range(column.data_page_offset + 20, column.data_page_offset + column.total_compressed_size - 4):
        data[i] ^= 0x5A
    (sc / "partial.parquet").write_bytes(bytes(data))
    pq.write_table(pa.table({"text": ["wrong column"]}), sc / "nocontent.parquet")
    # a string column whose second row group holds bytes that are not UTF-8 (Arrow writes them unchecked)
    not_utf8 = paragraphs(7, 11) + [b"bad \xff bytes", b"more"]
    column = pa.array([t if isinstance(t, bytes) else t.encode() for t in not_utf8], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"content": column}), sc / "badutf8.parquet", row_group_size=7)
    (sc / "empty.parquet").write_bytes(b"")

    tok_raw = root / "tok-raw"
    tok_raw.mkdir()
    (tok_raw / "all.txt").write_text("\n".join(paragraphs(300, 99)), encoding="utf-8")
    train_tokenizer(tok_raw, root / "tokenizer", vocab_size=500, num_threads=1)
    return {"root": root, "sp": sp, "sc": sc, "good_sp": good_sp, "good_sc": good_sc, "partial_sc": partial[:7],
            "badutf8_sc": not_utf8[:7], "tokenizer": root / "tokenizer"}


def read_tokens(path):
    """Every token of a prepared directory, in order, through StreamingDataset + TokensLoader."""
    from litdata.streaming import StreamingDataset, TokensLoader

    dataset = StreamingDataset(str(path), item_loader=TokensLoader(block_size=1), shuffle=False)
    return np.concatenate([np.asarray(item) for item in dataset]).astype(np.int64)


def expected_tokens(tokenizer, texts):
    return [tokenizer.encode(t, bos=False, eos=True).tolist() for t in texts]


def split_documents(tokens, eos_id):
    docs, start = [], 0
    for i in np.flatnonzero(tokens == eos_id):
        docs.append(tokens[start : i + 1].tolist())
        start = i + 1
    assert start == len(tokens), "the token stream must end with EOS"
    return docs


def kept_texts(rows):
    return [r["text"] for r in rows if r["meta"]["redpajama_set_name"] != "RedPajamaGithub"]


def test_slimpajama_round_trip_and_bad_files(corpus, capfd):
    tokenizer = Tokenizer(corpus["tokenizer"])
    out = corpus["root"] / "slimpajama" / "train"
    summary = prepare_slimpajama(corpus["sp"], out, corpus["tokenizer"], chunk_size=2000, num_workers=2)

    reasons = {Path(b["path"]).name: (b["status"], b["reason"]) for b in summary["bad_files"]}
    assert reasons.keys() == {"corrupt.jsonl.zst", "truncated.jsonl.zst", "badjson.jsonl.zst", "notext.jsonl.zst",
                              "empty.jsonl.zst", "surrogate.jsonl.zst"}
    assert all(status == "skipped" for status, _ in reasons.values())
    assert "corrupt zstd" in reasons["corrupt.jsonl.zst"][1]
    assert "truncated" in reasons["truncated.jsonl.zst"][1]
    assert "invalid JSON on line 4" in reasons["badjson.jsonl.zst"][1]
    assert "line 2 has no string field 'text'" in reasons["notext.jsonl.zst"][1]
    assert "empty file" in reasons["empty.jsonl.zst"][1]
    assert "line 3: field 'text' is not valid Unicode (surrogates not allowed" in reasons["surrogate.jsonl.zst"][1]
    printed = capfd.readouterr()
    assert "SKIPPED" in printed.err and "badjson.jsonl.zst" in printed.err
    assert "6 bad file(s)" in printed.out
    assert re.search(r"part-0.jsonl.zst: 18 documents, \d+ tokens", printed.out)  # progress, file by file

    # two workers take files in any order: compare the documents as a multiset
    texts = [t for rows in corpus["good_sp"].values() for t in kept_texts(rows)]
    expected = expected_tokens(tokenizer, texts)
    tokens = read_tokens(out)
    got = split_documents(tokens, tokenizer.eos_id)
    assert Counter(map(tuple, got)) == Counter(map(tuple, expected))
    assert not any("GITHUB ROW" in tokenizer.decode(d) for d in got)
    assert summary["documents"] == len(texts) and summary["tokens"] == len(tokens)
    assert summary["skipped_rows"] == sum(len(rows) - len(kept_texts(rows)) for rows in corpus["good_sp"].values())

    info = check_prepared_dir(out, tokenizer)
    assert info["tokenizer"]["vocab_size"] == 500 and info["recipe"] == "slimpajama"
    index = json.loads((out / "index.json").read_text())
    assert all(c["dim"] <= 2000 for c in index["chunks"]) and len(index["chunks"]) > 1
    assert index["config"]["data_format"] == ["no_header_numpy:5"]  # uint16 tokens for a small vocabulary
    with pytest.raises(FileExistsError, match=str(out)):
        prepare_slimpajama(corpus["sp"], out, corpus["tokenizer"])


@pytest.fixture(scope="module")
def fast_prepared(corpus):
    """(directory, summary) of the SlimPajama corpus prepared with fast_dev_run=2 and one worker."""
    out = corpus["root"] / "fast"
    return out, prepare_slimpajama(corpus["sp"], out, corpus["tokenizer"], num_workers=1, fast_dev_run=2)


def test_slimpajama_fast_dev_run_is_a_prefix(corpus, fast_prepared):
    tokenizer = Tokenizer(corpus["tokenizer"])
    out, summary = fast_prepared
    # files in sorted order: a/part-0, b, badjson, ...: the first two
    assert summary["files"] == 2
    texts = kept_texts(corpus["good_sp"]["a/part-0.jsonl.zst"]) + kept_texts(corpus["good_sp"]["b.jsonl.zst"])
    expected = [t for doc in expected_tokens(tokenizer, texts) for t in doc]
    assert read_tokens(out).tolist() == expected
    assert json.loads((out / "prepared.json").read_text())["fast_dev_run"] == 2


def test_fast_dev_run_true_is_the_first_ten_files_whatever_the_workers(corpus, tmp_path, capfd):
    tokenizer = Tokenizer(corpus["tokenizer"])
    texts = paragraphs(12, 12)
    for i, text in enumerate(texts):
        write_jsonl_zst(tmp_path / "raw" / f"part-{i:02d}.jsonl.zst", [{"text": text, "meta": {}}])
    out = tmp_path / "fast"
    cli_main(["prepare_slimpajama", "--input_dir", str(tmp_path / "raw"), "--output_dir", str(out),
              "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "2", "--fast_dev_run", "true"])
    info = check_prepared_dir(out, tokenizer)
    assert info["summary"]["files"] == 10 and info["fast_dev_run"] == 10
    printed = capfd.readouterr().out
    assert "fast_dev_run: the first 10 of the 12 input files (sorted by path)" in printed
    assert "fast_dev_run=10" in printed and "fast_dev_run=False" not in printed  # litdata's line says what was asked
    got = split_documents(read_tokens(out), tokenizer.eos_id)  # two workers: in any order
    assert Counter(map(tuple, got)) == Counter(map(tuple, expected_tokens(tokenizer, texts[:10])))


def test_starcoder_round_trip_and_bad_files_through_cli(corpus, capfd):
    tokenizer = Tokenizer(corpus["tokenizer"])
    out = corpus["root"] / "starcoder"
    cli_main(
        ["prepare_starcoder", "--input_dir", str(corpus["sc"]), "--output_dir", str(out),
         "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1", "--chunk_size", "3000"]
    )
    info = check_prepared_dir(out, tokenizer)
    reasons = {Path(b["path"]).name: b["reason"] for b in info["summary"]["bad_files"]}
    assert reasons.keys() == {"garbage.parquet", "nocontent.parquet", "empty.parquet", "partial.parquet",
                              "badutf8.parquet"}
    assert "unreadable parquet after 7 rows" in reasons["partial.parquet"]
    assert "unreadable parquet after 7 rows: column 'content' is not UTF-8" in reasons["badutf8.parquet"]
    partial_files = {Path(b["path"]).name for b in info["summary"]["bad_files"] if b["status"] == "partial"}
    assert partial_files == {"partial.parquet", "badutf8.parquet"}
    assert "unreadable parquet" in reasons["garbage.parquet"]
    assert "missing column 'content'" in reasons["nocontent.parquet"]
    assert "empty file" in reasons["empty.parquet"]
    assert "5 bad file(s)" in capfd.readouterr().out
    # one worker, files in sorted order (badutf8, partial, python/train-0, train-1), rows in order; of the
    # partial files, the row group read before the bad one
    texts = (corpus["badutf8_sc"] + corpus["partial_sc"] + corpus["good_sc"]["python/train-0.parquet"]
             + corpus["good_sc"]["train-1.parquet"])
    expected = [t for doc in expected_tokens(tokenizer, texts) for t in doc]
    assert read_tokens(out).tolist() == expected
    assert info["summary"]["documents"] == len(texts)


def test_every_file_bad_names_the_input_and_creates_no_directory(corpus, tmp_path, capfd):
    """No tokens at all: the error says nothing was written where the output was to be, and the directories
    the run made for it are gone again."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "bad.jsonl.zst").write_bytes(b"not zstd at all")
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare_slimpajama", "--input_dir", str(raw), "--output_dir", str(out), "--tokenizer_path",
                  str(corpus["tokenizer"]), "--num_workers", "1"])
    assert info.value.code == 2
    err = capfd.readouterr().err
    assert f"fabric-lin prepare_slimpajama: error: No tokens were produced from {raw}: every file was bad or empty, so {out} " \
           f"was not written\nRead {raw}: 0/1 files" in err
    assert "Prepared" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_interrupted_run_leaves_nothing_the_trainer_accepts(corpus, tmp_path, how):
    out = tmp_path / "interrupted"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "data_prep" / "prepare_slimpajama.py"), "--input_dir", str(corpus["sp"]),
         "--output_dir", str(out), "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while not list(tmp_path.glob(".tmp-interrupted-*")) and time.time() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be interrupted"
        if how == "SIGKILL":  # a killed job: nothing runs after it
            os.killpg(process.pid, signal.SIGKILL)
        else:  # Ctrl-C
            time.sleep(1.0)
            process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_prepared_dir(out)
    if how == "SIGKILL":
        (partial,) = tmp_path.glob(".tmp-interrupted-*")
        with pytest.raises(FileNotFoundError, match="no index.json"):
            check_prepared_dir(partial)


def test_check_prepared_dir_rejects_incomplete_and_mismatched(corpus, fast_prepared, tmp_path):
    source, _ = fast_prepared
    tokenizer = Tokenizer(corpus["tokenizer"])

    no_marker = shutil.copytree(source, tmp_path / "no-marker")
    (no_marker / "prepared.json").unlink()
    with pytest.raises(ValueError, match=f"{no_marker} is incomplete: prepared.json is missing"):
        check_prepared_dir(no_marker, tokenizer)

    missing_chunk = shutil.copytree(source, tmp_path / "missing-chunk")
    next(missing_chunk.glob("chunk-*.bin")).unlink()
    with pytest.raises(ValueError, match="chunk file"):
        check_prepared_dir(missing_chunk)

    other_dir = tmp_path / "other-tokenizer"
    other_raw = tmp_path / "other-raw"
    other_raw.mkdir()
    (other_raw / "a.txt").write_text("\n".join(paragraphs(200, 5)))
    train_tokenizer(other_raw, other_dir, vocab_size=400, num_threads=1)
    with pytest.raises(ValueError, match="different tokenizer"):
        check_prepared_dir(source, Tokenizer(other_dir))


def test_train_tokenizer_skips_the_bad_files_by_name(corpus, tmp_path, capfd):
    # the bad files of both corpora, lone surrogates and bytes that are not UTF-8 among them
    for directory in (corpus["sp"], corpus["sc"]):
        shutil.copytree(directory, tmp_path / "raw" / directory.name)
    train_tokenizer(tmp_path / "raw", tmp_path / "tok", vocab_size=400, num_threads=1)
    skipped = capfd.readouterr().err
    for name in ("surrogate.jsonl.zst", "badjson.jsonl.zst", "badutf8.parquet", "garbage.parquet"):
        assert re.search(rf"SKIPPED \S*{re.escape(name)}: ", skipped), name
    assert Tokenizer(tmp_path / "tok").vocab_size == 400


# ---- prepare_text: any corpus of JSON lines, parquet and text files


def write_json_lines(path, rows, compress=None, frames=1):
    """JSON lines, plain or compressed ("zst": in `frames` zstd frames, as multi-threaded writers make them; "gz")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [(r if isinstance(r, bytes) else (json.dumps(r) if not isinstance(r, str) else r).encode()) + b"\n" for r in rows]
    if compress == "zst":
        per = -(-len(lines) // frames)
        data = b"".join(zstandard.ZstdCompressor().compress(b"".join(lines[i : i + per])) for i in range(0, len(lines), per))
    elif compress == "gz":
        import gzip

        data = gzip.compress(b"".join(lines))
    else:
        data = b"".join(lines)
    path.write_bytes(data)


@pytest.fixture(scope="module")
def text_corpus(corpus):
    """A corpus in every format prepare_text reads, and its documents file by file in sorted order (None:
    an empty document, which is dropped)."""
    raw = corpus["root"] / "text-raw"
    docs = {}
    web = paragraphs(30, 21)
    web[4], web[17] = None, ""
    docs["web/part-000.parquet"] = web
    (raw / "web").mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(30)), "text": web}), raw / "web" / "part-000.parquet", row_group_size=10)
    docs["web/part-001.jsonl.zst"] = paragraphs(25, 22)
    write_json_lines(raw / "web" / "part-001.jsonl.zst", [{"id": i, "text": t, "url": "x"} for i, t in enumerate(docs["web/part-001.jsonl.zst"])],
                     compress="zst", frames=3)
    docs["notes/a.jsonl"] = paragraphs(20, 23)
    write_json_lines(raw / "notes" / "a.jsonl", [r for t in docs["notes/a.jsonl"] for r in ({"text": t}, "")])  # blank lines between
    docs["notes/b.jsonl.gz"] = paragraphs(15, 24)
    write_json_lines(raw / "notes" / "b.jsonl.gz", [{"text": t} for t in docs["notes/b.jsonl.gz"]], compress="gz")
    docs["c4-train.00000-of-01024.json.gz"] = paragraphs(15, 25)
    write_json_lines(raw / "c4-train.00000-of-01024.json.gz", [{"text": t} for t in docs["c4-train.00000-of-01024.json.gz"]], compress="gz")
    for name, seed in (("books/x.txt", 26), ("books/y.txt", 27)):
        docs[name] = ["\n\n".join(paragraphs(4, seed))]
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_text(docs[name][0], encoding="utf-8")
    (raw / "README.md").write_text("# not part of the corpus\n")
    ordered = [t for name in sorted(docs, key=Path) for t in docs[name] if t]
    return {"raw": raw, "docs": docs, "ordered": ordered}


def partition_in_order(got_train, got_val, expected):
    """got_train and got_val split `expected` (documents of tokens, all distinct) in two, each keeping its order."""
    held = set(map(tuple, got_val))
    assert len(held) == len(got_val)
    assert got_train == [d for d in expected if tuple(d) not in held]
    assert got_val == [d for d in expected if tuple(d) in held]


@pytest.fixture(scope="module")
def text_prepared(corpus, text_corpus):
    out = corpus["root"] / "text"
    return out, prepare_text(text_corpus["raw"], out, corpus["tokenizer"], val_fraction=0.25, chunk_size=2000, num_workers=1)


def test_prepare_text_every_format_with_a_validation_split(corpus, text_corpus, text_prepared):
    tokenizer = Tokenizer(corpus["tokenizer"])
    out, splits = text_prepared
    assert sorted(p.name for p in out.iterdir()) == ["train", "val"]
    # one worker: files in sorted order, documents in file order; each followed by EOS
    got_train = split_documents(read_tokens(out / "train"), tokenizer.eos_id)
    got_val = split_documents(read_tokens(out / "val"), tokenizer.eos_id)
    partition_in_order(got_train, got_val, expected_tokens(tokenizer, text_corpus["ordered"]))
    assert 10 < len(got_val) < 45  # a quarter of 107 documents
    # held out by document, not by file: some file gave documents to both
    val_texts = {tokenizer.decode(d[:-1]) for d in got_val}
    assert any(0 < sum(t in val_texts for t in texts if t) < len([t for t in texts if t]) for texts in text_corpus["docs"].values())

    train, val = (check_prepared_dir(out / split, tokenizer) for split in ("train", "val"))
    assert (train["split"], val["split"], train["recipe"], val["val_fraction"]) == ("train", "val", "text", 0.25)
    assert train["summary"]["files"] == 7 and not train["summary"]["bad_files"] and not train["summary"]["bad_rows"]
    assert train["summary"]["skipped_rows"] == 2  # the null and the empty text
    assert train["summary"]["documents"] == len(got_train) and train["summary"]["held_out"] == len(got_val)
    assert val["summary"]["documents"] == len(got_val) and splits["val"]["tokens"] == sum(map(len, got_val))
    assert all(c["dim"] <= 2000 for c in json.loads((out / "train" / "index.json").read_text())["chunks"])
    assert not list(out.parent.glob(".tmp-*"))


def test_prepare_text_split_is_the_same_on_every_run(corpus, text_corpus, text_prepared, tmp_path, capfd):
    """Another run, with two workers and a file added to the corpus, holds out the same documents of the
    files it had."""
    tokenizer = Tokenizer(corpus["tokenizer"])
    out, _ = text_prepared
    before = {tuple(d) for d in split_documents(read_tokens(out / "val"), tokenizer.eos_id)}
    raw = shutil.copytree(text_corpus["raw"], tmp_path / "raw")
    added = paragraphs(40, 28)
    write_json_lines(raw / "notes" / "added.jsonl", [{"text": t} for t in added])
    splits = prepare_text(raw, tmp_path / "again", corpus["tokenizer"], val_fraction=0.25, chunk_size=2000, num_workers=2)
    after = {tuple(d) for d in split_documents(read_tokens(tmp_path / "again" / "val"), tokenizer.eos_id)}
    added_tokens = {tuple(d) for d in expected_tokens(tokenizer, added)}
    assert after - added_tokens == before and after & added_tokens  # two workers: compared as sets
    # each input file's line says how many of its documents it held out; the val/ summary counts them all
    printed = capfd.readouterr().out
    assert re.search(rf"{re.escape(str(raw / 'notes' / 'added.jsonl'))}: \d+ documents, \d+ tokens, \d+ held out for validation", printed)
    assert f"Prepared {tmp_path / 'again' / 'val'}: 6/6 files, {len(after)} documents, {splits['val']['tokens']} tokens" in printed


def complete_lines(data: bytes) -> list:
    """The texts of the whole JSON lines in `data` (what a reader can use of a truncated file)."""
    return [json.loads(line)["text"] for line in data.split(b"\n")[:-1]]


def test_prepare_text_names_and_skips_bad_input(corpus, tmp_path, capfd):
    import gzip
    import zlib

    tokenizer = Tokenizer(corpus["tokenizer"])
    raw = tmp_path / "raw"
    good = paragraphs(10, 31)
    rows = [{"text": t} for t in good]
    rows[3:3] = ["not json {"]  # line 4
    rows[6:6] = [{"content": "no text field"}]  # line 7
    rows[8:8] = [b'{"text": "caf\xe9 in latin-1"}']  # line 9: not UTF-8
    rows += [{"text": "half an emoji \ud83d"}, {"text": 5}, "[1, 2]"]  # lines 14 to 16
    write_json_lines(raw / "lines.jsonl", rows)
    (raw / "corrupt.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage that is not a zstd frame")
    truncated = paragraphs(20, 32)
    write_json_lines(raw / "truncated.jsonl.zst", [{"text": t} for t in truncated], compress="zst", frames=4)
    whole = (raw / "truncated.jsonl.zst").read_bytes()
    cut = whole[: int(len(whole) * 0.6)]
    (raw / "truncated.jsonl.zst").write_bytes(cut)
    kept_zst = complete_lines(zstandard.ZstdDecompressor().stream_reader(cut, read_across_frames=True).read())
    gz_texts = paragraphs(20, 33)
    gz = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in gz_texts).encode())
    (raw / "truncated.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    kept_gz = complete_lines(zlib.decompressobj(wbits=31).decompress(gz[: len(gz) // 2]))
    assert 0 < len(kept_zst) < 20 and 0 < len(kept_gz) < 20
    pq.write_table(pa.table({"content": ["wrong column"]}), raw / "nocolumn.parquet")
    # three row groups of 7 rows, the middle one damaged
    damaged = paragraphs(21, 34)
    pq.write_table(pa.table({"text": damaged}), raw / "damaged.parquet", row_group_size=7, compression="zstd", use_dictionary=False)
    column = pq.ParquetFile(raw / "damaged.parquet").metadata.row_group(1).column(0)
    data = bytearray((raw / "damaged.parquet").read_bytes())
    for i in range(column.data_page_offset + 20, column.data_page_offset + column.total_compressed_size - 4):
        data[i] ^= 0x5A
    (raw / "damaged.parquet").write_bytes(bytes(data))
    not_utf8 = paragraphs(7, 35) + [b"bad \xff bytes"] + paragraphs(1, 36)
    column = pa.array([t if isinstance(t, bytes) else t.encode() for t in not_utf8], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": column}), raw / "badutf8.parquet")
    (raw / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (raw / "empty.jsonl").write_bytes(b"")
    write_json_lines(raw / "allbad.jsonl", ["{", {"body": "x"}])

    out = tmp_path / "out"
    cli_main(["prepare_text", "--input_dir", str(raw), "--output_dir", str(out), "--tokenizer_path", str(corpus["tokenizer"]),
              "--num_workers", "1", "--val_fraction", "0", "--chunk_size", "3000"])
    summary = check_prepared_dir(out / "train", tokenizer)["summary"]
    bad_files = {Path(b["path"]).name: (b["status"], b["reason"]) for b in summary["bad_files"]}
    assert bad_files == {
        "allbad.jsonl": ("skipped", "no usable document: 2 bad row(s)"),
        "corrupt.jsonl.zst": ("skipped", bad_files["corrupt.jsonl.zst"][1]),
        "empty.jsonl": ("skipped", "empty file: no documents"),
        "latin1.txt": ("skipped", "not UTF-8 text: invalid continuation byte at byte 3"),
        "nocolumn.parquet": ("skipped", "missing column 'text' (columns: content)"),
        "truncated.jsonl.gz": ("partial", bad_files["truncated.jsonl.gz"][1]),
        "truncated.jsonl.zst": ("partial", bad_files["truncated.jsonl.zst"][1]),
    }
    assert bad_files["corrupt.jsonl.zst"][1].startswith("corrupt zstd: ")
    assert re.fullmatch(r"corrupt gzip: Compressed file ended before the end-of-stream marker was reached after line \d+",
                        bad_files["truncated.jsonl.gz"][1])
    assert re.fullmatch(r"corrupt zstd: stream is truncated \(the last frame never ends\) after line \d+",
                        bad_files["truncated.jsonl.zst"][1])
    bad_rows = {Path(f["path"]).name: (f["bad_rows"], f["bad_rows_named"]) for f in summary["files_with_bad_rows"]}
    assert {Path(f["path"]).name: f["bad_rows_more"] for f in summary["files_with_bad_rows"]} == {
        "lines.jsonl": 3, "damaged.parquet": 0, "badutf8.parquet": 0, "allbad.jsonl": 0}
    assert bad_rows["lines.jsonl"][0] == 6 and bad_rows["lines.jsonl"][1] == [
        "line 4: invalid JSON: Expecting value (column 1)",
        "line 7: no field 'text' (fields: content; --text_key names the field to read)",
        "line 9: not UTF-8 (invalid continuation byte at byte 13)",
    ]
    assert bad_rows["damaged.parquet"][0] == 7 and bad_rows["damaged.parquet"][1][0].startswith(
        "row group 1 of 3 (rows 7 to 13): unreadable: ")
    assert bad_rows["badutf8.parquet"] == (1, ["row 7: not UTF-8 (invalid start byte at byte 4)"])
    assert summary["bad_rows"] == 6 + 7 + 1 + 2

    printed = capfd.readouterr()
    # each file named as it is read, with its bad rows; the summary at the end counts them
    assert re.search(r"lines\.jsonl: 10 documents, \d+ tokens; 6 bad row\(s\) left out: line 4: .*; and 3 more", printed.err)
    assert "SKIPPED " + str(raw / "latin1.txt") in printed.err and "PARTIAL " + str(raw / "truncated.jsonl.zst") in printed.err
    assert "7 bad file(s):" in printed.out and "16 bad row(s) left out, in 4 file(s):" in printed.out
    # --val_fraction 0: no validation split, and it says so
    assert f"No validation split: --val_fraction is 0, so {out / 'val'} is not written" in printed.out
    assert sorted(p.name for p in out.iterdir()) == ["train"]
    # one worker, sorted files: the good rows of each, and what the truncated files held before the break
    texts = not_utf8[:7] + not_utf8[8:] + damaged[:7] + damaged[14:] + good + kept_gz + kept_zst
    assert read_tokens(out / "train").tolist() == [t for doc in expected_tokens(tokenizer, texts) for t in doc]


@pytest.mark.parametrize("case", ["missing", "empty", "no corpus file", "pattern", "absolute pattern"])
def test_prepare_text_without_input_files_is_one_line(corpus, tmp_path, capfd, case):
    raw = tmp_path / "raw"
    if case != "missing":
        raw.mkdir()
    if case in ("no corpus file", "pattern"):
        (raw / "README.md").write_text("readme")
    if case in ("pattern", "absolute pattern"):
        (raw / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    pattern = {"pattern": ["--pattern", "*.parquet"], "absolute pattern": ["--pattern", str(raw / "*.jsonl")]}.get(case, [])
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare_text", "--input_dir", str(raw), "--output_dir", str(tmp_path / "out" / "text"),
                  "--tokenizer_path", str(corpus["tokenizer"]), *pattern])
    assert info.value.code == 2
    err = capfd.readouterr().err
    expected = {
        "missing": f"Input directory {str(raw)!r} does not exist",
        "empty": f"No input files under {raw} with --pattern '**/*': expected files ending in .jsonl, .jsonl.zst, "
                 ".jsonl.gz, .json.gz, .parquet, .txt; no file matches it",
        "no corpus file": "it holds 1 other file(s), e.g. README.md",
        "pattern": f"No input files under {raw} with --pattern '*.parquet'",
        "absolute pattern": f"--pattern '{raw / '*.jsonl'}': expected a glob relative to --input_dir, e.g. '**/*.parquet'",
    }[case]
    assert err.startswith("fabric-lin prepare_text: error: ") and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_prepare_text_refuses_a_finished_output_dir(corpus, text_corpus, text_prepared, capfd):
    out, _ = text_prepared
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare_text", "--input_dir", str(text_corpus["raw"]), "--output_dir", str(out),
                  "--tokenizer_path", str(corpus["tokenizer"])])
    assert info.value.code == 2
    assert f"Output directory {out} exists and is not empty: delete it or pick another" in capfd.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_prepare_text_interrupted_leaves_nothing_the_trainer_accepts(corpus, text_corpus, tmp_path, how):
    out = tmp_path / "interrupted"
    process = subprocess.Popen(
        [sys.executable, str(REPO / "data_prep" / "prepare_text.py"), "--input_dir", str(text_corpus["raw"]),
         "--output_dir", str(out), "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1", "--val_fraction", "0.25"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.time() + 60
        while not list(tmp_path.glob(".tmp-interrupted-*/.tmp-train-*")) and time.time() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be interrupted"
        if how == "SIGKILL":
            os.killpg(process.pid, signal.SIGKILL)
        else:
            time.sleep(1.0)
            process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0
    assert not out.exists()
    for split in ("train", "val"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            check_prepared_dir(out / split)
    if how == "SIGINT":  # Ctrl-C removes what the run wrote
        assert list(tmp_path.iterdir()) == []


def test_pretrain_on_prepare_text_output_and_resume(corpus, text_prepared, tmp_path):
    """`pretrain --data TextFiles` on prepare_text's train/ and val/ validates on val/; resumed from its
    step-2 checkpoint, a run logs the same losses and data at steps 3 and 4 and ends with the same weights."""
    import torch

    from conftest import logged_data_fingerprints

    out, _ = text_prepared
    common = ["pretrain", "--model_name", "gla-debug", "--data", "TextFiles", "--data.train_dir", str(out / "train"),
              "--data.val_dir", str(out / "val"), "--data.num_workers", "0", "--tokenizer_dir", str(corpus["tokenizer"]),
              "--train.max_steps", "4", "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
              "--train.max_seq_length", "32", "--train.save_interval", "2", "--eval.interval", "2", "--eval.max_iters", "1",
              "--logger_name", "csv"]
    cli_main([*common, "--out_dir", str(tmp_path / "whole")])
    cli_main([*common, "--out_dir", str(tmp_path / "resumed"), "--resume", str(tmp_path / "whole" / "step-00000002")])

    def logged(run):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in records if "loss" in r}, [r["step"] for r in records if "val_loss" in r]

    (whole, whole_val), (resumed, resumed_val) = logged("whole"), logged("resumed")
    assert sorted(whole) == [1, 2, 3, 4] and 2 in whole_val and 4 in whole_val and 4 in resumed_val
    assert {step: whole[step] for step in (3, 4)} == {step: resumed[step] for step in (3, 4)}
    fingerprints = logged_data_fingerprints(tmp_path / "whole")
    assert {s: fingerprints[s] for s in (3, 4)} == {s: logged_data_fingerprints(tmp_path / "resumed")[s] for s in (3, 4)}
    a, b = (torch.load(tmp_path / run / "final" / "lit_model.pth", weights_only=True)["model"] for run in ("whole", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
