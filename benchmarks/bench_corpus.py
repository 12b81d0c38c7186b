"""The corpus the real-loop benchmarks train on: random tokens in the prepared SlimPajama + Starcoder
layout (`--data SlimPajamaStarcoder --data.data_path <dir>`), stored in chunk files that each hold 64
micro-batches, as the recipes' corpora hold hundreds (`data_prep/`: 2049 x 16,384 and 2049 x 8,192
tokens per chunk).

Not the sample corpus: it keeps one micro-batch of 16 x 2049 tokens per chunk file (so that loader
processes and ranks of small test runs each get several), so a 16 x 2048 step opens a new chunk file
every time, and litdata's reader then at times waits 50-200 ms for it - a stall that a real corpus shows
once in hundreds of steps. The tokens are drawn below the sample corpus's vocabulary, whose tokenizer
the prepared directories name; what they say does not change a step's speed."""
from pathlib import Path

import numpy as np

BATCHES_PER_CHUNK = 64


def write_tokens(path: Path, tokens: np.ndarray, block_size: int, chunk_blocks: int, tokenizer) -> None:
    from litdata.streaming.cache import Cache
    from litdata.streaming.item_loader import TokensLoader

    from fabric_lin.data.prepared import write_prepared_info

    cache = Cache(str(path), chunk_size=block_size * chunk_blocks, item_loader=TokensLoader())
    for i, start in enumerate(range(0, len(tokens), block_size)):
        cache[i] = tokens[start : start + block_size]
    cache.done()
    cache.merge()
    write_prepared_info(path, tokenizer, recipe="benchmark corpus (random tokens)", chunk_size=block_size * chunk_blocks)


def benchmark_corpus(root: Path, batch_size: int, seq_len: int, batches: int, loaders: int, seed: int = 0) -> Path:
    """Write the corpus under `root` and return it: per dataset, chunks of BATCHES_PER_CHUNK micro-batches
    of `seq_len` + 1 token samples, at least one chunk for each of `loaders` readers (ranks x loader
    processes) and at least `batches` micro-batches (a step may draw them all from one dataset)."""
    from fabric_lin.data import SampleCorpus
    from fabric_lin.data.tokenizer import Tokenizer

    sample = SampleCorpus()
    sample.prepare_data()  # its tokenizer, for the prepared directories' records
    tokenizer = Tokenizer(sample.tokenizer_dir)
    block_size = seq_len + 1
    chunk_blocks = BATCHES_PER_CHUNK * batch_size
    chunks = max(loaders, -(-batches // BATCHES_PER_CHUNK)) + 1
    rng = np.random.default_rng(seed)
    for name, blocks in [("slimpajama/train", chunks * chunk_blocks), ("slimpajama/val", batch_size),
                         ("starcoder", chunks * chunk_blocks)]:
        tokens = rng.integers(0, tokenizer.vocab_size, blocks * block_size, dtype=np.int64).astype(np.uint16)
        write_tokens(Path(root) / name, tokens, block_size, chunk_blocks, tokenizer)
    return Path(root)


def pretrain_data_args(corpus: Path, num_workers: int) -> list:
    """`fabric-lin pretrain` arguments that train on `corpus` with `num_workers` loader processes per rank
    (no validation split, no tokenizer: the tokens are random)."""
    return ["--data", "SlimPajamaStarcoder", "--data.data_path", str(corpus), "--data.validation", "false",
            "--data.num_workers", str(num_workers), "--tokenizer_dir", "null"]
