"""Any one prepared directory (and an optional validation directory)."""
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fabric_lin.data.base import DataModule, token_train_loader, token_val_loader
from fabric_lin.errors import InvalidValue


@dataclass
class TokenChunks(DataModule):
    """Token chunks written by `fabric-lin prepare_slimpajama` / `prepare_starcoder` (or SampleCorpus)."""

    data_path: Optional[Path] = None
    """Prepared directory to train on."""
    val_path: Optional[Path] = None
    """Prepared directory to validate on; without it `val_dataloader()` returns None (no validation)."""
    shuffle: bool = True
    """Shuffle the training blocks."""
    seed: int = 42
    num_workers: int = 8

    def setup(self) -> None:
        from fabric_lin.data.prepared import check_prepared_dir

        if self.data_path is None:
            raise InvalidValue("TokenChunks needs data_path: a directory written by fabric-lin's preprocessors")
        check_prepared_dir(self.data_path, self.tokenizer, self.vocab_size)
        if self.val_path is not None:
            check_prepared_dir(self.val_path, self.tokenizer, self.vocab_size)

    def train_dataloader(self):
        return token_train_loader(
            [self.data_path], self.block_size, self.batch_size, self.num_workers, self.seed, self.tokenizer, shuffle=self.shuffle
        )

    def val_dataloader(self):
        if self.val_path is None:
            return None
        return token_val_loader(self.val_path, self.block_size, self.batch_size, self.num_workers, self.tokenizer)
