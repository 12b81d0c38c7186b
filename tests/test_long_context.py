"""The long-context table's plan and data, on the CPU: the long-document corpus (fabric_lin/data/long_documents.py)
holds whole documents made of the files they name and EOS, each a chunk file of its own, none both held out and
trained on (the training loader reads no held-out token); benchmarks/long_context.py's GPU plan (its defaults: every
family at 2K to 32K) fits the corpus's real splits, and a plan that does not is refused before any cell runs, naming
each part; the script runs its cells in processes of their own on the CPU with tiny models, every context predicting
the same held-out tokens, and merges the rows into one JSON document; the tokens/s of a step, the retry of a part out
of memory with activation checkpointing, the merge by cell and the table's columns and notes are checked on hand-made
timings and rows, and how calls fill one --out file on stand-in cells. The corpus is built once per installed torch
into its cache (~12 s of CPU, then read); its build is also checked on a few files with its lengths made small, and
its name, documents and summary on their own."""
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from litdata.streaming import StreamingDataset, TokensLoader

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fabric_lin_process  # noqa: E402
import long_context  # noqa: E402
from fabric_lin.data.long_documents import (  # noqa: E402
    MIN_DOCUMENT_TOKENS,
    VAL_WINDOWS_PER_DOCUMENT,
    WINDOW,
    group_documents,
    python_files,
    source_root,
)


@pytest.fixture(scope="module")
def corpus():
    """The long-document corpus in its usual cache (built there the first time) and its corpus.json."""
    from fabric_lin.data import LongDocuments

    data = LongDocuments()
    data.prepare_data()
    return data, json.loads((data.data_path / "corpus.json").read_text())


def lies_in(tokens: bytes, piece: np.ndarray) -> bool:
    """Whether `piece` occurs in `tokens` (uint16 bytes) at a token boundary."""
    needle = piece.astype(np.uint16).tobytes()
    at = tokens.find(needle)
    while at >= 0 and at % 2:
        at = tokens.find(needle, at + 1)
    return at >= 0


def test_documents_are_directories_grown_until_long_enough():
    """Directories deepest first; a short one goes up into its parent's document, the root's rest is left out."""
    root = Path("/site/torch")
    tokens = {
        "a/x.py": MIN_DOCUMENT_TOKENS,  # a/ alone is long enough
        "a/b/y.py": 10, "a/b/c/z.py": MIN_DOCUMENT_TOKENS - 10,  # c/ too short: it goes up, b/ then has enough
        "d/w.py": 5, "d/e/v.py": 5,  # too short: d/ goes up to the root, which then has too few too
        "u.py": 100,
    }
    files = sorted((root / name for name in tokens), key=lambda p: p.relative_to(root).as_posix())
    counts = [tokens[p.relative_to(root).as_posix()] for p in files]
    documents = [(name, [files[i].relative_to(root).as_posix() for i in members])
                 for name, members in group_documents(root, files, counts)]
    assert documents == [("torch/a", ["a/x.py"]), ("torch/a/b", ["a/b/c/z.py", "a/b/y.py"])]


