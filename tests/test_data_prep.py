"""data_prep/: the SlimPajama and Starcoder preprocessors end to end through litdata's DataProcessor (every kind of
bad file named and skipped, fast_dev_run, the CLI), and what every preprocessor shares: an interrupted run leaves
nothing the trainer accepts, check_prepared_dir refuses incomplete and mismatched directories, the tokenizer trainer
skips bad files by name, documents tokenized in many groups lose nothing, every worker's report is read. (The
text-corpus preprocessor: test_prepare_text.py; the raw-file readers alone: test_raw_files.py.)"""
import json
import os
import re
import shutil
import signal
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from fabric_lin.data.recipe import REPORTS_DIR, run_recipe
from data_prep.prepare_slimpajama import prepare as prepare_slimpajama
from data_prep.prepare_text import TextRecipe
from fabric_lin.cli import main as cli_main
from fabric_lin.data import Tokenizer, check_prepared_dir
from fabric_lin.data.train_tokenizer import main as train_tokenizer
from fabric_lin.errors import UserError
from helpers import (REPO, expected_tokens, interrupt_preparation, paragraphs, read_tokens, split_documents,
                     write_json_lines, write_parquet_with_a_damaged_row_group)


def slimpajama_rows(seed, n=24):
    rows = []
    for i, text in enumerate(paragraphs(n, seed)):
        github = i % 4 == 1
        rows.append({"text": ("GITHUB ROW " if github else "") + text, "meta": {"redpajama_set_name": "RedPajamaGithub" if github else "RedPajamaC4"}})
    return rows


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, paragraphs_tokenizer):
    root = tmp_path_factory.mktemp("prep")
    sp, sc = root / "slimpajama-raw", root / "starcoder-raw"
    good_sp = {"a/part-0.jsonl.zst": slimpajama_rows(1), "b.jsonl.zst": slimpajama_rows(2), "c/d/part-1.jsonl.zst": slimpajama_rows(3)}
    for name, rows in good_sp.items():  # one file in two frames, one whose last line ends without a newline
        write_json_lines(sp / name, rows, "zst", frames=2 if name == "a/part-0.jsonl.zst" else 1,
                         final_newline=name != "b.jsonl.zst")
    # the bad SlimPajama files, one per kind
    (sp / "corrupt.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage that is not a zstd frame")
    whole = zstandard.ZstdCompressor().compress("".join(json.dumps(r) + "\n" for r in slimpajama_rows(4)).encode())
    (sp / "truncated.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    lines = "".join(json.dumps(r) + "\n" for r in slimpajama_rows(5, 3)) + '{"text": "unterminated\n'
    (sp / "badjson.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    rows = slimpajama_rows(6, 3)
    rows[1] = {"content": "no text field", "meta": {}}
    write_json_lines(sp / "notext.jsonl.zst", rows, "zst")
    (sp / "empty.jsonl.zst").write_bytes(b"")
    rows = slimpajama_rows(10, 3)
    rows[2]["text"] = "half an emoji \ud83d"  # a lone surrogate: json.dumps writes it as the escape \ud83d
    write_json_lines(sp / "surrogate.jsonl.zst", rows, "zst")

    good_sc = {"python/train-0.parquet": paragraphs(30, 7), "train-1.parquet": paragraphs(20, 8)}
    for name, texts in good_sc.items():
        (sc / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"max_stars_repo_path": ["x.py"] * len(texts), "content": texts}), sc / name, row_group_size=7)
    (sc / "garbage.parquet").write_bytes(b"PAR1 this is not a parquet file PAR1")
    # readable footer and first row group, corrupt second row group: found only while streaming
    partial = paragraphs(14, 9)
    write_parquet_with_a_damaged_row_group(sc / "partial.parquet", "content", partial)
    pq.write_table(pa.table({"text": ["wrong column"]}), sc / "nocontent.parquet")
    # a string column whose second row group holds bytes that are not UTF-8 (Arrow writes them unchecked)
    not_utf8 = paragraphs(7, 11) + [b"bad \xff bytes", b"more"]
    column = pa.array([t if isinstance(t, bytes) else t.encode() for t in not_utf8], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"content": column}), sc / "badutf8.parquet", row_group_size=7)
    (sc / "empty.parquet").write_bytes(b"")

    return {"root": root, "sp": sp, "sc": sc, "good_sp": good_sp, "good_sc": good_sc, "partial_sc": partial[:7],
            "badutf8_sc": not_utf8[:7], "tokenizer": paragraphs_tokenizer}


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
    # the rows the recipe's filter drops: how many in each file, and in the summary which rows, why and where
    assert re.search(r"part-0.jsonl.zst: 18 documents, \d+ tokens; 6 RedPajamaGithub rows left out \(Starcoder holds "
                     r"the code\)\n", printed.out)
    assert "\n18 RedPajamaGithub rows left out (Starcoder holds the code), in 3 of the 9 files\n" in printed.out

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


