"""benchmarks/bench_corpus.py: the real-loop benchmark's corpus reads back through the training data module."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_corpus import BATCHES_PER_CHUNK, benchmark_corpus  # noqa: E402


def test_corpus_has_large_chunks_and_trains_batches(tmp_path):
    batch_size, seq_len = 2, 31
    root = benchmark_corpus(tmp_path / "corpus", batch_size, seq_len, batches=200, loaders=3)
    for name in ("slimpajama/train", "starcoder"):
        index = json.loads((root / name / "index.json").read_text())
        dims = [chunk["dim"] for chunk in index["chunks"]]
        # 200 batches need 4 chunks of 64; one more than the readers or that need
        assert len(dims) == 5 and set(dims) == {BATCHES_PER_CHUNK * batch_size * (seq_len + 1)}

    from fabric_lin.data import SlimPajamaStarcoder

    data = SlimPajamaStarcoder(data_path=root, num_workers=0, validation=False)
    data.connect(batch_size=batch_size, max_seq_length=seq_len)
    data.setup()
    batches = [batch for _, batch in zip(range(3), data.train_dataloader())]
    assert len(batches) == 3
    for batch in batches:
        assert batch.shape == (batch_size, seq_len + 1) and batch.dtype == torch.int64
        assert 0 <= int(batch.min()) and int(batch.max()) < 4096  # the sample corpus's vocabulary
