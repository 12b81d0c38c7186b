"""Training data loader throughput: fabric-lin's sample stream against litdata's own mixing loader.

Both read the same two prepared directories (random tokens, chunk files of 256 samples) mixed 0.69 : 0.31,
in micro batches of `--batch_size` samples of `--seq_len + 1` tokens, with the same number of DataLoader
workers: fabric-lin's `TrainLoader` (a position-addressed stream, resumable on any layout) and litdata's
`StreamingDataLoader` over a `CombinedStreamingDataset` (what the mix was read with before; its position
only resumes on the layout that wrote it). Timed after the first batch (worker start excluded), CPU only.

    python benchmarks/train_loader.py --num_workers 0 2 --out train_loader.json

Prints one JSON document.
"""
import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import out_arg, write_result  # noqa: E402

WEIGHTS = (0.693584, 0.306416)


def write_dir(path: Path, samples: int, block: int, seed: int) -> None:
    from litdata.streaming.cache import Cache
    from litdata.streaming.item_loader import TokensLoader

    tokens = np.random.default_rng(seed).integers(0, 32000, samples * block, dtype=np.uint16)
    cache = Cache(str(path), chunk_size=256 * block, item_loader=TokensLoader())
    for i, start in enumerate(range(0, len(tokens), 64 * block)):
        cache[i] = tokens[start : start + 64 * block]
    cache.done()
    cache.merge()
    (path / "prepared.json").write_text(json.dumps({"complete": True}))


def samples_per_s(loader, batches: int) -> float:
    iterator = iter(loader)
    next(iterator)  # workers started, first chunks mapped
    start = time.perf_counter()
    taken = sum(len(next(iterator)) for _ in range(batches))
    return taken / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--num_workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--out", type=out_arg, default=None)
    args = parser.parse_args()
    for name in ("seq_len", "batch_size", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.num_workers) < 0:
        parser.error(f"--num_workers must be 0 (no worker processes) or more, got {args.num_workers}")

    from litdata.streaming import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset, TokensLoader

    from fabric_lin.data.base import collate_tokens, token_train_loader

    block = args.seq_len + 1
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / "a", Path(tmp) / "b"]
        write_dir(paths[0], 8192, block, seed=0)
        write_dir(paths[1], 4096, block, seed=1)
        for workers in args.num_workers:
            ours = token_train_loader(paths, block, args.batch_size, workers, seed=42, weights=WEIGHTS)
            mixed = CombinedStreamingDataset(
                [StreamingDataset(str(p), item_loader=TokensLoader(block_size=block), shuffle=True, seed=42) for p in paths],
                seed=42, weights=WEIGHTS, iterate_over_all=False,
            )
            peer = StreamingDataLoader(mixed, batch_size=args.batch_size, num_workers=workers, collate_fn=collate_tokens)
            ours_rate, peer_rate = samples_per_s(ours, args.batches), samples_per_s(peer, args.batches)
            results.append({
                "num_workers": workers,
                "fabric_lin_samples_per_s": round(ours_rate, 1),
                "litdata_samples_per_s": round(peer_rate, 1),
                "fabric_lin_over_litdata": round(ours_rate / peer_rate, 3),
                "fabric_lin_tokens_per_s": round(ours_rate * args.seq_len),
            })
    write_result({"benchmark": "train_loader", "seq_len": args.seq_len, "batch_size": args.batch_size,
                  "batches": args.batches, "results": results}, args.out)


if __name__ == "__main__":
    main()