@pytest.mark.parametrize("recipe_name", ["slimpajama", "starcoder"])
def test_a_recipe_leaves_out_and_counts_the_documents_of_nothing_but_whitespace(paragraphs_tokenizer, tmp_path, capfd,
                                                                                recipe_name):
    """As prepare_text does: a document of whitespace alone (or of nothing: empty, or a null parquet row) is no
    document, where it was an end-of-text token alone; each is counted on its file's line and in its report (and
    SlimPajama's GitHub rows among the rows its filter drops, whatever they hold)."""
    from fabric_lin.data.recipe import EMPTY_DOCUMENTS, _read_reports
    from fabric_lin.data.slimpajama_starcoder import SlimPajamaRecipe, StarcoderRecipe

    texts = paragraphs(2, 12)
    if recipe_name == "slimpajama":
        c4 = {"redpajama_set_name": "RedPajamaC4"}
        rows = [{"text": texts[0], "meta": c4}, {"text": " \n\t ", "meta": c4}, {"text": "", "meta": c4},
                {"text": "  ", "meta": {"redpajama_set_name": "RedPajamaGithub"}}, {"text": texts[1], "meta": c4}]
        path, recipe_class, empty, skipped = tmp_path / "part.jsonl.zst", SlimPajamaRecipe, 2, 1
        write_json_lines(path, rows, "zst")
    else:
        path, recipe_class, empty, skipped = tmp_path / "part.parquet", StarcoderRecipe, 3, 0
        pq.write_table(pa.table({"content": [texts[0], " \n\t ", "", None, texts[1]]}), path)
    recipe = recipe_class(paragraphs_tokenizer, chunk_size=100_000)
    recipe.report_dir = str(tmp_path)
    tokens = [t for array in recipe.prepare_item(str(path)) for t in array.tolist()]
    expected = expected_tokens(Tokenizer(paragraphs_tokenizer), texts)
    assert tokens == [t for document in expected for t in document]
    [record] = _read_reports(tmp_path)
    assert (record["documents"], record["empty_documents"], record["skipped_rows"]) == (2, empty, skipped)
    assert f"; {empty} {EMPTY_DOCUMENTS}" in capfd.readouterr().out


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


def test_a_run_on_a_fast_dev_run_slice_says_it_reads_the_first_files_only(corpus, fast_prepared, capsys):
    from fabric_lin.data import TokenChunks

    out, _ = fast_prepared
    found = len(list(Path(corpus["sp"]).rglob("*.jsonl.zst")))
    TokenChunks(data_path=out).setup()  # as pretrain and evaluate check their directories
    assert (f"Note: {out} was prepared with --fast_dev_run 2: it holds the first 2 of the {found} files of {corpus['sp']} "
            "only; prepare it again without --fast_dev_run for all of them") in capsys.readouterr().out


def test_fast_dev_run_true_is_the_first_ten_files_whatever_the_workers(corpus, tmp_path, capfd):
    tokenizer = Tokenizer(corpus["tokenizer"])
    texts = paragraphs(12, 12)
    for i, text in enumerate(texts):
        write_json_lines(tmp_path / "raw" / f"part-{i:02d}.jsonl.zst", [{"text": text, "meta": {}}], "zst")
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


