"""Your own corpus, prepared by `fabric-lin prepare_text`: one training directory or several mixed by weights."""
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Union

from fabric_lin.data.base import DataModule, say_once, token_train_loader, token_val_loader
from fabric_lin.data.prepared import INDEX_FILE, PREPARED_INFO_FILE, check_not_prepare_text_output, prepared_from
from fabric_lin.errors import InvalidValue, MissingFile


@dataclass
class TextFiles(DataModule):
    """Directories written by `fabric-lin prepare_text` (OUT/train, OUT/val), or any prepared directories.

    Several training directories are mixed as SlimPajamaStarcoder mixes its two: the one sample stream of
    `fabric_lin.data.sample_order`, each directory's share set by `train_weights`."""

    train_dir: Union[Path, List[Path], None] = None
    """The prepared training directory (prepare_text's OUT/train), or a list of them to mix."""
    val_dir: Optional[Path] = None
    """The prepared validation directory (OUT/val). Not given: no validation, said at start-up."""
    train_weights: Optional[List[float]] = None
    """Relative shares of training samples drawn from each train_dir, in order (normalised to sum to 1).
    Default: the directories' token counts, so each sample is read about as often as any other."""
    seed: int = 42
    num_workers: int = 8

    def __post_init__(self) -> None:
        self.check_weights()

    @property
    def train_dirs(self) -> List[Path]:
        if self.train_dir is None:
            return []
        return [Path(p) for p in (self.train_dir if isinstance(self.train_dir, (list, tuple)) else [self.train_dir])]

    def check_weights(self) -> None:
        if self.train_weights is None:
            return
        weights = list(self.train_weights) if isinstance(self.train_weights, (list, tuple)) else [self.train_weights]
        if len(weights) != len(self.train_dirs) or not all(
            isinstance(w, (int, float)) and 0 < w < float("inf") for w in weights
        ):
            raise InvalidValue(
                f"data.train_weights must be one positive number per data.train_dir ({len(self.train_dirs)}: "
                f"{', '.join(map(str, self.train_dirs)) or 'none'}); got {weights}. Leave it out to mix by size"
            )

    def prepared_dirs(self) -> List[Path]:
        return self.train_dirs + self.validation_dirs()

    def validation_dirs(self) -> List[Path]:
        return [Path(self.val_dir)] if self.val_dir is not None else []

    def setup(self) -> None:
        if not self.train_dirs and self.val_dir is None:  # evaluate reads val_dir alone
            raise InvalidValue("TextFiles was given no directory: data.train_dir (to train on) or data.val_dir (to "
                               "validate on; all that evaluate reads), each written by `fabric-lin prepare_text` (its "
                               "OUT/train and OUT/val)")
        self.check_weights()
        if self.val_dir is not None:  # a typo must not turn validation off
            self.check_val_dir(", or leave data.val_dir out to train without validation")
        # DataModule.setup's check, keeping each directory's prepared.json for the checks after it
        infos = self.check_prepared(self.prepared_dirs())
        train_infos = infos[:len(self.train_dirs)]
        self.check_each_train_dir_once(train_infos)
        self.warn_of_splits_given_for_each_other(self.train_dirs, self.val_dir, "data.train_dir", "data.val_dir")
        if self.val_dir is None:
            say_once("TextFiles: no validation: data.val_dir is not set")
        else:
            self.warn_of_validation_trained_on(self.val_dir, self.train_dirs, "data.val_dir", "data.train_dir",
                                               fix=" (prepare_text's --val_fraction holds documents out into OUT/val)")

    def setup_validation(self) -> None:
        # evaluate reads val_dir alone: the training directories need not be on this machine
        if self.val_dir is not None:
            self.check_val_dir()
        self.check_prepared(self.validation_dirs())

    def check_val_dir(self, other_fix: str = "") -> None:
        """data.val_dir is there, and is no prepare_text --output_dir (whose val/ is meant); `other_fix` ends the
        error for a missing one."""
        if not Path(self.val_dir).exists():
            # prepare_text writes no OUT/val where it held out no document
            raise MissingFile(f"data.val_dir {self.val_dir} does not exist: give a prepared validation directory "
                              f"(prepare_text's OUT/val, written where --val_fraction held out any document){other_fix}")
        check_not_prepare_text_output(Path(self.val_dir), "data.val_dir")

    def check_each_train_dir_once(self, train_infos: List[dict]) -> None:
        """Refuse a training directory listed twice, under one path or two (a link, a copy: one index.json), and two
        preparations of one input (their prepared.json, `train_infos`). Each entry is a source of its own, read in an
        order of its own, so its samples would repeat within an epoch of the mix, where a larger train_weights share
        reads each of them once per epoch."""
        from fabric_lin.data.sample_order import source_key

        first_of, first_of_input = {}, {}
        for path, info in zip(self.train_dirs, train_infos):
            first = first_of.setdefault(source_key(path), path)
            if first is not path:
                same = (f"{first} twice" if first == path
                        else f"{first} and {path}, one directory" if first.resolve() == path.resolve()
                        else f"{first} and {path}, one data set (their {INDEX_FILE} is the same)")
                raise InvalidValue(f"data.train_dir lists {same}: each listed directory is read as a source of its own, so "
                                   f"its samples would repeat within an epoch; list it once and give it a larger share "
                                   f"with data.train_weights")
            source = prepared_from(info)
            first = first_of_input.setdefault((source, info.get("split")), path) if source is not None else path
            if first is not path:
                raise InvalidValue(f"data.train_dir lists {first} and {path}, two preparations of one input ({source}: "
                                   f"their {PREPARED_INFO_FILE}): the documents they share would be read twice in an "
                                   f"epoch; list one of them and give it a larger share with data.train_weights")

    def no_train_dir(self) -> InvalidValue:
        return InvalidValue(
            "TextFiles needs data.train_dir: a directory written by `fabric-lin prepare_text` (its OUT/train), or a list of them"
        )

    def train_dataloader(self):
        if not self.train_dirs:
            raise self.no_train_dir()
        weights = self.train_weights
        if weights is None and len(self.train_dirs) > 1:
            from fabric_lin.data.prepared import chunk_tokens

            weights = [float(chunk_tokens(path).sum()) for path in self.train_dirs]
        return token_train_loader(self.train_dirs, self.block_size, self.batch_size, self.num_workers, self.seed,
                                  weights=weights)

    def val_dataloader(self):
        if self.val_dir is None:
            return None
        return token_val_loader(self.val_dir, self.block_size, self.batch_size, self.num_workers)
