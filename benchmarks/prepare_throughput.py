"""Preprocessing throughput: fabric-lin's SlimPajama recipe against a one-document-at-a-time recipe.

Both run through litdata's DataProcessor on the same `*.jsonl.zst` input with the same number of
workers, write TokensLoader chunks, and are timed end to end (worker start included). The baseline
does what LitGPT's SlimPajama recipe does: read the file line by line, `tokenizer.encode(text,
eos=True)` per document, yield one tensor per document. fabric-lin's recipe encodes thousands of
documents per SentencePiece call (spread over threads) and yields one token array per group.

    python benchmarks/prepare_throughput.py --num_workers 1 --megabytes 40
    python benchmarks/prepare_throughput.py --input_dir data/slimpajama-raw/validation \
        --tokenizer_path checkpoints/meta-llama/Llama-2-7b-hf --num_workers 8 --out prepare_throughput.json

Prints one JSON document.
"""
import io
import json
import os
import random
import resource
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Iterator, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import write_result  # noqa: E402
from data_prep.base import run_recipe  # noqa: E402
from data_prep.prepare_slimpajama import SKIPPED_SET, SlimPajamaRecipe  # noqa: E402


class OneDocumentAtATimeRecipe(SlimPajamaRecipe):
    """The baseline: per-document encode and per-document yield (LitGPT's recipe shape)."""

    def prepare_item(self, path: str) -> Iterator:
        import zstandard

        record = {"path": path, "status": "ok", "documents": 0, "skipped_rows": 0, "tokens": 0}
        with open(path, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as reader:
            for line in io.TextIOWrapper(reader, encoding="utf-8"):
                row = json.loads(line)
                if row["meta"]["redpajama_set_name"] == SKIPPED_SET:
                    record["skipped_rows"] += 1
                    continue
                ids = self.tokenizer.encode(row["text"], bos=False, eos=True)
                record["documents"] += 1
                record["tokens"] += len(ids)
                yield ids
        self._write_report(record)


def write_benchmark_corpus(out_dir: Path, megabytes: float, seed: int = 0) -> None:
    """SlimPajama-format files of documents cut from the standard library (500 to 8000 characters,
    about the size of SlimPajama's documents), one in eight labelled RedPajamaGithub."""
    import zstandard

    rng = random.Random(seed)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
    out_dir.mkdir(parents=True, exist_ok=True)
    target, written, shard = megabytes * 1e6, 0, 0
    while written < target:
        rows: List[str] = []
        for _ in range(2000):
            text = rng.choice(sources)
            start = rng.randrange(max(1, len(text) - 8000))
            doc = text[start : start + rng.randint(500, 8000)]
            set_name = "RedPajamaGithub" if rng.random() < 0.125 else "RedPajamaCommonCrawl"
            rows.append(json.dumps({"text": doc, "meta": {"redpajama_set_name": set_name}}))
            written += len(doc)
        data = ("\n".join(rows) + "\n").encode("utf-8")
        (out_dir / f"chunk_{shard}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
        shard += 1


def encode_only(tokenizer_path: Path, input_dir: Path, num_threads: int) -> dict:
    """The tokenizer calls alone, in this process: one call per document vs. one call per group."""
    from fabric_lin.data.raw_files import find_files, read_slimpajama_file
    from fabric_lin.data.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_path)
    texts = [t for p in find_files(input_dir, ".jsonl.zst")[:4] for t, s in read_slimpajama_file(p) if s != SKIPPED_SET]
    start = time.perf_counter()
    loop_tokens = sum(len(tokenizer.encode(t, eos=True)) for t in texts)
    loop_seconds = time.perf_counter() - start
    start = time.perf_counter()
    batch_tokens = sum(len(ids) for ids in tokenizer.encode_batch(texts, eos=True, num_threads=num_threads))
    batch_seconds = time.perf_counter() - start
    assert loop_tokens == batch_tokens
    return {
        "documents": len(texts),
        "tokens": loop_tokens,
        "one_at_a_time_tokens_per_s": round(loop_tokens / loop_seconds),
        "batched_tokens_per_s": round(batch_tokens / batch_seconds),
        "batched_threads": num_threads,
        "speedup": round(loop_seconds / batch_seconds, 2),
    }


def main(
    input_dir: Optional[Path] = None,
    tokenizer_path: Optional[Path] = None,
    num_workers: int = 1,
    megabytes: float = 40.0,
    work_dir: Optional[Path] = None,
    out: Optional[Path] = None,
) -> dict:
    """Args:
    input_dir: SlimPajama-format `*.jsonl.zst` files; default: a corpus cut from the standard library.
    tokenizer_path: tokenizer directory; default: the sample corpus's 4096-piece tokenizer.
    num_workers: DataProcessor workers, the same for both recipes.
    megabytes: size of the generated corpus (when no input_dir is given).
    work_dir: where the outputs are written (deleted afterwards); default: a temporary directory.
    out: also write the JSON document here (with the command, date and machine).
    """
    work = Path(tempfile.mkdtemp(prefix="prepare-throughput-", dir=work_dir))
    try:
        if tokenizer_path is None:
            from fabric_lin.data.sample_corpus import ensure_sample_corpus

            tokenizer_path = ensure_sample_corpus() / "tokenizer"
        if input_dir is None:
            input_dir = work / "input"
            write_benchmark_corpus(input_dir, megabytes)
        input_bytes = sum(p.stat().st_size for p in Path(input_dir).rglob("*.jsonl.zst"))
        results = {}
        for name, recipe_class in (("one_document_at_a_time", OneDocumentAtATimeRecipe), ("fabric_lin", SlimPajamaRecipe)):
            recipe = recipe_class(tokenizer_path=tokenizer_path, chunk_size=2049 * 16384)
            load_before = os.getloadavg()[0]
            cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            summary = run_recipe(recipe, input_dir, work / name, num_workers=num_workers)
            seconds = time.perf_counter() - start
            cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu_seconds = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
            results[name] = {
                "seconds": round(seconds, 2),
                # CPU time of the worker processes: tells a busy machine (other load) from a slow recipe
                "worker_cpu_seconds": round(cpu_seconds, 2),
                "load_average_before": round(load_before, 2),
                "tokens": summary["tokens"],
                "documents": summary["documents"],
                "tokens_per_s": round(summary["tokens"] / seconds),
                "tokens_per_worker_cpu_s": round(summary["tokens"] / max(cpu_seconds, 1e-9)),
                "disk_bytes": sum(p.stat().st_size for p in (work / name).glob("chunk-*.bin")),
            }
            shutil.rmtree(work / name)
        baseline, ours = results["one_document_at_a_time"], results["fabric_lin"]
        if baseline["tokens"] != ours["tokens"] or baseline["documents"] != ours["documents"]:
            raise RuntimeError(f"The two recipes disagree on the output: {baseline} vs {ours}")
        report = {
            "benchmark": "prepare_throughput",
            "cpu_count": os.cpu_count(),
            "num_workers": num_workers,
            "input_dir": str(input_dir),
            "input_compressed_bytes": input_bytes,
            "tokenizer": str(tokenizer_path),
            "documents": ours["documents"],
            "tokens": ours["tokens"],
            **results,
            "speedup": round(ours["tokens_per_s"] / baseline["tokens_per_s"], 2),
            # the wall-clock speedup needs idle cores for the encoding threads; this one does not
            "cpu_efficiency_ratio": round(ours["tokens_per_worker_cpu_s"] / baseline["tokens_per_worker_cpu_s"], 2),
            "encode_only": encode_only(tokenizer_path, Path(input_dir), max(1, (os.cpu_count() or 1) // num_workers)),
        }
        write_result(report, out, indent=2)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(main, as_positional=False)