@pytest.mark.parametrize("command", ["prepare_slimpajama", "prepare_text"])
def test_the_working_directories_of_a_killed_preparation_are_named(corpus, tmp_path, capfd, command):
    """A run killed outright (SIGKILL: no handler runs) leaves its hidden working directories beside the output, up to
    a whole output's size each; the next run into that output said nothing of them."""
    write_json_lines(tmp_path / "raw" / "part-0.jsonl.zst", slimpajama_rows(1, 4), "zst")
    left = [tmp_path / ".tmp-out-0123abcd", tmp_path / ".tmp-cache-out-0123abcd"]
    others = [tmp_path / ".tmp-outer-0123abcd", tmp_path / ".tmp-out-x"]  # another output's; not a run's name
    for directory in left + others:
        (directory / "chunks").mkdir(parents=True)
    cli_main([command, "--input_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "out"),
              "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1"])
    printed = capfd.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("Note: ") and ".tmp-" in line]
    assert notes == [f"Note: {d} was left by a preparation of {tmp_path / 'out'} that was killed (or is running now): "
                     "delete it to free its space once none is running" for d in left]
    assert all(d.is_dir() for d in left + others)  # named, not deleted: a run into the same output may be writing it
    check_prepared_dir(tmp_path / "out" / ("train" if command == "prepare_text" else ""), Tokenizer(corpus["tokenizer"]))


@pytest.mark.parametrize("command", ["prepare_slimpajama", "prepare_starcoder"])
def test_an_input_without_the_recipe_s_files_is_one_line_before_litdata_starts(corpus, tmp_path, capfd, command):
    """An input directory of other files (your own .jsonl here) was refused after litdata's processor had started,
    its set-up lines ("Storing the files under ...", "Setup started ...") printed first; now the error alone, exit 2,
    nothing written beside the output."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "mine.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(SystemExit) as info:
        cli_main([command, "--input_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "out"),
                  "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1"])
    printed = capfd.readouterr()
    assert info.value.code == 2
    assert printed.out == ""
    assert printed.err.startswith(f"fabric-lin {command}: error: No *.") and printed.err.count("\n") == 1, printed.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


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
    raw, runs = tmp_path / "raw", tmp_path / "runs"
    for i in range(40):  # interrupted once the first is done, while the worker reads the others
        write_json_lines(raw / f"part-{i:03d}.jsonl.zst", slimpajama_rows(100 + i), "zst")
    runs.mkdir()
    out = runs / "interrupted"
    command = [sys.executable, str(REPO / "data_prep" / "prepare_slimpajama.py"), "--input_dir", str(raw),
               "--output_dir", str(out), "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1"]
    returncode = interrupt_preparation(command, runs, f".tmp-interrupted-*/{REPORTS_DIR}/*.jsonl", how)
    assert returncode == -getattr(signal, how)  # Ctrl-C: ended as interrupted (by SIGINT), not as failed
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_prepared_dir(out)
    if how == "SIGKILL":
        (partial,) = runs.glob(".tmp-interrupted-*")
        with pytest.raises(FileNotFoundError, match="no index.json"):
            check_prepared_dir(partial)
    else:  # Ctrl-C stops the workers and removes what the run wrote
        assert list(runs.iterdir()) == []


def test_prepare_slimpajama_stopped_by_sigterm_is_one_line_with_143(corpus, tmp_path):
    """A scheduler's SIGTERM to the job (fabric-lin and its workers) mid-run: it ends as Ctrl-C does, in one line, with
    the exit code of a job stopped by SIGTERM (143), removing what it wrote; its input stays as it was."""
    from fabric_lin_process import FABRIC_LIN

    raw, runs = tmp_path / "raw", tmp_path / "runs"
    for i in range(40):  # interrupted once the first is done, while the worker reads the others
        write_json_lines(raw / f"part-{i:03d}.jsonl.zst", slimpajama_rows(100 + i), "zst")
    runs.mkdir()
    before = {path: path.read_bytes() for path in raw.iterdir()}
    command = [*FABRIC_LIN, "prepare_slimpajama", "--input_dir", str(raw), "--output_dir", str(runs / "interrupted"),
               "--tokenizer_path", str(corpus["tokenizer"]), "--num_workers", "1"]
    returncode = interrupt_preparation(command, runs, f".tmp-interrupted-*/{REPORTS_DIR}/*.jsonl", "SIGTERM to the job",
                                       stderr=tmp_path / "stderr")
    said = (tmp_path / "stderr").read_text()
    assert returncode == 128 + signal.SIGTERM, said[-3000:]
    assert said.splitlines()[-1] == ("fabric-lin prepare_slimpajama: stopped by SIGTERM: nothing half-written is left; "
                                     "run the same command again") and "Traceback" not in said, said[-3000:]
    assert list(runs.iterdir()) == []
    assert {path: path.read_bytes() for path in raw.iterdir()} == before


def test_a_signal_stops_the_workers_before_the_run_ends(tmp_path):
    """SIGINT/SIGTERM in the main process: every worker is told to stop and ended before KeyboardInterrupt is raised,
    so the caller's removal of the unfinished output is not raced by a worker still writing into it; in a worker
    (a signal to the whole job) the worker ends at once with 128 + the signal's number."""
    import multiprocessing
    import time

    from fabric_lin.data.recipe import InterruptibleDataProcessor

    (tmp_path / "raw").mkdir()
    processor = InterruptibleDataProcessor(input_dir=str(tmp_path / "raw"), output_dir=str(tmp_path / "out"),
                                           num_workers=1)
    processor._main_pid = os.getpid()  # as its run() records it
    fork = multiprocessing.get_context("fork")
    worker_in_the_job = fork.Process(target=processor._signal_handler, args=(signal.SIGTERM, None))
    worker_in_the_job.start()
    worker_in_the_job.join(10)
    assert worker_in_the_job.exitcode == 128 + signal.SIGTERM
    processor.workers = [fork.Process(target=time.sleep, args=(60,))]
    processor.stop_queues = [fork.Queue()]
    processor.workers[0].start()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        processor._signal_handler(signal.SIGTERM, None)
    assert processor.workers[0].exitcode == -signal.SIGTERM
    assert processor.stop_queues[0].get(timeout=5) is None


