"""The data module interface the trainer uses, and the pieces the token data modules share."""
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from fabric_lin.data.prepared import (
    DOCUMENT_KEYS,
    carried_tokenizer_dir,
    check_prepared_dirs,
    sample_tokens,
    shares_documents,
)
from fabric_lin.data.tokenizer import Tokenizer
from fabric_lin.errors import InvalidValue
from fabric_lin.stopping import STOP_SIGNALS


@dataclass
class DataModule:
    """Base of fabric-lin's data modules (LitGPT's shape, without Lightning's DataModule machinery).

    The trainer calls `connect(tokenizer, batch_size, max_seq_length, vocab_size)`, then `prepare_data()` on
    rank 0, `setup()` on every rank, then `train_dataloader()` / `val_dataloader()`. Batches are int64
    tensors [batch_size, max_seq_length + 1]: inputs are `batch[:, :-1]`, targets `batch[:, 1:]`."""

    seed: int = 42
    """Seed of the shuffling and of the dataset mixing."""
    num_workers: int = 8
    """DataLoader worker processes per rank."""

    tokenizer: Optional[Tokenizer] = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)
    vocab_size: Optional[int] = field(default=None, init=False, repr=False)
    """The model's vocabulary: prepared directories made with a larger one are refused in `setup()`."""
    prepared: Dict[Path, dict] = field(default_factory=dict, init=False, repr=False)
    """The prepared.json of each directory that `setup()` (or `setup_validation()`) checked, read there once: the
    loaders read directories checked there, and what the run records of the data (its tokenizer) comes from here."""

    def connect(
        self, tokenizer: Optional[Tokenizer] = None, batch_size: int = 1, max_seq_length: int = -1,
        vocab_size: Optional[int] = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length
        self.vocab_size = vocab_size

    def validate(self) -> None:
        """Check the options before any work (the trainer calls it first): each wrong value named."""
        if type(self) is DataModule:  # --data.<option> alone: jsonargparse builds the base class
            raise InvalidValue(
                "--data.* options need a data module: give --data SampleCorpus, LongDocuments, TokenChunks, "
                "SlimPajamaStarcoder or TextFiles (or a config file's data: class_path) before them"
            )
        if not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise InvalidValue(f"data.num_workers must be 0 (load in the training process) or a positive number of "
                             f"DataLoader worker processes per rank, got {self.num_workers!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidValue(f"data.seed must be a non-negative integer (it seeds the data order), got {self.seed!r}")

    def prepare_data(self) -> None:
        pass

    def prepared_dirs(self) -> List[Path]:
        """The prepared directories a run reads, training and validation (none for a module of its own)."""
        return []

    def validation_dirs(self) -> List[Path]:
        """The prepared directories the validation loader reads. A module that does not tell: all of them."""
        return self.prepared_dirs()

    def training_dirs(self) -> List[Path]:
        """The prepared directories a run trains on: those it does not read for validation alone."""
        validation = {Path(d) for d in self.validation_dirs()}
        return [Path(d) for d in self.prepared_dirs() if Path(d) not in validation]

    def training_data_record(self) -> List[dict]:
        """What weights trained on this data record of it (their trained_with.json's "data", which evaluate compares
        its data with): each training directory, the digest of its index.json (a copy's is the same) and what its
        prepared.json, read by `setup()`, says of the documents' input (`DOCUMENT_KEYS`), for when it is gone."""
        from fabric_lin.data.sample_order import source_key

        record = []
        for directory in self.training_dirs():
            info = self.prepared.get(directory, {})
            record.append({"dir": str(directory.absolute()), "index": source_key(directory),
                           "documents": {key: info[key] for key in DOCUMENT_KEYS if key in info}})
        return record

    def setup(self) -> None:
        """Check the data before any of it is read: every directory complete, all made by one tokenizer, the
        run's `tokenizer` (when connected) and made for the model's `vocab_size`, each wrong one named."""
        self.check_prepared(self.prepared_dirs())

    def check_prepared(self, dirs: Sequence[Path]) -> List[dict]:
        """`check_prepared_dirs` of `dirs` with the connected tokenizer and vocabulary; their prepared.json, which it
        returns, kept in `prepared`."""
        infos = check_prepared_dirs(dirs, self.tokenizer, self.vocab_size)
        self.prepared = {Path(path): info for path, info in zip(dirs, infos)}
        for path, info in self.prepared.items():
            say_of_fast_dev_run(path, info)
        return infos

    def warn_of_validation_trained_on(self, val_dir: Path, train_dirs: Sequence[Path], val_key: str = "",
                                      train_key: str = "", fix: str = "") -> None:
        """Say once where the validation directory holds documents that a training directory trains on: the same
        directory, a copy of it (one index.json), or as their prepared.json (read by `setup()`) tell
        (`shares_documents`). `val_key`, `train_key`: the options naming them; `fix` ends the line."""
        from fabric_lin.data.sample_order import source_key

        val = Path(val_dir)
        for train in map(Path, train_dirs):
            given = (f"{val_key} {val}" if val_key else str(val), f"{train_key} {train}" if train_key else str(train))
            if train.resolve() == val.resolve():
                said = f"{given[0]} is also {train_key or train}"
            else:
                how = documents_in_common(val, self.prepared[val], source_key(train), self.prepared[train])
                said = f"{given[0]} holds documents that {given[1]} trains on: {how}" if how else None
            if said:
                say_once(f"Warning: {said}: the validation loss is measured on training data{fix}")
                return

    def warn_of_splits_given_for_each_other(self, train_dirs: Sequence[Path], val_dir: Optional[Path], train_key: str,
                                            val_key: str) -> None:
        """Say once where the validation directory is the train/ split of an input whose val/ split (the documents
        prepare_text held out) is a training directory, by their prepared.json (read by `setup()`): the two given for
        each other, most likely. The run would train on the held-out share, epoch after epoch, and measure its loss on
        the rest. (A val/ mixed into the training data beside its train/ is no mistake.)"""
        from fabric_lin.data.prepared import prepared_from

        val_info = self.prepared.get(Path(val_dir), {}) if val_dir is not None else {}
        if val_info.get("split") != "train" or prepared_from(val_info) is None:
            return
        for train in map(Path, train_dirs):
            info = self.prepared.get(train, {})
            if info.get("split") == "val" and prepared_from(info) == prepared_from(val_info):
                say_once(f"Warning: {train_key} {train} is the val/ split that prepare_text held out and {val_key} "
                         f"{val_dir} the train/ split of the same input, given for each other: the run trains on the "
                         f"held-out documents and validates on the others; did you mean --{train_key} {val_dir} "
                         f"--{val_key} {train}?")
                return

    def setup_validation(self) -> None:
        """`setup()` for a reader of the validation split alone (evaluate): a module whose validation directories
        stand apart from its training ones checks only those, so data without the training split is read."""
        self.setup()

    @property
    def tokenizer_dir(self) -> Optional[Path]:
        """The tokenizer that made the prepared directories (the preprocessors copy its files beside the tokens),
        which the run's checkpoints then hold; None where they carry none."""
        return carried_tokenizer_dir(self.prepared_dirs())

    def train_dataloader(self):
        raise NotImplementedError

    def val_dataloader(self):
        raise NotImplementedError

    @property
    def block_size(self) -> int:
        if self.max_seq_length is None or self.max_seq_length < 1:
            raise InvalidValue(
                f"{type(self).__name__}: max_seq_length={self.max_seq_length}; call"
                " connect(tokenizer, batch_size, max_seq_length) with max_seq_length >= 1 first"
            )
        return sample_tokens(self.max_seq_length)


def collate_tokens(samples: Sequence[Union[np.ndarray, torch.Tensor]]) -> torch.Tensor:
    """Stack token blocks (stored as uint16 or int32) into one int64 batch."""
    if isinstance(samples[0], torch.Tensor):
        return torch.stack(list(samples)).long()
    return torch.from_numpy(np.stack(samples).astype(np.int64))


def token_train_loader(
    paths: Sequence[Union[str, Path]], block_size: int, batch_size: int, num_workers: int, seed: int,
    weights: Optional[Sequence[float]] = None, shuffle: bool = True,
):
    """The training loader of prepared directories that the data module's `setup()` checked (mixed by `weights`):
    batches of this process from a stream of samples that is the same on any number of processes
    (`fabric_lin.data.sample_order`)."""
    from fabric_lin.data.sample_order import SampleStream, TrainLoader

    stream = SampleStream(paths, block_size, seed, weights, shuffle)
    return TrainLoader(stream, batch_size, num_workers, worker_init_fn=leave_stop_signals_to_the_trainer)


def token_val_loader(path: Union[str, Path], block_size: int, batch_size: int, num_workers: int):
    """The validation loader of one prepared directory that the data module's `setup()` (or `setup_validation()`)
    checked: its `block_size`-token blocks once, in order, the processes taking micro batches in turn
    (`fabric_lin.data.sample_order.ValidationLoader`)."""
    from fabric_lin.data.sample_order import ValidationLoader

    return ValidationLoader(path, block_size, batch_size, num_workers, worker_init_fn=leave_stop_signals_to_the_trainer)


def leave_stop_signals_to_the_trainer(worker_id: int) -> None:
    """The signals that stop a run reach the DataLoader workers too: a terminal's Ctrl-C goes to the whole
    foreground job, and schedulers (SLURM's preemption and scancel, Kubernetes, systemd, `timeout`) send
    SIGTERM to every process of the job. The trainer answers them by stopping with a checkpoint at the next
    step boundary, which needs the workers' next batches; a worker that took one would end at once
    (SIGTERM's default, or PyTorch's worker loop returning on KeyboardInterrupt) and the next batch fail.
    So the workers ignore them. A worker still ends with its trainer: the trainer shuts its workers down
    when it stops, and a worker whose trainer has died notices within seconds and exits."""
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)


def documents_in_common(val_dir: Path, val_info: dict, train_index: Optional[str], train_info: dict) -> Optional[str]:
    """How the prepared directory `val_dir` (its prepared.json `val_info`) holds documents of another, a training
    directory, told by the digest of its index.json `train_index` (`source_key`: the same, a copy of one data set) or
    its prepared.json's `train_info` (`shares_documents`: the same input, or one inside the other's); None where
    neither tells of any."""
    from fabric_lin.data.sample_order import source_key

    if train_index is not None and train_index == source_key(val_dir):
        return "their index.json is the same, one data set"
    return shares_documents(val_info, train_info)


def say_of_fast_dev_run(path: Path, info: dict) -> None:
    """A directory prepared with --fast_dev_run holds the first files of its input only, yet is as complete as any: say
    so once, or a trial slice left where the full preparation belongs passes for all of the data."""
    first, found = info.get("fast_dev_run"), info.get("input_files")
    if not first or (isinstance(found, int) and found <= first):
        return
    of = f" of the {found:,}" if isinstance(found, int) else ""
    say_once(f"Note: {path} was prepared with --fast_dev_run {first}: it holds the first {first}{of} files of "
             f"{info.get('input_dir', 'its input')} only; prepare it again without --fast_dev_run for all of them")


def say_once(message: str) -> None:
    """Print `message` in the first process only (every process of a run sets its data module up)."""
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    if getattr(rank_zero_only, "rank", 0) == 0:
        print(message, flush=True)
