"""Any one prepared directory (and an optional validation directory)."""
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from fabric_lin.data.base import DataModule, say_once, token_train_loader, token_val_loader
from fabric_lin.data.prepared import check_not_prepare_text_output
from fabric_lin.errors import InvalidValue, MissingFile


@dataclass
class TokenChunks(DataModule):
    """Token chunks written by `fabric-lin prepare_slimpajama` / `prepare_starcoder` (or SampleCorpus)."""

    data_path: Optional[Path] = None
    """Prepared directory to train on."""
    val_path: Optional[Path] = None
    """Prepared directory to validate on. Not given: no validation, said at start-up."""
    shuffle: bool = True
    """Shuffle the training blocks."""
    seed: int = 42
    num_workers: int = 8

    def prepared_dirs(self) -> List[Path]:
        return ([Path(self.data_path)] if self.data_path is not None else []) + self.validation_dirs()

    def validation_dirs(self) -> List[Path]:
        return [Path(self.val_path)] if self.val_path is not None else []

    def setup(self) -> None:
        if self.data_path is None and self.val_path is None:  # evaluate reads val_path alone
            raise InvalidValue("TokenChunks was given no directory: data.data_path (to train on) or data.val_path (to "
                               "validate on; all that evaluate reads), each written by fabric-lin's preprocessors")
        if self.val_path is not None:
            check_not_prepare_text_output(Path(self.val_path), "data.val_path")
        super().setup()
        self.warn_of_splits_given_for_each_other([self.data_path] if self.data_path is not None else [], self.val_path,
                                                 "data.data_path", "data.val_path")
        if self.val_path is None:
            say_once("TokenChunks: no validation: data.val_path is not set")
        elif self.data_path is not None:
            self.warn_of_validation_trained_on(self.val_path, [self.data_path], "data.val_path", "data.data_path")

    def setup_validation(self) -> None:
        # evaluate reads val_path alone: the training directory need not be on this machine
        if self.val_path is not None and not Path(self.val_path).exists():
            raise MissingFile(f"data.val_path {self.val_path} does not exist: give a prepared validation directory "
                              "(written by fabric-lin's preprocessors)")
        if self.val_path is not None:
            check_not_prepare_text_output(Path(self.val_path), "data.val_path")
        self.check_prepared(self.validation_dirs())

    def no_data_path(self) -> InvalidValue:
        return InvalidValue("TokenChunks needs data.data_path: a directory written by fabric-lin's preprocessors")

    def train_dataloader(self):
        if self.data_path is None:
            raise self.no_data_path()
        return token_train_loader(
            [self.data_path], self.block_size, self.batch_size, self.num_workers, self.seed, shuffle=self.shuffle
        )

    def val_dataloader(self):
        if self.val_path is None:
            return None
        return token_val_loader(self.val_path, self.block_size, self.batch_size, self.num_workers)