class RecipeOfAWorkerKilled(TextRecipe):
    """prepare_text's recipe, whose worker is killed (as the out-of-memory killer does) when it starts reading the
    file named `killed_before`, or once it has reported the file named `killed_after` (its last chunk unwritten), or
    exits with status 3 (as a library's exit() would) when it starts reading the file named `exits_before`."""

    def __init__(self, *args, killed_before: str = "", killed_after: str = "", exits_before: str = "", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.killed_before, self.killed_after, self.exits_before = killed_before, killed_after, exits_before

    def read_documents(self, path):
        if Path(path).name == self.killed_before:
            os.kill(os.getpid(), signal.SIGKILL)
        if Path(path).name == self.exits_before:
            os._exit(3)
        yield from super().read_documents(path)

    def _write_report(self, record):
        super()._write_report(record)
        if Path(record["path"]).name == self.killed_after:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("killed,how", [({"killed_before": "doc-2.txt"}, "killed by SIGKILL"),
                                        ({"killed_after": "doc-3.txt"}, "killed by SIGKILL"),
                                        ({"exits_before": "doc-2.txt"}, "exit code 3")])
def test_a_worker_killed_mid_run_fails_the_run_and_leaves_no_output(paragraphs_tokenizer, tmp_path, capfd, killed, how):
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    for i in range(4):
        (raw / f"doc-{i}.txt").write_text(paragraphs(1, 200 + i)[0], encoding="utf-8")
    recipe = RecipeOfAWorkerKilled(paragraphs_tokenizer, 4096, raw, **killed)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(UserError) as info:
        run_recipe(recipe, raw, out, num_workers=1)
    # the run's own handlers (which stop its workers) are gone with it
    assert {signum: signal.getsignal(signum) for signum in handlers} == handlers
    assert str(info.value) == (
        f"1 of the 1 worker processes ended before finishing their files ({how}; the out-of-memory killer "
        f"sends SIGKILL): their files' tokens would be missing, so {out} was not written; run again, with fewer "
        f"--num_workers if memory is short")
    assert "Prepared" not in capfd.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw"]


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


def test_train_tokenizer_names_the_bad_files_and_rows(corpus, tmp_path, capfd):
    """The bad files of both corpora, lone surrogates and bytes that are not UTF-8 among them, read as prepare_text
    reads them: a file that cannot be read is skipped, one that breaks off is read up to the break, a bad row is
    left out; each is named."""
    train_tokenizer(corpus["sp"], tmp_path / "tok", vocab_size=400, num_threads=1)
    printed = capfd.readouterr()
    for name in ("corrupt.jsonl.zst", "empty.jsonl.zst", "truncated.jsonl.zst"):  # the last: cut inside its one frame
        assert re.search(rf"SKIPPED \S*{re.escape(name)}: ", printed.err), name
    for name, row in (("surrogate.jsonl.zst", "line 3: field 'text' is not valid Unicode"),
                      ("badjson.jsonl.zst", "line 4: invalid JSON"), ("notext.jsonl.zst", "line 2: no field 'text'")):
        assert f"{corpus['sp'] / name}: 1 bad row(s) left out: {row}" in printed.err, name
    assert "from 6 file(s); 3 unreadable file(s) skipped; 3 bad row(s) left out\n" in printed.out
    assert Tokenizer(tmp_path / "tok").vocab_size == 400

    train_tokenizer(corpus["sc"], tmp_path / "tok-code", text_key="content", vocab_size=400, num_threads=1)
    printed = capfd.readouterr()
    for name in ("garbage.parquet", "nocontent.parquet", "empty.parquet"):
        assert re.search(rf"SKIPPED \S*{re.escape(name)}: ", printed.err), name
    assert f"{corpus['sc'] / 'badutf8.parquet'}: 1 bad row(s) left out: row 7: not UTF-8" in printed.err
    assert f"{corpus['sc'] / 'partial.parquet'}: 7 bad row(s) left out: row group 1 of 2 (rows 7 to 13)" in printed.err
    assert Tokenizer(tmp_path / "tok-code").vocab_size == 400


def test_documents_are_tokenized_in_groups_and_arrays_without_loss(paragraphs_tokenizer, monkeypatch):
    """TokenizeRecipe.tokenize encodes documents in groups of about ENCODE_GROUP_CHARS characters and cuts their
    tokens into arrays of at most chunk_size: with both small, every document's tokens come out once, in order,
    wherever the groups and arrays end (the end-to-end corpora above fit one group)."""
    import numpy as np

    from fabric_lin.data import recipe as recipe_module

    monkeypatch.setattr(recipe_module, "ENCODE_GROUP_CHARS", 1000)
    recipe = recipe_module.TokenizeRecipe(paragraphs_tokenizer, chunk_size=100)
    groups = []
    encode_batch = recipe.tokenizer.encode_batch
    monkeypatch.setattr(recipe.tokenizer, "encode_batch", lambda texts, **kw: groups.append(len(texts)) or encode_batch(texts, **kw))
    texts = paragraphs(12, 42)
    arrays = list(recipe.tokenize(texts))
    expected = expected_tokens(Tokenizer(paragraphs_tokenizer), texts)
    assert np.concatenate(arrays).tolist() == [t for doc in expected for t in doc]
    assert len(groups) > 2 and sum(groups) == len(texts) and max(map(len, arrays)) == 100


def test_worker_reports_are_read_to_their_last_line(tmp_path):
    from fabric_lin.data.recipe import _read_reports, file_record

    records = [file_record(f"/raw/{name}.jsonl.zst", documents=i) for i, name in enumerate("cab")]
    (tmp_path / "worker-1.jsonl").write_text(json.dumps(records[0]) + "\n" + json.dumps(records[1]) + "\n")
    (tmp_path / "worker-2.jsonl").write_text(json.dumps(records[2]))  # a last line without its newline
    assert _read_reports(tmp_path) == sorted(records, key=lambda r: r["path"])


def test_a_file_report_starts_a_line_of_its_own_beside_the_progress_bar(corpus, tmp_path, monkeypatch):
    """A worker's line for a file never runs into litdata's progress bar, which is drawn on stderr without a newline."""
    from fabric_lin.data.recipe import on_a_line_of_its_own
    from fabric_lin.data.slimpajama_starcoder import SlimPajamaRecipe

    path = corpus["sp"] / "b.jsonl.zst"
    bar = "\rProgress:  50%|#####     | 1/2"
    with open(tmp_path / "log", "w", encoding="utf-8") as log:  # stdout and stderr to one file: `> log 2>&1`
        monkeypatch.setattr(sys, "stdout", log)
        monkeypatch.setattr(sys, "stderr", log)
        log.write(bar)
        list(SlimPajamaRecipe(corpus["tokenizer"], 2000).prepare_item(str(path)))
    assert (tmp_path / "log").read_bytes().decode().startswith(f"{bar}\n{path}: 18 documents, ")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:  # `> out 2> err`: no bar in out
        monkeypatch.setattr(sys, "stderr", err)
        assert on_a_line_of_its_own(out) == "" and on_a_line_of_its_own(err) == "\n"
    terminal, other_end = os.openpty()
    with os.fdopen(other_end, "w") as stream:  # on a terminal the line erases the bar, which is drawn again below
        assert on_a_line_of_its_own(stream) == "\r\033[K"
    os.close(terminal)


def test_another_run_that_finished_first_keeps_its_output(paragraphs_tokenizer, tmp_path, monkeypatch):
    """Two runs into one output_dir: the one that finishes second refuses to rename its output over the first one's (the
    rename onto a non-empty directory failed with the OS's traceback, its whole output left in a hidden directory)."""
    from fabric_lin.data import recipe as recipe_module
    from fabric_lin.errors import AlreadyExists

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("\n\n".join(paragraphs(4, 1)), encoding="utf-8")
    out = tmp_path / "runs" / "out"
    write_prepared_info = recipe_module.write_prepared_info

    def the_other_run_finishes_first(directory, **fields):
        out.mkdir()
        (out / "index.json").write_text("the other run's")
        return write_prepared_info(directory, **fields)

    monkeypatch.setattr(recipe_module, "write_prepared_info", the_other_run_finishes_first)
    with pytest.raises(AlreadyExists, match=f"^Output directory {re.escape(str(out))} was written by another run while this "
                                            f"one ran$"):
        run_recipe(TextRecipe(paragraphs_tokenizer, 2000, tmp_path / "raw"), tmp_path / "raw", out, num_workers=1)
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["out"]  # this run's hidden output removed
    assert [p.read_text() for p in out.iterdir()] == ["the other run's"]


def test_zero_workers_or_none_is_one_per_core():
    from fabric_lin.data.recipe import check_num_workers

    check_num_workers(0)
    check_num_workers(None)
    with pytest.raises(ValueError, match="--num_workers -1: expected a number of worker processes"):
        check_num_workers(-1)


def test_the_cores_a_preparation_divides_are_those_it_may_use_not_the_machine_s(paragraphs_tokenizer, tmp_path,
                                                                                  monkeypatch):
    """A scheduler's allocation (or taskset) of 3 cores of a 64-core machine: prepare's default is 3 workers of one
    thread each, 1 worker gets the 3 threads, and the tokenizer trainer 3 threads: 64 workers or threads would take
    turns on those 3."""
    import sentencepiece as spm

    import fabric_lin.data.recipe as recipe_module
    from data_prep.prepare_text import TextRecipe
    from fabric_lin.data.train_tokenizer import write_tokenizer

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    started = []
    monkeypatch.setattr(recipe_module, "_run_into",
                        lambda recipe, input_dir, output_dir, tokenizer, num_workers, *rest: started.append(
                            (num_workers, recipe.num_threads)))
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("a document\n")
    for num_workers in (None, 1):
        run_recipe(TextRecipe(paragraphs_tokenizer, 2000, tmp_path / "raw"), tmp_path / "raw", tmp_path / "out",
                   num_workers=num_workers)
    assert started == [(3, 1), (1, 3)]

    trained_with = {}

    def trainer(**options):
        trained_with.update(options)
        raise RuntimeError("stopped once its options are known")

    monkeypatch.setattr(spm.SentencePieceTrainer, "train", trainer)
    with pytest.raises(RuntimeError, match="stopped once its options are known"):
        write_tokenizer(["a line"], tmp_path / "tok", vocab_size=300)
    assert trained_with["num_threads"] == 3


def test_bad_rows_are_counted_by_row_their_reports_past_three_by_report_and_each_file_on_its_own(paragraphs_tokenizer,
                                                                                                 tmp_path):
    """A file's report names its first three reports of bad rows and counts the others ("and 2 more"), a damaged row
    group being one report of many rows; a worker's next file starts from no bad rows."""
    from fabric_lin.data.recipe import TokenizeRecipe

    recipe = TokenizeRecipe(paragraphs_tokenizer, chunk_size=100)
    for rows, reason in ((1, "line 1"), (1, "line 2"), (1, "line 3"), (7, "row group 1"), (1, "line 20")):
        recipe.skip_bad_rows(rows, reason)
    assert (recipe._bad_rows, recipe._bad_rows_named, recipe._bad_rows_more) == (11, ["line 1", "line 2", "line 3"], 2)

    raw = tmp_path / "raw"
    write_json_lines(raw / "a.jsonl", ["{"] * 5)
    write_json_lines(raw / "b.jsonl", ["{"])
    text_recipe = TextRecipe(paragraphs_tokenizer, 2000, raw)
    text_recipe.report_dir = str(tmp_path)
    for name in ("a.jsonl", "b.jsonl"):  # one worker, both files
        assert list(text_recipe.prepare_item(str(raw / name))) == []
    ((report,),) = [list(tmp_path.glob("worker-*.jsonl"))]
    records = [json.loads(line) for line in report.read_text().splitlines()]
    assert [(r["bad_rows"], len(r["bad_rows_named"]), r["bad_rows_more"]) for r in records] == [(5, 3, 2), (1, 1, 0)]


def test_the_summary_names_three_files_of_empty_documents_and_counts_the_held_out(tmp_path):
    from fabric_lin.data.recipe import file_record, format_summary, summarize

    records = [file_record(f"/raw/{name}.jsonl", documents=10, tokens=100) for name in "abcde"]
    for record, empty in zip(records, (1, 2, 0, 3, 4)):
        record["empty_documents"] = empty
    records[0]["held_out"] = 5
    assert format_summary(summarize(records), "Prepared out", 2.0).split("\n") == [
        "Prepared out: 5/5 files, 50 documents, 500 tokens in 2.0s (250 tokens/s)",
        "10 empty or whitespace-only document(s) left out, in 4 file(s): /raw/a.jsonl (1), /raw/b.jsonl (2), "
        "/raw/d.jsonl (3), and 1 more",
        "5 documents held out for the validation split",
    ]


def test_options_checked_before_a_preparation_are_named_in_one_line():
    from fabric_lin.data.recipe import check_chunk_size, require_flags
    from fabric_lin.errors import InvalidValue

    with pytest.raises(InvalidValue, match=r"^--chunk_size True: expected at least 2 tokens per chunk file "):
        check_chunk_size(True)  # a bool is an int to Python
    with pytest.raises(InvalidValue, match=r"^--input_dir, --output_dir are required$"):
        require_flags(input_dir=None, output_dir=None, tokenizer_path="tokenizer")
    with pytest.raises(InvalidValue, match=r"^--output_dir is required$"):
        require_flags(input_dir="raw", output_dir=None)


def test_a_fast_dev_run_of_more_files_than_there_are_reads_them_all_and_leaves_the_start_method(paragraphs_tokenizer,
                                                                                                  tmp_path, capfd):
    """fast_dev_run 5 of 2 files says the 2 it reads; litdata forces the multiprocessing start method for its workers,
    which this process gets back (a trainer that prepares its sample corpus starts its DataLoader workers after)."""
    import multiprocessing

    raw = tmp_path / "raw"
    raw.mkdir()
    for name, seed in (("a.txt", 1), ("b.txt", 2)):
        (raw / name).write_text("\n\n".join(paragraphs(3, seed)), encoding="utf-8")
    before = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    try:
        summary = run_recipe(TextRecipe(paragraphs_tokenizer, 2000, raw), raw, tmp_path / "out", num_workers=1,
                             fast_dev_run=5)
        assert multiprocessing.get_start_method(allow_none=True) == "spawn"
    finally:
        multiprocessing.set_start_method(before, force=True)
    assert summary["files"] == 2
    assert "fast_dev_run: the first 2 of the 2 input files (sorted by path)\n" in capfd.readouterr().out
