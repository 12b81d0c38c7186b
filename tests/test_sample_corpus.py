"""fabric_lin/data/sample_corpus.py: the embedded corpus (the Python standard library's modules through the
preprocessors, and its tokenizer) built once in its cache though two processes ask for it at the same time, the
same byte for byte on every build, read by SampleCorpus; a Ctrl-C during the build keeps nothing. The processes are
`python -c` forked from an interpreter that has imported torch (fabric_lin_process), each in a session of its own."""
import json
import sys
import time
from pathlib import Path

import pytest
import torch

import fabric_lin_process
from fabric_lin.data.recipe import REPORTS_DIR
from fabric_lin.config import Config
from fabric_lin.data import SampleCorpus, Tokenizer
from fabric_lin.data.train_tokenizer import sample_sentences, write_tokenizer
from fabric_lin.errors import InvalidValue
from helpers import wait_for

pytestmark = pytest.mark.slow  # subprocesses that build the corpus (about 4 s on 2 cores), or begin to


def test_sample_corpus_builds_once_under_concurrency(tmp_path):
    cache_dir = tmp_path / "sample_corpus"
    code = "import sys; from fabric_lin.data.sample_corpus import ensure_sample_corpus; print('PATH', ensure_sample_corpus(sys.argv[1]))"
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    start = time.perf_counter()
    processes = [fabric_lin_process.start([sys.executable, "-c", code, str(cache_dir)], log, scripts=True)
                 for log in logs]
    codes = fabric_lin_process.wait_all(processes, 300)
    seconds = time.perf_counter() - start
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], outputs
    paths = {line.split(" ", 1)[1] for out in outputs for line in out.splitlines() if line.startswith("PATH ")}
    assert len(paths) == 1
    assert sum(out.count("Built the sample corpus") for out in outputs) == 1
    assert seconds < 120, seconds
    root = Path(paths.pop())
    assert not list(cache_dir.glob(".tmp-*"))
    # the console names the corpus's real place (the temporary one it is built in is gone); the
    # preprocessors' reports, which name that one, are in its log
    (builder,) = [out for out in outputs if "Built the sample corpus" in out]
    assert f"Built the sample corpus in {root} in " in builder and f"(log: {root / 'build.log'})" in builder
    assert ".tmp-" not in builder and "Prepared" in (root / "build.log").read_text()

    data = SampleCorpus(cache_dir=cache_dir, num_workers=0)
    assert data.data_path == root and data.tokenizer_dir == root / "tokenizer"
    start = time.perf_counter()
    data.prepare_data()  # cached: no rebuild
    assert time.perf_counter() - start < 5
    tokenizer = Tokenizer(data.tokenizer_dir)
    assert tokenizer.vocab_size == Config.from_name("gla-debug").vocab_size == 4096
    data.connect(tokenizer, batch_size=4, max_seq_length=64)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (4, 65) and batch.dtype == torch.int64 and int(batch.max()) < 4096
    val = next(iter(data.val_dataloader()))
    assert val.shape == (4, 65)

    info = json.loads((root / "slimpajama" / "train" / "prepared.json").read_text())
    assert info["summary"]["skipped_rows"] > 0 and not info["summary"]["bad_files"]
    starcoder = json.loads((root / "starcoder" / "prepared.json").read_text())["summary"]
    corpus = json.loads((root / "corpus.json").read_text())
    assert starcoder["documents"] == corpus["train_modules"] and corpus["val_modules"] > 0

    # deterministic: the raw corpus and the tokenizer come out byte for byte the same again
    from fabric_lin.data.sample_corpus import VOCAB_SIZE, stdlib_modules, write_raw_corpus

    _, documents = write_raw_corpus(tmp_path / "again", stdlib_modules())
    for path in (root / "raw").rglob("*.*"):
        assert (tmp_path / "again" / path.relative_to(root / "raw")).read_bytes() == path.read_bytes(), path
    write_tokenizer(sample_sentences(documents)[0], tmp_path / "again-tok", VOCAB_SIZE, num_threads=1)
    assert (tmp_path / "again-tok" / "tokenizer.model").read_bytes() == (root / "tokenizer" / "tokenizer.model").read_bytes()

    # data of another tokenizer is refused naming the corpus's tokenizer where it is, not the build's temporary folder
    # (any other tokenizer: one of 400 pieces from the first 2000 of the corpus's ~120,000 sentences)
    write_tokenizer(sample_sentences(documents)[0][:2000], tmp_path / "other-tok", 400, num_threads=1)
    data.connect(Tokenizer(tmp_path / "other-tok"), batch_size=4, max_seq_length=64)
    with pytest.raises(InvalidValue, match="was tokenized with a different tokenizer") as refused:
        data.setup()
    assert f", from {root / 'tokenizer'})" in str(refused.value) and ".tmp-" not in str(refused.value), refused.value


def test_ctrl_c_while_the_sample_corpus_builds_says_interrupted_and_keeps_nothing(tmp_path):
    import os
    import signal

    cache_dir = tmp_path / "sample_corpus"
    code = "import sys; from fabric_lin.data.sample_corpus import ensure_sample_corpus; ensure_sample_corpus(sys.argv[1])"
    log = tmp_path / "build.log"
    proc = fabric_lin_process.start([sys.executable, "-c", code, str(cache_dir)], log, scripts=True)
    assert wait_for(lambda: "\n" in log.read_text(), proc, timeout=120), log.read_text()
    first = log.read_text()
    assert first.startswith("Building the sample corpus (first use)"), first
    # inside the build, in a preprocessor: its worker has reported the first of the training files
    assert wait_for(lambda: list(cache_dir.glob(f".tmp-*/slimpajama/.tmp-train-*/{REPORTS_DIR}/*.jsonl")), proc, timeout=120)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole process group, the preprocessor's workers too
    [returncode] = fabric_lin_process.wait_all([proc], 120)
    out = log.read_text()
    assert returncode != 0
    assert "The sample corpus build was interrupted: nothing was kept; the next run builds it again" in out
    assert "failed" not in out
    assert not [p for p in cache_dir.iterdir() if p.is_dir()]  # no corpus, complete or not
