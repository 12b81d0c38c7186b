"""Preprocessing throughput: fabric-lin's SlimPajama recipe against a one-document-at-a-time recipe, and
`prepare_text` against the SlimPajama recipe on the same documents.

All run through litdata's DataProcessor with the same number of workers, write TokensLoader chunks,
and are timed end to end (worker start included). The baseline does what LitGPT's SlimPajama recipe
does: read the file line by line, `tokenizer.encode(text, eos=True)` per document, yield one tensor
per document. fabric-lin's recipe encodes thousands of documents per SentencePiece call (spread over
threads) and yields one token array per group. `prepare_text` reads the documents the SlimPajama
recipe keeps, in the same order, written once as `{"text": ...}` JSON lines in `.jsonl.zst` files and
once as parquet files; it is timed as the command runs, with its default validation split (val/ is
written too), and must produce the same tokens in all. With `--repeats N` the four runs take turns N
times and each figure is the median of its N runs, so that other load on a shared machine falls on
every recipe alike.

    python benchmarks/prepare_throughput.py --num_workers 1 --megabytes 40 --repeats 3
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

from common import exit_on_user_error, out_path_problem, write_result  # noqa: E402
from data_prep.prepare_text import prepare as prepare_text  # noqa: E402
from fabric_lin.data.recipe import file_record, run_recipe  # noqa: E402
from fabric_lin.data.slimpajama_starcoder import SKIPPED_SET, SlimPajamaRecipe  # noqa: E402
from fabric_lin.errors import InvalidValue  # noqa: E402


class OneDocumentAtATimeRecipe(SlimPajamaRecipe):
    """The baseline: per-document encode and per-document yield (LitGPT's recipe shape)."""

    def prepare_item(self, path: str) -> Iterator:
        import zstandard

        record = file_record(path)
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


def write_text_copies(input_dir: Path, out_dir: Path) -> None:
    """The documents the SlimPajama recipe keeps from each file of `input_dir` (all but RedPajamaGithub's),
    in order, as prepare_text's inputs: out_dir/jsonl_zst/<name>.jsonl.zst and out_dir/parquet/<name>.parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from fabric_lin.data.raw_files import find_files, read_slimpajama_file

    for folder in ("jsonl_zst", "parquet"):
        (out_dir / folder).mkdir(parents=True)
    for path in find_files(input_dir, ".jsonl.zst"):
        texts = [text for text, set_name in read_slimpajama_file(path) if set_name != SKIPPED_SET]
        stem = path.relative_to(input_dir).as_posix().replace("/", "_")[: -len(".jsonl.zst")]
        data = "".join(json.dumps({"text": text}) + "\n" for text in texts).encode("utf-8")
        (out_dir / "jsonl_zst" / f"{stem}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
        pq.write_table(pa.table({"text": texts}), out_dir / "parquet" / f"{stem}.parquet")


def timed(run) -> dict:
    """Wall time and the worker processes' CPU time of `run()`, which returns (tokens, documents, output dirs)."""
    load_before = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    tokens, documents, out_dirs = run()
    seconds = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    result = {
        "seconds": round(seconds, 2),
        # CPU time of the worker processes: tells a busy machine (other load) from a slow recipe
        "worker_cpu_seconds": round(cpu_seconds, 2),
        "load_average_before": round(load_before, 2),
        "tokens": tokens,
        "documents": documents,
        "tokens_per_s": round(tokens / seconds),
        "tokens_per_worker_cpu_s": round(tokens / max(cpu_seconds, 1e-9)),
        "disk_bytes": sum(p.stat().st_size for d in out_dirs for p in d.glob("chunk-*.bin")),
    }
    for d in out_dirs:
        shutil.rmtree(d)
    return result


def median_run(runs: List[dict]) -> dict:
    """The median of each figure of several runs of one recipe, with every run's tokens/s beside it."""
    import statistics

    keys = ("seconds", "worker_cpu_seconds", "tokens_per_s", "tokens_per_worker_cpu_s")
    median = {**runs[0], **{key: round(statistics.median(r[key] for r in runs), 2) for key in keys}}
    if len(runs) > 1:
        median["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
        median["tokens_per_worker_cpu_s_runs"] = [r["tokens_per_worker_cpu_s"] for r in runs]
        median["load_average_before_runs"] = [r["load_average_before"] for r in runs]
    return median


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
    repeats: int = 1,
    out: Optional[Path] = None,
) -> dict:
    """Args:
    input_dir: SlimPajama-format `*.jsonl.zst` files; default: a corpus cut from the standard library.
    tokenizer_path: tokenizer directory; default: the sample corpus's 4096-piece tokenizer.
    num_workers: DataProcessor workers, the same for every recipe.
    megabytes: size of the generated corpus (when no input_dir is given).
    work_dir: where the outputs are written (deleted afterwards); default: a temporary directory.
    repeats: run the recipes in turn this many times; the figures are the medians.
    out: also write the JSON document here (with the command, date and machine).
    """
    if num_workers < 1 or repeats < 1:
        raise InvalidValue(f"--num_workers and --repeats must be at least 1, got {num_workers} and {repeats}")
    if megabytes <= 0:  # no corpus: the recipes would fail on a temporary folder the user never named
        raise InvalidValue(f"--megabytes must be a positive number (the generated corpus's size), got {megabytes}")
    out_problem = None if out is None else out_path_problem(str(out))
    if out_problem is not None:  # refused before the work, not when its result is written
        raise InvalidValue(f"--out {out_problem}")
    work = Path(tempfile.mkdtemp(prefix="prepare-throughput-", dir=work_dir))
    try:
        if tokenizer_path is None:
            from fabric_lin.data.sample_corpus import ensure_sample_corpus

            tokenizer_path = ensure_sample_corpus() / "tokenizer"
        if input_dir is None:
            input_dir = work / "input"
            write_benchmark_corpus(input_dir, megabytes)
        input_bytes = sum(p.stat().st_size for p in Path(input_dir).rglob("*.jsonl.zst"))
        write_text_copies(Path(input_dir), work / "text")

        def slimpajama(recipe_class):
            def run(out_dir: Path):
                recipe = recipe_class(tokenizer_path=tokenizer_path, chunk_size=2049 * 16384)
                summary = run_recipe(recipe, input_dir, out_dir, num_workers=num_workers)
                return summary["tokens"], summary["documents"], [out_dir]
            return run

        def text(folder: str):
            def run(out_dir: Path):
                splits = prepare_text(work / "text" / folder, out_dir, tokenizer_path, num_workers=num_workers)
                written = {split: summary for split, summary in splits.items() if summary is not None}
                return (sum(s["tokens"] for s in written.values()), sum(s["documents"] for s in written.values()),
                        [out_dir / split for split in written])
            return run

        recipes = {
            "one_document_at_a_time": slimpajama(OneDocumentAtATimeRecipe),
            "fabric_lin": slimpajama(SlimPajamaRecipe),
            "prepare_text_jsonl_zst": text("jsonl_zst"),
            "prepare_text_parquet": text("parquet"),
        }
        runs = {name: [] for name in recipes}
        for _ in range(repeats):
            for name, run in recipes.items():
                runs[name].append(timed(lambda: run(work / name)))
                shutil.rmtree(work / name, ignore_errors=True)
        results = {name: median_run(name_runs) for name, name_runs in runs.items()}
        baseline, ours = results["one_document_at_a_time"], results["fabric_lin"]
        for name in ("one_document_at_a_time", "prepare_text_jsonl_zst", "prepare_text_parquet"):
            if (results[name]["tokens"], results[name]["documents"]) != (ours["tokens"], ours["documents"]):
                raise RuntimeError(f"{name} and the SlimPajama recipe disagree on the output: {results[name]} vs {ours}")
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
            # prepare_text on the same documents against the SlimPajama recipe: wall clock and CPU time per token
            "prepare_text_vs_slimpajama": {
                name: {"tokens_per_s": round(results[f"prepare_text_{name}"]["tokens_per_s"] / ours["tokens_per_s"], 3),
                       "tokens_per_worker_cpu_s": round(results[f"prepare_text_{name}"]["tokens_per_worker_cpu_s"]
                                                        / ours["tokens_per_worker_cpu_s"], 3)}
                for name in ("jsonl_zst", "parquet")
            },
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

    exit_on_user_error(lambda: CLI(main, as_positional=False))
