"""Starcoder -> litdata token chunks.

Reads every `*.parquet` under `input_dir` (recursively) in batches of 8192 rows of the `content`
column. Files are tokenized with bos=False, eos=True, a whole batch at once (SentencePiece's
multi-threaded list encoding).

    python data_prep/prepare_starcoder.py --input_dir data/starcoderdata-raw \
        --output_dir data/starcoder --tokenizer_path checkpoints/meta-llama/Llama-2-7b-hf
"""
import sys
from pathlib import Path
from typing import Optional, Union

if __name__ == "__main__":  # run as a script: import this checkout's packages
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_lin.data.recipe import require_flags, run_recipe
from fabric_lin.data.slimpajama_starcoder import StarcoderRecipe


def prepare(
    input_dir: Optional[Path] = None,
    output_dir: Optional[Path] = None,
    tokenizer_path: Optional[Path] = None,
    chunk_size: int = 2049 * 8192,
    num_workers: Optional[int] = None,
    fast_dev_run: Union[bool, int] = False,
) -> dict:
    """Tokenize Starcoder `*.parquet` files (column `content`) into litdata chunks for `TokensLoader`.

    Args:
        input_dir: Directory searched recursively for `*.parquet` files (e.g. starcoderdata).
        output_dir: Directory to create; written under a temporary name and renamed when complete.
        tokenizer_path: Directory holding the tokenizer.model (and optional tokenizer_config.json).
        chunk_size: Tokens per chunk file.
        num_workers: Worker processes (default: one per CPU core).
        fast_dev_run: Process only the first files (True: 10, or this many) to try the pipeline.
    """
    require_flags(input_dir=input_dir, output_dir=output_dir, tokenizer_path=tokenizer_path)
    recipe = StarcoderRecipe(tokenizer_path=tokenizer_path, chunk_size=chunk_size)
    return run_recipe(recipe, input_dir, output_dir, num_workers, fast_dev_run)


if __name__ == "__main__":
    from jsonargparse import CLI

    CLI(prepare, as_positional=False)
