"""data_prep/prepare_text.py: any corpus of JSON lines (plain, zstd in several frames, gzip), parquet and text files,
end to end through litdata's DataProcessor: every format read in order, a validation split held out by document and
the same on every run, bad input named and skipped (files and rows), no input files in one line, a finished output
refused, an interrupted run leaves nothing the trainer accepts, and pretrain on its output resumes exactly."""
import json
import re
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from fabric_lin.data.recipe import REPORTS_DIR
from data_prep.prepare_text import prepare as prepare_text
from fabric_lin.cli import main as cli_main
from fabric_lin.data import Tokenizer, check_prepared_dir
from fabric_lin.data.tokenizer import describe_tokenizer
from helpers import (REPO, cli_error, expected_tokens, interrupt_preparation, paragraphs, read_tokens, split_documents,
                     train_sentencepiece, write_json_lines, write_parquet_with_a_damaged_row_group)


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory):
    """A corpus in every format prepare_text reads, and its documents file by file in sorted order (None:
    an empty document, which is dropped). Some JSON-lines files end without a newline, as real shards may."""
    raw = tmp_path_factory.mktemp("prepare_text") / "text-raw"
    docs = {}
    web = paragraphs(30, 21)
    web[4], web[17] = None, ""
    docs["web/part-000.parquet"] = web
    (raw / "web").mkdir(parents=True)
    pq.write_table(pa.table({"id": list(range(30)), "text": web}), raw / "web" / "part-000.parquet", row_group_size=10)
    docs["web/part-001.jsonl.zst"] = paragraphs(25, 22)
    write_json_lines(raw / "web" / "part-001.jsonl.zst", [{"id": i, "text": t, "url": "x"} for i, t in enumerate(docs["web/part-001.jsonl.zst"])],
                     compress="zst", frames=3, final_newline=False)
    docs["notes/a.jsonl"] = paragraphs(20, 23)
    write_json_lines(raw / "notes" / "a.jsonl", [r for t in docs["notes/a.jsonl"] for r in ({"text": t}, "")])  # blank lines between
    docs["notes/b.jsonl.gz"] = paragraphs(15, 24)
    write_json_lines(raw / "notes" / "b.jsonl.gz", [{"text": t} for t in docs["notes/b.jsonl.gz"]], compress="gz",
                     final_newline=False)
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
def text_prepared(paragraphs_tokenizer, text_corpus):
    out = text_corpus["raw"].parent / "text"
    return out, prepare_text(text_corpus["raw"], out, paragraphs_tokenizer, val_fraction=0.25, chunk_size=2000, num_workers=1)


def test_prepare_text_every_format_with_a_validation_split(paragraphs_tokenizer, text_corpus, text_prepared):
    tokenizer = Tokenizer(paragraphs_tokenizer)
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
    assert train["summary"]["skipped_rows"] == 0  # prepare_text filters nothing
    # the null and the empty text, counted where they are
    assert train["summary"]["files_with_empty_documents"] == [
        {"path": str(text_corpus["raw"] / "web" / "part-000.parquet"), "empty_documents": 2}]
    assert train["summary"]["empty_documents"] == 2
    assert train["summary"]["documents"] == len(got_train) and train["summary"]["held_out"] == len(got_val)
    assert val["summary"]["documents"] == len(got_val) and splits["val"]["tokens"] == sum(map(len, got_val))
    assert all(c["dim"] <= 2000 for c in json.loads((out / "train" / "index.json").read_text())["chunks"])
    assert not list(out.parent.glob(".tmp-*"))
    for split in ("train", "val"):  # the chunks, their index, prepared.json and the tokenizer: no working files
        chunks = [c["filename"] for c in json.loads((out / split / "index.json").read_text())["chunks"]]
        assert sorted(p.name for p in (out / split).iterdir()) == sorted(
            [*chunks, "index.json", "prepared.json", "tokenizer.model", "tokenizer_config.json"])


