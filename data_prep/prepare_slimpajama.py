"""SlimPajama -> litdata token chunks.

Reads every `*.jsonl.zst` under `input_dir` (recursively): JSON lines with `text` and
`meta.redpajama_set_name`. Rows of RedPajamaGithub are skipped (Starcoder covers code). Documents are
tokenized with bos=False, eos=True, many at once (SentencePiece's multi-threaded list encoding).

    python data_prep/prepare_slimpajama.py --input_dir data/slimpajama-raw/train \
        --output_dir data/slimpajama/train --tokenizer_path checkpoints/meta-llama/Llama-2-7b-hf
"""
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Union

if __name__ == "__main__":  # run as a script: make `data_prep` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data_prep.base import TokenizeRecipe, require_flags, run_recipe
from fabric_lin.data.raw_files import find_files, read_slimpajama_file

SKIPPED_SET = "RedPajamaGithub"
# Documents handed to the tokenizer at once; a SlimPajama file holds a few thousand documents.
DOCUMENTS_PER_BATCH = 8192


class SlimPajamaRecipe(TokenizeRecipe):
    def find_inputs(self, input_dir: str) -> List[str]:
        return [str(p) for p in find_files(input_dir, ".jsonl.zst")]

    def read_documents(self, path: str) -> Iterator[List[str]]:
        # The whole file is read and validated first (read_slimpajama_file), so a bad file adds nothing.
        rows = read_slimpajama_file(path)
        texts = [text for text, set_name in rows if set_name != SKIPPED_SET]
        self._skipped_rows += len(rows) - len(texts)
        for start in range(0, len(texts), DOCUMENTS_PER_BATCH):
            yield texts[start : start + DOCUMENTS_PER_BATCH]


def prepare(
    input_dir: Optional[Path] = None,
    output_dir: Optional[Path] = None,
    tokenizer_path: Optional[Path] = None,
    chunk_size: int = 2049 * 16384,
    num_workers: Optional[int] = None,
    fast_dev_run: Union[bool, int] = False,
) -> dict:
    """Tokenize SlimPajama `*.jsonl.zst` files into litdata chunks for `TokensLoader`.

    Args:
        input_dir: Directory searched recursively for `*.jsonl.zst` files (e.g. SlimPajama-627B/train).
        output_dir: Directory to create; written under a temporary name and renamed when complete.
        tokenizer_path: Directory holding the tokenizer.model (and optional tokenizer_config.json).
        chunk_size: Tokens per chunk file.
        num_workers: Worker processes (default: one per CPU core).
        fast_dev_run: Process only the first files (True: 10, or this many) to try the pipeline.
    """
    require_flags(input_dir=input_dir, output_dir=output_dir, tokenizer_path=tokenizer_path)
    recipe = SlimPajamaRecipe(tokenizer_path=tokenizer_path, chunk_size=chunk_size)
    return run_recipe(recipe, input_dir, output_dir, num_workers, fast_dev_run, recipe_name="slimpajama")


if __name__ == "__main__":
    from jsonargparse import CLI

    # call the imported module's function so the recipe pickles as data_prep.prepare_slimpajama.*, not __main__.*
    from data_prep.prepare_slimpajama import prepare as prepare_from_module

    CLI(prepare_from_module, as_positional=False)