def test_the_corpus_holds_whole_documents_of_the_files_they_name(corpus):
    from fabric_lin.data import Tokenizer
    from fabric_lin.data.prepared import chunk_tokens

    data, info = corpus
    train = [d for d in info["documents"] if d["split"] == "train"]
    val = [d for d in info["documents"] if d["split"] == "val"]
    assert len(val) >= 2 and len(train) > len(val)
    assert all(d["tokens"] >= MIN_DOCUMENT_TOKENS for d in train)
    assert all(2 * WINDOW <= d["tokens"] <= VAL_WINDOWS_PER_DOCUMENT * WINDOW for d in val)
    # no file in two documents; every source file in one, but what the package's own directory was left with
    named = [name for d in info["documents"] for name in d["files"]]
    assert len(named) == len(set(named))
    root = source_root()
    assert len(set(named)) + info["left_out_files"] == len(python_files(root))
    assert all(name.startswith(f"{root.name}/") and name.count("/") == 1 for name in set(
        (Path(root.name) / p.relative_to(root)).as_posix() for p in python_files(root)) - set(named))
    # each document a chunk file of its own, in order: a block never spans two documents
    assert chunk_tokens(data.train_path).tolist() == [d["tokens"] for d in train]
    assert chunk_tokens(data.val_path).tolist() == [d["tokens"] for d in val]
    assert info["train"]["tokens"] == sum(d["tokens"] for d in train)
    assert info["val"]["blocks"]["32768"] == sum(d["tokens"] // WINDOW for d in val)

    # the first held-out document, as the validation loader reads it, against its files tokenized here
    tokenizer = Tokenizer(data.tokenizer_dir)
    first = val[0]
    texts = [f"# {name}\n\n" + (root.parent / name).read_text(encoding="utf-8", errors="replace") for name in first["files"]]
    expected = np.concatenate([tokenizer.encode(text).numpy() for text in texts] + [np.array([tokenizer.eos_id])])
    data.connect(tokenizer, batch_size=1, max_seq_length=32768)
    data.setup()
    loader_windows = [batch[0].numpy() for batch in data.val_dataloader()]
    first_windows = np.concatenate(loader_windows[: first["tokens"] // WINDOW])
    np.testing.assert_array_equal(first_windows, expected[: len(first_windows)])

    # the training loader reads the training documents only: none of its blocks lies in a held-out document, whose
    # tokens the validation loader gave whole (each is VAL_WINDOWS_PER_DOCUMENT windows long)
    held_out = np.concatenate(loader_windows).astype(np.uint16).tobytes()
    assert lies_in(held_out, loader_windows[5][1000:3049])
    data.connect(tokenizer, batch_size=64, max_seq_length=2048)
    data.setup()
    training = next(iter(data.train_dataloader()))
    assert training.shape == (64, 2049) and not any(lies_in(held_out, block.numpy()) for block in training)

    # a whole training document, as litdata reads it, is its files' tokens and EOS
    shortest = min(range(len(train)), key=lambda i: train[i]["tokens"])
    length = train[shortest]["tokens"]
    dataset = StreamingDataset(str(data.train_path), item_loader=TokensLoader(block_size=length), shuffle=False)
    document = np.asarray(dataset[sum(d["tokens"] // length for d in train[:shortest])])
    texts = [f"# {name}\n\n" + (root.parent / name).read_text(encoding="utf-8", errors="replace")
             for name in train[shortest]["files"]]
    np.testing.assert_array_equal(document, np.concatenate([tokenizer.encode(text).numpy() for text in texts]
                                                           + [np.array([tokenizer.eos_id])]))

    # the benchmark's held-out windows: each document's first, then each one's second
    windows = long_context.held_out_windows(data, 32768, len(val) + 1, tokenizer.vocab_size)
    starts = np.cumsum([0] + [d["tokens"] // WINDOW for d in val])
    for got, index in zip(windows, [*starts[:-1], starts[0] + 1]):
        np.testing.assert_array_equal(got.numpy(), loader_windows[index])


def test_pretrain_and_evaluate_take_it_as_their_data(corpus, tmp_path):
    """`--data LongDocuments` on both command lines; evaluate also rebuilds it from the run's hyperparameters.yaml."""
    from fabric_lin.cli import main as cli_main

    out = tmp_path / "out"
    cli_main(["pretrain", "--model_name", "gla-debug", "--data", "LongDocuments", "--devices", "1", "--out_dir", str(out),
              "--logger_name", "csv", "--train.max_seq_length", "64", "--train.micro_batch_size", "2",
              "--train.global_batch_size", "2", "--train.max_steps", "1", "--eval.max_iters", "1"])
    run = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in record for record in run)
    for data in ([], ["--data", "LongDocuments"]):
        evaluated = tmp_path / ("evaluate-given-data" if data else "evaluate-run-data")
        cli_main(["evaluate", str(out / "final"), *data, "--seq_len", "[64, 128]", "--max_batches", "1",
                  "--bucket_edges", "[16, 64]", "--out_dir", str(evaluated)])
        results = json.loads((evaluated / "evaluate.json").read_text())
        assert results["data"]["class_path"] == "fabric_lin.data.long_documents.LongDocuments"
        assert [length["by_position"]["start"] for length in results["lengths"]] == [[0, 16], [0, 16, 64]]
        assert [length["tokens"] for length in results["lengths"]] == [2 * 64, 2 * 128]


def test_the_gpu_plan_fits_the_corpus_and_a_plan_that_does_not_is_refused(corpus):
    """The GPU's command is the script's defaults (with --families / --contexts picking cells)."""
    plan = long_context.check_plan(long_context.parse_args(["--device", "cpu"]))
    assert [(c["family"], c["context"]) for c in plan["cells"]] == [
        (family, context) for context in (2048, 8192, 16384, 32768) for family in ("transformer", "gla", "gdn", "deltanet")]
    assert [c["micro_batch"] for c in plan["cells"][::4]] == [16, 4, 2, 1]
    assert plan["held_out_tokens"] == 16 * 32768
    assert plan["corpus"]["fingerprint"] == corpus[0].data_path.name

    held_out = plan["corpus"]["val"]["blocks"]["32768"]
    with pytest.raises(SystemExit) as refused:
        long_context.check_plan(long_context.parse_args(["--device", "cpu", "--val_windows", str(held_out + 1)]))
    assert f"the held-out split gives {held_out} windows of 32769 tokens, {held_out + 1} were asked" in str(refused.value)
    blocks_at_2k = plan["corpus"]["train"]["blocks"]["2048"]
    with pytest.raises(SystemExit) as refused:
        long_context.check_plan(long_context.parse_args(
            ["--device", "cpu", "--contexts", "2048", "4194304", "--eval_window", "4194304", "--tokens_per_step", "4194304"]))
    problems = str(refused.value).splitlines()[1:]
    assert problems[0] == (f"  context 2048: the quality runs read 614400 blocks of 2049 tokens (--quality_steps x micro "
                           f"batch 2048), the training split holds {blocks_at_2k}: lower --quality_steps")
    # in the script's own terms (--contexts, --eval_window), not pretrain's train.max_seq_length and chunk_size
    longest = {split: max(d["tokens"] for d in corpus[1]["documents"] if d["split"] == split)
               for split in ("train", "val")}
    assert problems[1] == (f"  context 4194304: a training block of 4194305 tokens lies within one document, and the "
                           f"longest training document holds {longest['train']}: leave it out of --contexts")
    assert problems[2] == (f"  --eval_window 4194304: a held-out window of 4194305 tokens lies within one document, "
                           f"and the longest held-out document holds {longest['val']}: lower --eval_window (with the "
                           f"contexts it is a multiple of)")
    assert len(problems) == 3
    with pytest.raises(SystemExit, match="context 3000: --tokens_per_step 32768 and --eval_window 32768 must be multiples"):
        long_context.check_plan(long_context.parse_args(["--device", "cpu", "--contexts", "3000"]))
    # the tokens per step fit, the held-out window does not: that context would predict fewer held-out tokens
    with pytest.raises(SystemExit, match="context 3000: --tokens_per_step 30000 and --eval_window 32768 must be mult"):
        long_context.check_plan(long_context.parse_args(["--device", "cpu", "--contexts", "3000",
                                                         "--tokens_per_step", "30000"]))


def test_the_plan_s_edges_a_block_or_window_that_just_fits_and_one_token_more(corpus):
    """A context whose block (context + 1 tokens) fills the longest training document exactly fits, one token more is
    refused in the script's words; so is a held-out window, and the quality runs reading every block there is; a
    context over --tokens_per_step (no whole block a step) is named, not run into the loader."""
    longest = {split: max(d["tokens"] for d in corpus[1]["documents"] if d["split"] == split)
               for split in ("train", "val")}

    def problems(*argv):
        with pytest.raises(SystemExit) as refused:
            long_context.check_plan(long_context.parse_args(["--device", "cpu", "--families", "gla", *argv]))
        return str(refused.value).splitlines()[1:]

    def only(context, eval_window, *argv):
        return ["--contexts", str(context), "--tokens_per_step", str(context), "--eval_window", str(eval_window), *argv]

    train, val = longest["train"], longest["val"]
    window_refused = (f"  --eval_window {{0}}: a held-out window of {{1}} tokens lies within one document, and the "
                      f"longest held-out document holds {val}: lower --eval_window (with the contexts it is a multiple "
                      f"of)")
    assert problems(*only(train - 1, train - 1, "--quality_steps", "1")) == [
        window_refused.format(train - 1, train)]
    assert problems(*only(train, train, "--quality_steps", "1")) == [
        f"  context {train}: a training block of {train + 1} tokens lies within one document, and the longest "
        f"training document holds {train}: leave it out of --contexts", window_refused.format(train, train + 1)]
    assert problems(*only(val, val, "--quality_steps", "1")) == [window_refused.format(val, val + 1)]
    # the held-out window filling each held-out document, and the quality runs reading every training block of it
    windows = sum(d["tokens"] // val for d in corpus[1]["documents"] if d["split"] == "val")
    blocks = sum(d["tokens"] // val for d in corpus[1]["documents"] if d["split"] == "train")
    plan = long_context.check_plan(long_context.parse_args(
        ["--device", "cpu", "--families", "gla", *only(val - 1, val - 1, "--quality_steps", str(blocks),
                                                       "--val_windows", str(windows))]))
    assert plan["cells"] == [{"family": "gla", "context": val - 1, "micro_batch": 1, "training_blocks": blocks}]
    assert plan["held_out_tokens"] == windows * (val - 1)
    assert problems(*only(val - 1, val - 1, "--quality_steps", str(blocks + 1), "--val_windows", str(windows))) == [
        f"  context {val - 1}: the quality runs read {blocks + 1} blocks of {val} tokens (--quality_steps x micro "
        f"batch 1), the training split holds {blocks}: lower --quality_steps"]
    assert problems("--contexts", "65536", "--eval_window", "65536", "--val_windows", "1") == [
        "  context 65536: --tokens_per_step 32768 and --eval_window 65536 must be multiples of it (the same tokens per "
        "step and held-out tokens)"]


def test_pieces_of_the_held_out_windows_predict_the_same_tokens_at_every_context():
    windows = torch.randint(0, 100, (2, 8 + 1))
    for context, batch_size in ((2, 3), (4, 2), (8, 1)):
        pieces = long_context.Pieces(windows, context, batch_size)
        batches = list(pieces)
        assert len(batches) == len(pieces) == -(-2 * 8 // context // batch_size)
        rows = torch.cat(batches)
        assert rows.shape == (2 * 8 // context, context + 1)
        for w, window in enumerate(windows):
            own = rows[w * (8 // context) : (w + 1) * (8 // context)]
            assert torch.equal(own[:, :-1].flatten(), window[:-1]) and torch.equal(own[:, 1:].flatten(), window[1:])


@pytest.mark.slow
def test_the_script_runs_cells_in_processes_and_merges_their_rows(corpus, tmp_path, monkeypatch):
    """The script's main as `python benchmarks/long_context.py ...` calls it, here in this process; each cell's
    process (`python long_context.py --worker ...`) forked from an interpreter that has imported torch
    (fabric_lin_process), without ~4 s of imports each."""
    def run_forked(command, capture_output, text, timeout):
        assert capture_output and text
        return fabric_lin_process.run(command, timeout, scripts=True)

    out = tmp_path / "long_context.json"
    tiny = ["--device", "cpu", "--size", "debug", "--quality_layers", "1", "--tokens_per_step", "2048",
            "--contexts", "2048", "--eval_window", "2048", "--speed_warmup", "0", "--speed_steps", "1",
            "--quality_steps", "1", "--val_windows", "2"]
    monkeypatch.setattr(long_context, "subprocess",
                        types.SimpleNamespace(run=run_forked, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "long_context.py"), *tiny, "--families", "gla",
                                      "transformer", "--out", str(out)])
    long_context.main()
    document = json.loads(out.read_text())
    assert document["settings"]["corpus_fingerprint"] == corpus[0].data_path.name
    rows = document["rows"]
    assert [(r["family"], r["context"]) for r in rows] == [("transformer", 2048), ("gla", 2048)]
    for row in rows:
        speed, quality = row["speed"], row["quality"]
        assert speed["model"] == f"{row['family']}-debug" and speed["tokens_per_s"] > 0
        assert speed["micro_batch"] == quality["micro_batch"] == 1
        assert quality["val_tokens"] == 2 * 2048 == sum(quality["by_position"]["tokens"])
        assert quality["val_perplexity"] == pytest.approx(math.exp(quality["val_loss"]), rel=1e-3)
        assert row["run"]["command"].startswith("python ") and row["seconds"] > 0
    assert rows[0]["quality"]["held_out_fingerprint"] == rows[1]["quality"]["held_out_fingerprint"]
    table = document["table"].splitlines()
    assert table[0].startswith("| family | context | micro batch | tokens/s |") and len(table) == 4
    gla = rows[1]
    assert f"| gla | 2,048 | 1 | {gla['speed']['tokens_per_s']:,} | - | {gla['quality']['val_perplexity']:.2f} |" in table[3]

    # a later call's row of the same cell replaces the earlier one; a file of another plan is refused
    again = dict(rows[1], seconds=1.0)
    assert long_context.merged(rows, again) == [rows[0], again]
    with pytest.raises(SystemExit, match="holds the rows of another plan \\(quality_steps 1 there, 2 here\\)"):
        long_context.earlier_rows(str(out), dict(document["settings"], quality_steps=2))


def test_speed_is_the_tokens_of_a_step_over_the_median_timed_step(corpus, monkeypatch):
    """The table's tokens/s: --tokens_per_step over the median of the steps after the warm-up, each step a micro batch
    of tokens_per_step / context blocks."""
    steps = []

    def train(model, batches, steps_to_run, warmup, lr, device):
        steps.append((steps_to_run, warmup, next(batches).shape))
        return [50.0, 40.0, 1.0, 4.0, 2.0], [5.0] * 5  # two slow warm-up steps, then three timed ones

    monkeypatch.setattr(long_context, "train", train)
    args = long_context.parse_args(["--device", "cpu", "--size", "debug", "--contexts", "2048",
                                    "--tokens_per_step", "4096", "--speed_warmup", "2", "--speed_steps", "3"])
    speed = long_context.measure_speed("gla", 2048, args, activation_checkpointing=False)
    assert steps == [(5, 2, (2, 2049))]
    assert (speed["micro_batch"], speed["tokens_per_s"], speed["first_step_s"]) == (2, 4096 / 2, 50.0)


def test_a_part_out_of_memory_is_measured_again_with_activation_checkpointing(monkeypatch):
    calls = []

    def run_isolated(family, context, argv, args, parts, activation_checkpointing):
        calls.append((list(parts), activation_checkpointing))
        if not activation_checkpointing:
            return {"family": family, "context": context, **{part: {"out_of_memory": True} for part in parts}}
        measured = {"measured": parts[0], "activation_checkpointing": True}
        return {"family": family, "context": context, parts[0]: measured}

    monkeypatch.setattr(long_context, "run_isolated", run_isolated)
    row = long_context.measure_cell("gla", 32768, [], None)
    assert calls == [(["speed", "quality"], False), (["speed"], True), (["quality"], True)]
    assert row["speed"] == {"measured": "speed", "activation_checkpointing": True}
    assert row["quality"] == {"measured": "quality", "activation_checkpointing": True}


def test_a_call_interrupted_says_which_cells_out_lacks(corpus, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second cell: --out keeps the first, and the call names the cells it did not measure (no
    traceback), so that the file's table is not taken for the whole call's."""
    def measure_cell(family, context, argv, args):
        if context == 8192:
            raise KeyboardInterrupt
        return {"family": family, "context": context, "quality": {"val_perplexity": 9.0, "train_tokens": 2048}}

    monkeypatch.setattr(long_context, "measure_cell", measure_cell)
    out = tmp_path / "long_context.json"
    with pytest.raises(SystemExit) as stopped:
        long_context.main(["--device", "cpu", "--families", "gla", "--contexts", "2048", "8192", "16384",
                           "--out", str(out)])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == (f"long_context.py: interrupted during gla at 8192: {out} holds the 1 "
                                               "finished before it; not measured: gla at 8192, gla at 16384")
    assert [(r["family"], r["context"]) for r in json.loads(out.read_text())["rows"]] == [("gla", 2048)]

def test_rows_merge_by_cell_and_the_table_shows_each_measure_and_note():
    gla_2k = {"family": "gla", "context": 2048,
              "speed": {"micro_batch": 16, "tokens_per_s": 123456, "peak_memory_gib": 20.5,
                        "activation_checkpointing": False},
              "quality": {"micro_batch": 16, "activation_checkpointing": False, "val_perplexity": 30.0,
                          "by_position": {"start": [0], "end": [2048], "loss": [3.5], "tokens": [100]}}}
    transformer_32k = {"family": "transformer", "context": 32768,
                       "speed": {"out_of_memory": True, "activation_checkpointing": True,
                                 "error": "CUDA out of memory"},
                       "quality": {"micro_batch": 1, "activation_checkpointing": True, "val_perplexity": 20.0,
                                   "by_position": {"start": [0, 2048, 8192, 16384], "end": [2048, 8192, 16384, 32768],
                                                   "loss": [3.1, 3.0, 2.9, 2.8], "tokens": [1, 2, 3, 4]}}}
    rows = long_context.merged([], gla_2k)
    rows = long_context.merged(rows, dict(gla_2k, context=8192))
    rows = long_context.merged(rows, transformer_32k)
    again = dict(gla_2k, seconds=2.0)
    rows = long_context.merged(rows, again)  # the same cell again: replaced, the others kept
    assert [(r["family"], r["context"]) for r in rows] == [("transformer", 32768), ("gla", 2048), ("gla", 8192)]
    assert rows[1] is again
    assert long_context.markdown_table(rows[:2], eval_window=32768).splitlines() == [
        "| family | context | micro batch | tokens/s | peak memory (GiB) | val perplexity | loss 0-2K | loss 2K-8K "
        "| loss 8K-16K | loss 16K-32K | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        "| transformer | 32,768 | 1 | - | - | 20.00 | 3.100 | 3.000 | 2.900 | 2.800 | speed: out of memory with "
        "activation checkpointing; quality: activation checkpointing |",
        "| gla | 2,048 | 16 | 123,456 | 20.5 | 30.00 | 3.500 | - | - | - |  |",
    ]
    # a context shorter than the first bucket (the CPU try's): its loss over all its positions, in that column
    gla_1k = dict(gla_2k, context=1024, quality=dict(gla_2k["quality"], by_position={
        "start": [0], "end": [1024], "loss": [3.25], "tokens": [100]}))
    assert long_context.markdown_table([gla_1k], eval_window=2048).splitlines()[2] == (
        "| gla | 1,024 | 16 | 123,456 | 20.5 | 30.00 | 3.250 |  |")


def test_the_table_s_dashes_notes_and_last_column_of_a_short_window():
    """A CPU row (no peak memory: None), a cell whose process failed (the row's error), a part's error of several
    lines (its last line, where a traceback says what went wrong), and the last column ending at --eval_window."""
    cpu = {"family": "gla", "context": 1024,
           "speed": {"micro_batch": 2, "tokens_per_s": 900, "peak_memory_gib": None, "activation_checkpointing": False},
           "quality": {"error": "Traceback (most recent call last):\n  File ...\nValueError: no held-out window"}}
    failed = {"family": "gdn", "context": 2048, "error": "Traceback ...\nRuntimeError: the cell's process died"}
    assert long_context.markdown_table([cpu, failed], eval_window=4096).splitlines() == [
        "| family | context | micro batch | tokens/s | peak memory (GiB) | val perplexity | loss 0-2K | loss 2K-4K "
        "| note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        "| gla | 1,024 | 2 | 900 | - | - | - | - | quality: ValueError: no held-out window |",
        "| gdn | 2,048 | - | - | - | - | - | - | RuntimeError: the cell's process died |",
    ]


def test_calls_fill_one_out_file_of_one_plan(tmp_path, monkeypatch, capsys):
    """Rows of earlier calls kept and merged with this call's by cell; a file of another plan (another setting, or
    another corpus) refused before any cell; Ctrl-C without --out says nothing is written. The plan and the cells
    are stand-ins: what is checked is how main keeps the rows."""
    plan = {"corpus": {"fingerprint": "corpus-a", "source": {"package": "torch", "version": "0"},
                       "train": {"tokens": 1}}, "held_out_tokens": 1, "cells": []}
    measured = []

    def measure_cell(family, context, argv, args):
        if family == "deltanet":
            raise KeyboardInterrupt
        measured.append((family, context))
        return {"family": family, "context": context, "seconds": float(len(measured))}

    monkeypatch.setattr(long_context, "check_plan", lambda args: plan)
    monkeypatch.setattr(long_context, "measure_cell", measure_cell)
    out = tmp_path / "long_context.json"

    def call(*argv):
        return long_context.main(["--device", "cpu", "--out", str(out), *argv])

    call("--families", "gla", "--contexts", "2048", "8192")
    call("--families", "transformer", "gla", "--contexts", "8192")
    rows = json.loads(out.read_text())["rows"]
    assert [(r["family"], r["context"], r["seconds"]) for r in rows] == [
        ("transformer", 8192, 3.0), ("gla", 2048, 1.0), ("gla", 8192, 4.0)]
    with pytest.raises(SystemExit, match=r"holds the rows of another plan \(eval_window 32768 there, 16384 here\)"):
        call("--families", "gla", "--contexts", "2048", "--eval_window", "16384")
    plan["corpus"]["fingerprint"] = "corpus-b"
    with pytest.raises(SystemExit, match="another plan \\(corpus_fingerprint 'corpus-a' there, 'corpus-b' here\\)"):
        call("--families", "gla", "--contexts", "2048")
    assert len(measured) == 4 and json.loads(out.read_text())["rows"] == rows

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        long_context.main(["--device", "cpu", "--families", "deltanet", "--contexts", "2048"])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == ("long_context.py: interrupted during deltanet at 2048: nothing is "
                                               "written (no --out); not measured: deltanet at 2048")


def test_readme_table_quotes_every_cell_of_its_record():
    """The README's long-context table holds every family at every context of the benchmark's plan, each figure as
    the H100 record has it (the table the script writes from that record, less its micro batch and note columns)."""
    record = json.loads((ROOT / "benchmarks" / "results" / "2026-12-06-long-context-h100.json").read_text())
    names = {"transformer": "Transformer", "gla": "GLA", "gdn": "Gated DeltaNet", "deltanet": "DeltaNet"}
    expected = []
    for line in long_context.markdown_table(record["rows"], record["settings"]["eval_window"]).splitlines()[2:]:
        family, context, _micro_batch, *figures, _note = [cell.strip() for cell in line.strip("|").split("|")]
        expected.append(" | ".join([names[family], f"{int(context.replace(',', '')) // 1024}K", *figures]))
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quoted = [line.strip("| ") for line in readme.splitlines()
              if line.startswith("| ") and line.split("|")[1].strip() in names.values()]
    assert quoted == expected
    assert {(row["family"], row["context"]) for row in record["rows"]} == {
        (family, context) for family in long_context.FAMILIES for context in long_context.CONTEXTS}
    assert not any("error" in row or "error" in row.get("speed", {}) or "error" in row.get("quality", {})
                   for row in record["rows"])


# ---- the corpus's build on a package of a few files, its lengths made small: the cached corpus above is built once
# per installed torch, so what its tests check of the build holds of whichever build made the cache


def write_package(root: Path, files: dict) -> None:
    """Each file of `files` (its path under `root`: its number of paragraphs of the standard library's sources)."""
    from helpers import paragraphs

    for i, (name, count) in enumerate(files.items()):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("\n\n".join(paragraphs(count, 60 + i)), encoding="utf-8")


def test_the_build_holds_out_every_few_documents_cut_to_their_first_windows(paragraphs_tokenizer, tmp_path, monkeypatch):
    """Windows of 50 tokens, documents of 200 or more, every third held out and cut to its first two windows: the
    splits' chunk files are the documents, each its files' tokens (after the line naming each) and EOS."""
    import shutil

    from fabric_lin.data import Tokenizer, long_documents
    from fabric_lin.data.prepared import chunk_tokens

    for name, value in (("WINDOW", 50), ("MIN_DOCUMENT_TOKENS", 200), ("VAL_EVERY", 3), ("VAL_WINDOWS_PER_DOCUMENT", 2),
                        ("MIN_VAL_WINDOWS", 4), ("ENCODE_GROUP_CHARS", 3000)):
        monkeypatch.setattr(long_documents, name, value)
    root = tmp_path / "pkg"
    # six directories of a document each; pkg/t's file and pkg's own too short, and the two together still
    write_package(root, {**{f"d{i}/m.py": 4 for i in range(6)}, "d0/n.py": 3})
    (root / "t").mkdir()
    (root / "t" / "x.py").write_text("x = 1\n")
    (root / "u.py").write_text("y = 2\n")
    shutil.copytree(paragraphs_tokenizer, tmp_path / "sample" / "tokenizer")
    files = python_files(root)
    out = tmp_path / "built"
    out.mkdir()
    long_documents.build_long_documents(out, root, files, tmp_path / "sample", "fingerprint")

    tokenizer = Tokenizer(out / "tokenizer")

    def tokens_of(*names):
        texts = [f"# pkg/{name}\n\n" + (root / name).read_text() for name in names]
        return np.concatenate([tokenizer.encode(text).numpy() for text in texts] + [np.array([tokenizer.eos_id])])

    expected = [tokens_of("d0/m.py", "d0/n.py")] + [tokens_of(f"d{i}/m.py") for i in range(1, 6)]
    assert all(len(tokens) >= 200 for tokens in expected)
    info = json.loads((out / "corpus.json").read_text())
    assert [(d["name"], d["split"], d["tokens"], d["files"]) for d in info["documents"]] == [
        (f"pkg/d{i}", "val" if i in (2, 5) else "train", 100 if i in (2, 5) else len(expected[i]),
         [f"pkg/d{i}/m.py"] + (["pkg/d0/n.py"] if i == 0 else [])) for i in range(6)]
    assert info["left_out_files"] == 2 and info["source"]["files"] == 9
    assert chunk_tokens(out / "train").tolist() == [len(expected[i]) for i in (0, 1, 3, 4)]
    assert chunk_tokens(out / "val").tolist() == [100, 100]
    for split, documents in (("train", [expected[i] for i in (0, 1, 3, 4)]), ("val", [expected[2][:100], expected[5][:100]])):
        read = StreamingDataset(str(out / split), item_loader=TokensLoader(block_size=1), shuffle=False)
        np.testing.assert_array_equal(np.concatenate([np.asarray(read[i]) for i in range(len(read))]),
                                      np.concatenate(documents))

    monkeypatch.setattr(long_documents, "MIN_VAL_WINDOWS", 5)
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(ValueError, match=rf"^the Python sources of torch \S+ in {root} make 6 documents of 200\+ tokens, "
                                         r"whose held-out ones give 4 windows of 50 tokens, fewer than the 5 a long-context "
                                         r"evaluation needs$"):
        long_documents.build_long_documents(again, root, files, tmp_path / "sample", "fingerprint")


def test_the_root_s_own_files_and_what_came_up_to_it_are_a_document_when_long_enough():
    root = Path("/site/torch")
    tokens = {"a/x.py": MIN_DOCUMENT_TOKENS, "b/y.py": 10, "u.py": MIN_DOCUMENT_TOKENS - 10}
    files = sorted((root / name for name in tokens), key=lambda p: p.relative_to(root).as_posix())
    documents = group_documents(root, files, [tokens[p.relative_to(root).as_posix()] for p in files])
    assert [(name, [files[i].name for i in members]) for name, members in documents] == [
        ("torch", ["y.py", "u.py"]), ("torch/a", ["x.py"])]


def test_each_context_s_blocks_stay_within_a_document():
    from fabric_lin.data.long_documents import split_summary

    lengths = [3 * 2049 + 5, 2049, 2048, 8193 + 10]
    summary = split_summary([np.zeros(n, dtype=np.uint16) for n in lengths])
    assert summary == {"documents": 4, "tokens": sum(lengths),
                       "blocks": {"2048": 3 + 1 + 0 + 4, "8192": 1, "16384": 0, "32768": 0}}


def test_the_corpus_is_named_by_every_source_file_s_path_and_bytes(tmp_path):
    from fabric_lin.data.long_documents import long_documents_fingerprint

    def fingerprint(name, files):
        for path, text in files.items():
            (tmp_path / name / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name / path).write_text(text)
        return long_documents_fingerprint(tmp_path / name / "torch")

    one = fingerprint("one", {"torch/a.py": "x = 1\n", "torch/nn/b.py": "y = 2\n"})
    assert fingerprint("same", {"torch/a.py": "x = 1\n", "torch/nn/b.py": "y = 2\n"}) == one  # wherever it lies
    assert fingerprint("edited", {"torch/a.py": "x = 3\n", "torch/nn/b.py": "y = 2\n"}) != one
    assert fingerprint("moved", {"torch/a.py": "x = 1\n", "torch/b.py": "y = 2\n"}) != one
    assert fingerprint("added", {"torch/a.py": "x = 1\n", "torch/nn/b.py": "y = 2\n", "torch/c.py": ""}) != one


def test_the_source_files_are_in_the_order_of_their_paths_as_written(tmp_path):
    """'a.b/c.py' before 'a/b.py' ('.' before '/'), whatever order the file system lists them in: the order of a
    document's files and of the corpus's name."""
    for name in ("a_z.py", "a/b.py", "a.b/c.py", "a/a.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    assert [p.relative_to(tmp_path).as_posix() for p in python_files(tmp_path)] == ["a.b/c.py", "a/b.py", "a_z.py"]
