"""SentencePiece tokenizer of a checkpoint or tokenizer directory.

The directory holds `tokenizer.model` (SentencePiece, e.g. Llama-2's) and optionally
`tokenizer_config.json`, whose `bos_token` / `eos_token` override the model's own ids.
"""
import hashlib
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Union

import torch

from fabric_lin.errors import InvalidValue, MissingFile
from fabric_lin.files import read_json, reading

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json")


def tokenizer_model_hash(model_path: Union[str, Path]) -> str:
    """sha256 of a tokenizer.model file: identifies the tokenizer that produced a prepared dataset."""
    digest = hashlib.sha256()
    with open(model_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def copy_tokenizer_files(src_dir: Union[str, Path], dst_dir: Union[str, Path]) -> List[Path]:
    """Copy the tokenizer files present in `src_dir` into `dst_dir`, as new files of the usual mode;
    `tokenizer.model` is required."""
    from fabric_lin.files import copy_file

    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if not (src_dir / "tokenizer.model").is_file():
        raise MissingFile(f"{src_dir / 'tokenizer.model'} does not exist: expected a SentencePiece tokenizer.model")
    dst_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            copied.append(copy_file(src_dir / name, dst_dir / name))
    return copied


def _token_content(value) -> Optional[str]:
    # Hugging Face writes special tokens either as a string or as {"content": "<s>", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, checkpoint_dir: Union[str, Path]) -> None:
        from sentencepiece import SentencePieceProcessor

        checkpoint_dir = Path(checkpoint_dir)
        if checkpoint_dir.is_file():
            raise InvalidValue(f"{checkpoint_dir} is a file: expected the directory that holds tokenizer.model (and "
                               f"tokenizer_config.json), here {checkpoint_dir.parent}")
        if not checkpoint_dir.is_dir():
            raise MissingFile(
                f"Tokenizer directory {str(checkpoint_dir)!r} does not exist: expected a directory holding tokenizer.model"
            )
        self.checkpoint_dir = checkpoint_dir
        self.model_path = checkpoint_dir / "tokenizer.model"
        if not self.model_path.is_file():
            present = sorted(p.name for p in checkpoint_dir.iterdir())
            shown = ", ".join(present[:10]) + (f", ... ({len(present) - 10} more)" if len(present) > 10 else "")
            raise MissingFile(
                f"{self.model_path} does not exist: expected a SentencePiece tokenizer.model in {checkpoint_dir}"
                f" (found: {shown or 'nothing'})"
            )
        self.processor = SentencePieceProcessor()
        with reading(self.model_path, "a SentencePiece model", OSError, RuntimeError):
            self.processor.Load(str(self.model_path))

        self.vocab_size = self.processor.GetPieceSize()
        self.bos_id = self.processor.bos_id()
        self.eos_id = self.processor.eos_id()
        config_path = checkpoint_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = read_json(config_path)
            for key in ("bos_token", "eos_token"):
                token = _token_content(config.get(key))
                if token is None:
                    continue
                if not isinstance(token, str):
                    raise InvalidValue(f"{config_path}: {key}={token!r}: expected the token's piece, a string such as '</s>'")
                token_id = self.processor.PieceToId(token)
                if token_id == self.processor.unk_id() and token != self.processor.IdToPiece(token_id):
                    raise InvalidValue(f"{config_path}: {key}={token!r} is not a piece of {self.model_path}")
                setattr(self, key.replace("_token", "_id"), token_id)
        for name in ("bos_id", "eos_id"):
            if getattr(self, name) < 0:
                setattr(self, name, None)
        self._hash: Optional[str] = None

    @property
    def model_hash(self) -> str:
        if self._hash is None:
            self._hash = tokenizer_model_hash(self.model_path)
        return self._hash

    def _special(self, ids: List[int], bos: bool, eos: bool) -> List[int]:
        if bos:
            if self.bos_id is None:
                raise InvalidValue(f"{self.model_path} defines no BOS token; call encode with bos=False")
            ids.insert(0, self.bos_id)
        if eos:
            if self.eos_id is None:
                raise InvalidValue(f"{self.model_path} defines no EOS token; call encode with eos=False")
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> torch.Tensor:
        ids = self._special(self.processor.EncodeAsIds(text), bos, eos)
        return torch.tensor(ids, dtype=torch.int32)

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = True, num_threads: int = -1
    ) -> List[List[int]]:
        """Encode many documents in one call: SentencePiece spreads the list over `num_threads` threads
        (-1: all cores)."""
        if not isinstance(texts, list):
            texts = list(texts)
        batch = self.processor.Encode(texts, out_type=int, num_threads=num_threads)
        if bos or eos:
            for ids in batch:
                self._special(ids, bos, eos)
        return batch

    def decode(self, ids: Union[torch.Tensor, Iterable[int]]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.processor.DecodeIds(list(ids))

    def describe(self) -> str:
        """Its file and what tells it from another: "DIR/tokenizer.model (vocab_size=N, sha256=0123456789ab...)"."""
        return f"{self.model_path} (vocab_size={self.vocab_size}, sha256={self.model_hash[:12]}...)"

    def check_fits(self, embeddings: int, model_dir: Union[str, Path]) -> None:
        """Refuse a tokenizer with more pieces than the model has embeddings: it is not the model's tokenizer (an id
        past the last embedding would fail inside the model, or read another token's row)."""
        if self.vocab_size > embeddings:
            raise InvalidValue(
                f"{model_dir}: its tokenizer has {self.vocab_size:,} pieces and its model {embeddings:,} embeddings, so "
                f"the tokenizer is not the model's ({self.describe()}): put the tokenizer the model was trained with there"
            )

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.checkpoint_dir)!r}, vocab_size={self.vocab_size})"


def token_dtype(vocab_size: int):
    """Smallest numpy dtype that holds every token id: uint16 for vocabularies up to 65536 (half the disk)."""
    import numpy as np

    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)