def test_prepare_text_split_is_the_same_on_every_run(paragraphs_tokenizer, text_corpus, text_prepared, tmp_path, capfd):
    """Another run, with two workers and a file added to the corpus, holds out the same documents of the
    files it had."""
    tokenizer = Tokenizer(paragraphs_tokenizer)
    out, _ = text_prepared
    before = {tuple(d) for d in split_documents(read_tokens(out / "val"), tokenizer.eos_id)}
    raw = shutil.copytree(text_corpus["raw"], tmp_path / "raw")
    added = paragraphs(40, 28)
    write_json_lines(raw / "notes" / "added.jsonl", [{"text": t} for t in added], final_newline=False)
    splits = prepare_text(raw, tmp_path / "again", paragraphs_tokenizer, val_fraction=0.25, chunk_size=2000, num_workers=2)
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


def test_prepare_text_names_and_skips_bad_input(paragraphs_tokenizer, tmp_path, capfd):
    import gzip
    import zlib

    tokenizer = Tokenizer(paragraphs_tokenizer)
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
    write_parquet_with_a_damaged_row_group(raw / "damaged.parquet", "text", damaged)
    not_utf8 = paragraphs(7, 35) + [b"bad \xff bytes"] + paragraphs(1, 36)
    column = pa.array([t if isinstance(t, bytes) else t.encode() for t in not_utf8], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": column}), raw / "badutf8.parquet")
    (raw / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (raw / "empty.jsonl").write_bytes(b"")
    write_json_lines(raw / "allbad.jsonl", ["{", {"body": "x"}])

    out = tmp_path / "out"
    cli_main(["prepare_text", "--input_dir", str(raw), "--output_dir", str(out), "--tokenizer_path", str(paragraphs_tokenizer),
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
    # the partial files count as read (their documents before the damage are kept), the skipped ones do not
    assert f"Prepared {out / 'train'}: 5/10 files (2 partial), {summary['documents']} documents" in printed.out
    assert "rows left out by the recipe's filter" not in printed.out  # prepare_text filters nothing
    # --val_fraction 0: no validation split, and it says so
    assert f"No validation split: --val_fraction is 0, so {out / 'val'} is not written" in printed.out
    assert sorted(p.name for p in out.iterdir()) == ["train"]
    # one worker, sorted files: the good rows of each, and what the truncated files held before the break
    texts = not_utf8[:7] + not_utf8[8:] + damaged[:7] + damaged[14:] + good + kept_gz + kept_zst
    assert read_tokens(out / "train").tolist() == [t for doc in expected_tokens(tokenizer, texts) for t in doc]


# Python 3.13's glob matches files with a trailing **; earlier ones only folders
TRAILING_GLOBSTAR_MATCHES_FOLDERS = sys.version_info < (3, 13)


@pytest.mark.parametrize("case", ["missing", "a file", "empty", "no corpus file", "pattern", "absolute pattern", pytest.param(
    "trailing **", marks=pytest.mark.skipif(not TRAILING_GLOBSTAR_MATCHES_FOLDERS, reason="this Python's sub/** matches files"))])
def test_prepare_text_without_input_files_is_one_line(paragraphs_tokenizer, tmp_path, capfd, case):
    raw = tmp_path / "raw"
    if case == "a file":  # one file of the corpus given as --input_dir
        raw.write_text("one document")
    elif case != "missing":
        raw.mkdir()
    if case in ("no corpus file", "pattern"):
        (raw / "README.md").write_text("readme")
    if case in ("pattern", "absolute pattern"):
        (raw / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    if case == "trailing **":
        (raw / "sub" / "2024").mkdir(parents=True)
        (raw / "sub" / "2024" / "a.jsonl").write_text(json.dumps({"text": "a"}) + "\n")
    pattern = {"pattern": ["--pattern", "*.parquet"], "absolute pattern": ["--pattern", str(raw / "*.jsonl")],
               "trailing **": ["--pattern", "sub/**"]}.get(case, [])
    with pytest.raises(SystemExit) as info:
        cli_main(["prepare_text", "--input_dir", str(raw), "--output_dir", str(tmp_path / "out" / "text"),
                  "--tokenizer_path", str(paragraphs_tokenizer), *pattern])
    assert info.value.code == 2
    err = capfd.readouterr().err
    expected = {
        "missing": f"Input directory {str(raw)!r} does not exist",
        "a file": f"Input directory {str(raw)!r} is a file, expected the directory of the input files: give "
                  f"--input_dir {raw.parent} --pattern {raw.name} to read it alone",
        "empty": f"No input files under {raw} with --pattern '**/*': expected files ending in .jsonl, .jsonl.zst, "
                 ".jsonl.gz, .json.gz, .parquet, .txt; no file matches it",
        "no corpus file": "it holds 1 other file(s), e.g. README.md",
        "pattern": f"No input files under {raw} with --pattern '*.parquet'",
        "absolute pattern": f"--pattern '{raw / '*.jsonl'}': expected a glob relative to --input_dir, e.g. '**/*.parquet'",
        "trailing **": "no file matches it (a trailing ** matches folders: for every file below them, --pattern 'sub/**/*')",
    }[case]
    assert err.startswith("fabric-lin prepare_text: error: ") and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_a_validation_split_smaller_than_a_sample_is_said_at_prepare_time_and_still_validates(paragraphs_tokenizer,
                                                                                              tmp_path, capfd):
    """prepare_data.md's TextFiles road on a small corpus: prepare_text says when its val/ holds fewer tokens than a
    sample of config_hub's recipes, and a run at a length it does hold validates on it, on fewer blocks than a
    micro batch."""
    from fabric_lin.args import EvalArgs, TrainArgs
    from fabric_lin.data import TextFiles
    from fabric_lin.data.prepared import chunk_tokens
    from helpers import metrics_records, setup_pretrain

    raw, out = tmp_path / "raw", tmp_path / "text"
    write_json_lines(raw / "a.jsonl", [{"text": t} for t in paragraphs(60, 31)])
    splits = prepare_text(raw, out, paragraphs_tokenizer, val_fraction=0.05, chunk_size=4000, num_workers=1)
    val = splits["val"]
    assert 0 < val["tokens"] < 2049
    printed = capfd.readouterr().out
    assert (f"Note: {out / 'val'} holds {val['tokens']} tokens, too few for validation at train.max_seq_length "
            f"{val['tokens']} or more (config_hub's recipes train at 2048): raise --val_fraction (0.05 held out "
            f"{val['documents']} of {val['documents'] + splits['train']['documents']} documents)\n") in printed

    seq = val["tokens"] // 3 - 1  # three samples in the split, fewer than the micro batch of 4
    setup_pretrain(tmp_path, out_dir=tmp_path / "run", data=TextFiles(train_dir=out / "train", val_dir=out / "val", num_workers=0),
                   train=TrainArgs(global_batch_size=4, micro_batch_size=4, max_steps=1, max_seq_length=seq),
                   eval=EvalArgs(max_iters=1))
    (validation,) = [r for r in metrics_records(tmp_path / "run") if "val_loss" in r]
    assert validation["val_tokens"] == int((chunk_tokens(out / "val") // (seq + 1)).sum()) * seq == 3 * seq


def test_prepare_text_refuses_a_finished_output_dir_naming_its_tokenizer_and_the_runs(paragraphs_tokenizer, text_corpus,
                                                                                      text_prepared, capfd, tmp_path):
    out, _ = text_prepared
    train_sentencepiece(tmp_path / "other")
    made_with = describe_tokenizer({"tokenizer": Tokenizer(paragraphs_tokenizer).record()})
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    for tokenizer, this in ((paragraphs_tokenizer, "the same tokenizer"),
                            (tmp_path / "other", describe_tokenizer({"tokenizer": Tokenizer(tmp_path / "other").record()}))):
        with pytest.raises(SystemExit) as info:
            cli_main(["prepare_text", "--input_dir", str(text_corpus["raw"]), "--output_dir", str(out),
                      "--tokenizer_path", str(tokenizer)])
        assert info.value.code == 2
        assert (f"Output directory {out} exists and is not empty: it holds data prepared with the tokenizer {made_with} "
                f"(in train/), and this run's --tokenizer_path is {this}; delete it to prepare it again, or pick another"
                ) in capfd.readouterr().err
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_sigterm_between_the_two_splits_removes_the_working_directory(paragraphs_tokenizer, tmp_path, monkeypatch):
    """SIGTERM after the training split, before the validation split (litdata's processor, which answers it during its
    run, has ended): the run stops as interrupted and removes its working directory, not by SIGTERM's default action,
    which would end the process and leave the working directory behind."""
    import os

    import data_prep.prepare_text as module

    raw, runs = tmp_path / "raw", tmp_path / "runs"
    raw.mkdir()
    runs.mkdir()
    for i in range(4):
        (raw / f"doc-{i}.txt").write_text("\n\n".join(paragraphs(6, 300 + i)), encoding="utf-8")

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)

    def default_action(signum, frame):  # where SIGTERM's default action would have ended the process
        raise AssertionError("SIGTERM reached the handler outside the run")

    monkeypatch.setattr(module, "write_held_out_split", terminated)
    previous = signal.signal(signal.SIGTERM, default_action)
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            prepare_text(raw, runs / "out", paragraphs_tokenizer, val_fraction=0.5, num_workers=1)
        assert signal.getsignal(signal.SIGTERM) is default_action
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(runs.iterdir()) == []


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT", "SIGTERM", "SIGTERM to the job"])
def test_prepare_text_interrupted_leaves_nothing_the_trainer_accepts(paragraphs_tokenizer, tmp_path, how):
    raw, runs = tmp_path / "raw", tmp_path / "runs"
    raw.mkdir()
    for i in range(40):  # interrupted once the first is done, while the worker reads the others
        (raw / f"doc-{i:03d}.txt").write_text("\n\n".join(paragraphs(24, 100 + i)), encoding="utf-8")
    runs.mkdir()
    out = runs / "interrupted"
    command = [sys.executable, str(REPO / "data_prep" / "prepare_text.py"), "--input_dir", str(raw),
               "--output_dir", str(out), "--tokenizer_path", str(paragraphs_tokenizer), "--num_workers", "1",
               "--val_fraction", "0.25"]
    returncode = interrupt_preparation(command, runs, f".tmp-interrupted-*/.tmp-train-*/{REPORTS_DIR}/*.jsonl", how)
    # Ctrl-C and SIGTERM end the script as interrupted, not as a failure of its own: Python ends on the
    # KeyboardInterrupt by SIGINT
    assert returncode == (-signal.SIGKILL if how == "SIGKILL" else -signal.SIGINT)
    assert not out.exists()
    for split in ("train", "val"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            check_prepared_dir(out / split)
    if how != "SIGKILL":  # Ctrl-C and SIGTERM stop the workers and remove what the run wrote
        assert list(runs.iterdir()) == []


@pytest.fixture(scope="module")
def prepared_again(paragraphs_tokenizer, text_corpus, text_prepared):
    """The corpus of text_prepared prepared again into another directory, with --val_fraction 0: its train/ holds every
    document of text_prepared's train/ and val/, in other chunk files under another index.json."""
    again = text_corpus["raw"].parent / "again"
    prepare_text(text_corpus["raw"], again, paragraphs_tokenizer, val_fraction=0, chunk_size=2000, num_workers=1)
    tokenizer = Tokenizer(paragraphs_tokenizer)
    out, _ = text_prepared
    documents = {split: {tuple(d) for d in split_documents(read_tokens(path), tokenizer.eos_id)}
                 for split, path in (("train", out / "train"), ("val", out / "val"), ("again", again / "train"))}
    assert documents["val"] and documents["again"] == documents["train"] | documents["val"]
    return again


def text_files(tokenizer_dir, **dirs):
    from fabric_lin.data import TextFiles

    data = TextFiles(**dirs, num_workers=0)
    data.connect(Tokenizer(tokenizer_dir), batch_size=1, max_seq_length=8)
    data.setup()
    return data


def test_the_same_input_prepared_twice_is_refused_in_one_mix(paragraphs_tokenizer, text_corpus, text_prepared,
                                                             prepared_again):
    """Two preparations of one corpus mixed would read each document twice in an epoch. The error names both
    directories and the input; one preparation's train/ and val/ (other documents) still mix."""
    out, _ = text_prepared
    source = f"text of {text_corpus['raw']}, --pattern '**/*', --text_key 'text'"
    with pytest.raises(ValueError, match=rf"^data.train_dir lists {re.escape(str(out / 'train'))} and "
                                         rf"{re.escape(str(prepared_again / 'train'))}, two preparations of one input "
                                         rf"\({re.escape(source)}: their prepared.json\): .* would be read twice in an "
                                         r"epoch; list one of them and give it a larger share with data.train_weights$"):
        text_files(paragraphs_tokenizer, train_dir=[out / "train", out / "val", prepared_again / "train"])
    data = text_files(paragraphs_tokenizer, train_dir=[out / "train", out / "val"])
    assert next(iter(data.train_dataloader())).shape == (1, 9)


def test_validating_on_documents_another_preparation_trains_on_is_warned_of(paragraphs_tokenizer, text_corpus,
                                                                           text_prepared, prepared_again, capsys):
    """A val/ of one preparation (--val_fraction 0.25) with the train/ of another of the same corpus that held out a
    smaller share (0 here) measures the loss on training documents: said once, naming both. With its own train/ it
    is not."""
    out, _ = text_prepared
    capsys.readouterr()
    text_files(paragraphs_tokenizer, train_dir=out / "train", val_dir=out / "val")
    assert "Warning" not in capsys.readouterr().out
    text_files(paragraphs_tokenizer, train_dir=[prepared_again / "train"], val_dir=out / "val")
    printed = capsys.readouterr().out
    assert printed.startswith(f"Warning: data.val_dir {out / 'val'} holds documents that data.train_dir "
                              f"{prepared_again / 'train'} trains on: both were prepared from text of {text_corpus['raw']}")
    assert "(--val_fraction 0.25 and 0)" in printed and printed.count("\n") == 1


def test_each_training_directory_s_prepared_json_is_read_once_in_setup(paragraphs_tokenizer, text_prepared,
                                                                       monkeypatch):
    """Every check of the directories' prepared.json (complete, one tokenizer, one preparation per input, validation
    documents trained on) reads it from the one read of setup()."""
    out, _ = text_prepared
    reads = []
    read_text = Path.read_text

    def counted_read_text(path, *args, **kwargs):
        if path.name == "prepared.json":
            reads.append(path.parent)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted_read_text)
    text_files(paragraphs_tokenizer, train_dir=[out / "train"], val_dir=out / "val")
    assert sorted(reads) == sorted([out / "train", out / "val"]), reads


def test_pretrain_on_prepare_text_output_and_resume(paragraphs_tokenizer, text_prepared, tmp_path):
    """`pretrain --data TextFiles` on prepare_text's train/ and val/ validates on val/; resumed from its
    step-2 checkpoint, a run logs the same losses and data at steps 3 and 4 and ends with the same weights."""
    import torch

    from conftest import logged_data_fingerprints

    out, _ = text_prepared
    common = ["pretrain", "--model_name", "gla-debug", "--data", "TextFiles", "--data.train_dir", str(out / "train"),
              "--data.val_dir", str(out / "val"), "--data.num_workers", "0", "--tokenizer_dir", str(paragraphs_tokenizer),
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


# ---- decoding: a byte order mark, Windows line ends, documents that hold nothing but whitespace

BOM = b"\xef\xbb\xbf"


def write_decoding_corpus(raw: Path) -> None:
    """A .jsonl and a .jsonl.gz that start with a UTF-8 byte order mark (rows 1 and 2 empty or whitespace only), a
    .txt with a BOM and CRLF line ends, and a .txt of whitespace only."""
    import gzip

    raw.mkdir(parents=True)
    rows = BOM + b"".join(json.dumps(r).encode() + b"\n" for r in ({"text": "first row"}, {"text": " \r\n\t"},
                                                                     {"text": None}, {"text": "last row"}))
    (raw / "a.jsonl").write_bytes(rows)
    (raw / "b.jsonl.gz").write_bytes(gzip.compress(rows))
    (raw / "c.txt").write_bytes(BOM + b"line one\r\nline two\r\n")
    (raw / "d.txt").write_bytes(b" \r\n\t \r\n")


def test_decoding_drops_the_bom_and_crlf_and_leaves_out_blank_documents(tmp_path):
    from fabric_lin.data.raw_files import iter_text_documents

    write_decoding_corpus(tmp_path / "raw")
    read = {}
    for path in sorted((tmp_path / "raw").iterdir()):
        batches = list(iter_text_documents(path))
        assert not [bad for batch in batches for bad in batch.bad], path
        read[path.name] = [(i, t) for batch in batches for i, t in zip(batch.indices, batch.texts)], \
            [i for batch in batches for i in batch.empty]
    rows = ([(0, "first row"), (3, "last row")], [1, 2])  # the BOM is not part of the first row, which is kept
    assert read == {"a.jsonl": rows, "b.jsonl.gz": rows, "c.txt": ([(0, "line one\nline two\n")], []), "d.txt": ([], [0])}


def test_blank_documents_are_counted_per_file_and_never_held_out(paragraphs_tokenizer, tmp_path, capsys):
    """TextRecipe on each file, as a worker runs it: every usable document held out (--val_fraction close to 1),
    the blank ones neither tokenized nor held out, and counted on the file's line."""
    from data_prep.prepare_text import HELD_OUT_SUFFIX, TextRecipe

    tokenizer = Tokenizer(paragraphs_tokenizer)
    raw, held_out_dir = tmp_path / "raw", tmp_path / "held-out"
    write_decoding_corpus(raw)
    recipe = TextRecipe(paragraphs_tokenizer, 2000, raw, val_fraction=1 - 2**-60, held_out_dir=held_out_dir)
    for name in ("a.jsonl", "c.txt", "d.txt"):
        assert list(recipe.prepare_item(str(raw / name))) == []  # all held out: no training tokens
    held = {p.name: split_documents(np.fromfile(p, dtype=np.uint16), tokenizer.eos_id) for p in held_out_dir.iterdir()}
    assert held == {"a.jsonl" + HELD_OUT_SUFFIX: expected_tokens(tokenizer, ["first row", "last row"]),
                    "c.txt" + HELD_OUT_SUFFIX: expected_tokens(tokenizer, ["line one\nline two\n"])}
    printed = capsys.readouterr()
    assert f"{raw / 'a.jsonl'}: 0 documents, 0 tokens, 2 held out for validation; 2 empty or whitespace-only " \
           "document(s) left out\n" in printed.out
    assert f"SKIPPED {raw / 'd.txt'}: no usable document: 1 empty or whitespace-only document(s)\n" in printed.err


def test_a_file_broken_off_after_documents_all_held_out_is_partial(paragraphs_tokenizer, tmp_path, capsys):
    """A truncated file whose documents before the break all went to the validation split was reported SKIPPED (as if
    it gave nothing), without the count of those documents, and left out of the files read."""
    import gzip
    import zlib

    from data_prep.prepare_text import HELD_OUT_SUFFIX, TextRecipe

    raw = tmp_path / "raw"
    raw.mkdir()
    gz = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in paragraphs(20, 33)).encode())
    (raw / "cut.jsonl.gz").write_bytes(gz[: len(gz) // 2])
    kept = complete_lines(zlib.decompressobj(wbits=31).decompress(gz[: len(gz) // 2]))
    assert 0 < len(kept) < 20
    recipe = TextRecipe(paragraphs_tokenizer, 2000, raw, val_fraction=1 - 2**-60, held_out_dir=tmp_path / "held-out")
    recipe.report_dir = str(tmp_path)
    assert list(recipe.prepare_item(str(raw / "cut.jsonl.gz"))) == []  # every document held out
    held = np.fromfile(tmp_path / "held-out" / ("cut.jsonl.gz" + HELD_OUT_SUFFIX), dtype=np.uint16)
    assert split_documents(held, Tokenizer(paragraphs_tokenizer).eos_id) == expected_tokens(Tokenizer(paragraphs_tokenizer), kept)
    reason = f"corrupt gzip: Compressed file ended before the end-of-stream marker was reached after line {len(kept)}"
    assert capsys.readouterr().err.split("\n") == ["", f"PARTIAL {raw / 'cut.jsonl.gz'}: {reason} (0 documents kept, "
                                                      f"{len(kept)} held out for validation)", ""]
    ((report,),) = [list(tmp_path.glob("worker-*.jsonl"))]
    record = json.loads(report.read_text())
    assert (record["status"], record["reason"], record["held_out"]) == ("partial", reason, len(kept))


def test_a_file_broken_off_after_blank_documents_alone_counts_them_on_its_line(paragraphs_tokenizer, tmp_path, capsys):
    """A skipped file's line left its blank documents out, as if its reason counted them: that of a file with no usable
    document does, that of a file broken off after blank documents alone ("after line 3") does not."""
    from data_prep.prepare_text import TextRecipe

    raw = tmp_path / "raw"
    raw.mkdir()
    compress = zstandard.ZstdCompressor().compress
    blank_frame = compress(b"".join(json.dumps({"text": " \n "}).encode() + b"\n" for _ in range(3)))
    cut_frame = compress("".join(json.dumps({"text": t}) + "\n" for t in paragraphs(20, 33)).encode())
    (raw / "cut.jsonl.zst").write_bytes(blank_frame + cut_frame[: len(cut_frame) // 2])  # the second frame never ends
    recipe = TextRecipe(paragraphs_tokenizer, 2000, raw)
    assert list(recipe.prepare_item(str(raw / "cut.jsonl.zst"))) == []
    assert capsys.readouterr().err.split("\n") == [
        "", f"SKIPPED {raw / 'cut.jsonl.zst'}: corrupt zstd: stream is truncated (the last frame never ends) after line 3; "
            "3 empty or whitespace-only document(s) left out", ""]


@pytest.mark.parametrize("chunk_size", ["0", "-2049", "1"])
def test_a_chunk_size_that_holds_no_sample_is_one_line(paragraphs_tokenizer, text_corpus, tmp_path, capsys, chunk_size):
    """Below 2 tokens, a chunk file holds no sample at any train.max_seq_length (1 or more): 1 wrote a file per token,
    which pretrain then refused."""
    for command in ("prepare_text", "prepare_slimpajama", "prepare_starcoder"):
        err = cli_error([command, "--input_dir", str(text_corpus["raw"]), "--output_dir", str(tmp_path / "out"),
                         "--tokenizer_path", str(paragraphs_tokenizer), "--chunk_size", chunk_size], capsys)
        assert err.endswith(f"error: --chunk_size {chunk_size}: expected at least 2 tokens per chunk file (pretrain reads "
                            "each sample, train.max_seq_length + 1 tokens, from within one chunk file)\n"), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fraction", ["1", "-0.1"])
def test_a_val_fraction_outside_0_to_1_is_one_line(paragraphs_tokenizer, text_corpus, tmp_path, capsys, fraction):
    # 1 would hold out every document, leaving nothing to train on
    err = cli_error(["prepare_text", "--input_dir", str(text_corpus["raw"]), "--output_dir", str(tmp_path / "out"),
                     "--tokenizer_path", str(paragraphs_tokenizer), "--val_fraction", fraction], capsys)
    assert f"error: --val_fraction {float(fraction)}: expected a share of the documents, at least 0 and below 1\n" in err, err
    assert not (tmp_path / "out").exists()


def test_held_out_documents_are_the_share_asked_for_and_differ_by_file():
    from data_prep.prepare_text import held_out

    lines = range(20_000)
    for fraction in (0.001, 0.05, 0.5):
        share = sum(held_out("web/part-000.parquet", i, fraction) for i in lines) / len(lines)
        assert share == pytest.approx(fraction, rel=0.25), fraction
    # the file's path takes part: two files hold out other line numbers, about 5% of 5% in common
    a, b = ({i for i in lines if held_out(path, i, 0.05)} for path in ("notes/a.jsonl", "notes/b.jsonl"))
    assert len(a & b) < 0.2 * len(a)


def test_a_negative_worker_count_is_one_line(paragraphs_tokenizer, text_corpus, tmp_path, capsys):
    # litdata took -1 workers and read nothing, which then read as "every file was bad or empty"
    for command in ("prepare_text", "prepare_slimpajama", "prepare_starcoder"):
        err = cli_error([command, "--input_dir", str(text_corpus["raw"]), "--output_dir", str(tmp_path / "out"),
                         "--tokenizer_path", str(paragraphs_tokenizer), "--num_workers", "-1"], capsys)
        assert "error: --num_workers -1: expected a number of worker processes (0 or none given: one per CPU core)\n" in err, err
    assert not (tmp_path / "out").exists()


def test_a_negative_fast_dev_run_is_one_line(paragraphs_tokenizer, text_corpus, tmp_path, capsys):
    # files[:-1]: a run on every file but the last, its first line saying "the first -1 of the N input files"
    for command in ("prepare_text", "prepare_slimpajama", "prepare_starcoder"):
        err = cli_error([command, "--input_dir", str(text_corpus["raw"]), "--output_dir", str(tmp_path / "out"),
                         "--tokenizer_path", str(paragraphs_tokenizer), "--fast_dev_run", "-1"], capsys)
        assert err.endswith("error: --fast_dev_run -1: expected true (the first 10 files), a number of files to read "
                            "(the first ones, sorted by path) or false (0: every file)\n"), err
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_without_an_end_of_text_token_is_one_line(text_corpus, tmp_path, capsys):
    """Every document is written with EOS after it: a tokenizer that defines none is refused before any worker starts
    (it was a traceback from within litdata's worker, for each of the three commands)."""
    import sentencepiece as spm

    (tmp_path / "tok").mkdir()
    (tmp_path / "text.txt").write_text("\n".join(f"a line of text number {i}" for i in range(100)))
    spm.SentencePieceTrainer.Train(input=str(tmp_path / "text.txt"), model_prefix=str(tmp_path / "tok" / "tokenizer"),
                                   vocab_size=40, model_type="bpe", unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, minloglevel=2)
    for command in ("prepare_text", "prepare_slimpajama", "prepare_starcoder"):
        err = cli_error([command, "--input_dir", str(text_corpus["raw"]), "--output_dir", str(tmp_path / "out"),
                         "--tokenizer_path", str(tmp_path / "tok"), "--num_workers", "1"], capsys)
        assert f"error: --tokenizer_path {tmp_path / 'tok'}: {tmp_path / 'tok' / 'tokenizer.model'} defines no " \
               f"end-of-text (EOS) token, which follows every document" in err, err
    assert not (tmp_path / "out").exists()
    tokenizer = Tokenizer(tmp_path / "tok")  # a caller of its own that asks for EOS
    for encode in (lambda: tokenizer.encode("a line", eos=True), lambda: tokenizer.encode_batch(["a line"], eos=True)):
        with pytest.raises(ValueError, match=f"^{tmp_path / 'tok' / 'tokenizer.model'} defines no EOS token; call "
                                             f"encode with eos=False$"):
            encode()


def test_another_run_that_finished_first_keeps_its_output(paragraphs_tokenizer, tmp_path, monkeypatch):
    """Two runs into one --output_dir: the one that finishes second refuses to rename its output over the first one's
    (the rename onto a non-empty directory would fail with the OS's traceback)."""
    import data_prep.prepare_text as prepare_text_module
    from fabric_lin.errors import AlreadyExists

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("a document", encoding="utf-8")
    out = tmp_path / "out"

    def the_other_run_finishes_first(stage, *args):
        (out / "train").mkdir(parents=True)
        (stage / "train").mkdir()
        return {"train": {}, "val": None}

    monkeypatch.setattr(prepare_text_module, "_prepare_into", the_other_run_finishes_first)
    with pytest.raises(AlreadyExists, match=f"^Output directory {re.escape(str(out))} was written by another run while this "
                                            f"one ran$"):
        prepare_text(tmp_path / "raw", out, paragraphs_tokenizer, num_workers=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "raw"] and [p.name for p in out.iterdir()] == ["train"]
