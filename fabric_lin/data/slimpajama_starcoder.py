"""SlimPajama mixed with Starcoder, as in TinyLlama's pretraining: the recipes that tokenize their raw files
(run by `fabric-lin prepare_slimpajama` / `prepare_starcoder` and by the sample corpus) and the data module that
mixes what they write."""
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Tuple

from fabric_lin.data.base import DataModule, token_train_loader, token_val_loader
from fabric_lin.data.raw_files import find_files, holds_no_text, iter_parquet_texts, read_slimpajama_file
from fabric_lin.data.recipe import TokenizeRecipe
from fabric_lin.errors import InvalidValue, MissingFile

SKIPPED_SET = "RedPajamaGithub"  # SlimPajama's GitHub rows: Starcoder holds the code
# Documents handed to the tokenizer at once; a SlimPajama file holds a few thousand documents.
SLIMPAJAMA_DOCUMENTS_PER_BATCH = 8192
STARCODER_COLUMN = "content"
STARCODER_ROWS_PER_BATCH = 8192


class SlimPajamaRecipe(TokenizeRecipe):
    """Every `*.jsonl.zst` under the input directory: field `text` of each JSON line, less the RedPajamaGithub rows
    and, as prepare_text leaves them out, the documents of nothing but whitespace (counted)."""

    name = "slimpajama"
    filtered_rows = f"{SKIPPED_SET} rows left out (Starcoder holds the code)"

    def find_inputs(self, input_dir: str) -> List[str]:
        return [str(p) for p in find_files(input_dir, ".jsonl.zst")]

    def read_documents(self, path: str) -> Iterator[List[str]]:
        # The whole file is read and validated first (read_slimpajama_file), so a bad file adds nothing.
        rows = read_slimpajama_file(path)
        kept = [text for text, set_name in rows if set_name != SKIPPED_SET]
        self._skipped_rows += len(rows) - len(kept)
        texts = [text for text in kept if not holds_no_text(text)]
        self._empty_documents += len(kept) - len(texts)
        for start in range(0, len(texts), SLIMPAJAMA_DOCUMENTS_PER_BATCH):
            yield texts[start : start + SLIMPAJAMA_DOCUMENTS_PER_BATCH]


class StarcoderRecipe(TokenizeRecipe):
    """Every `*.parquet` under the input directory: column `content`, 8192 rows at a time, less, as prepare_text leaves
    them out, the rows of nothing but whitespace, empty or null (counted)."""

    name = "starcoder"

    def find_inputs(self, input_dir: str) -> List[str]:
        return [str(p) for p in find_files(input_dir, ".parquet")]

    def read_documents(self, path: str) -> Iterator[List[str]]:
        for rows in iter_parquet_texts(path, column=STARCODER_COLUMN, batch_size=STARCODER_ROWS_PER_BATCH):
            texts = [text for text in rows if not holds_no_text(text)]
            self._empty_documents += len(rows) - len(texts)
            yield texts


@dataclass
class SlimPajamaStarcoder(DataModule):
    """Prepared SlimPajama (train, val) and Starcoder directories under `data_path`."""

    data_path: Path = Path("data/")
    """Holds slimpajama/train, slimpajama/val and starcoder, each written by fabric-lin's preprocessors."""
    use_starcoder: bool = True
    """Mix Starcoder into the training data (by `weights`); False trains on SlimPajama alone."""
    weights: Tuple[float, float] = (0.693584, 0.306416)
    """Relative shares of training samples drawn from SlimPajama and from Starcoder (normalised to sum to 1).
    The default is the two datasets' token counts in TinyLlama's mix."""
    seed: int = 42
    num_workers: int = 8
    validation: bool = True
    """False: no validation split (the loop skips validation), e.g. for contexts longer than its chunks."""

    def __post_init__(self) -> None:
        self.check_weights()

    def check_weights(self) -> None:
        weights = list(self.weights) if isinstance(self.weights, (list, tuple)) else [self.weights]
        if len(weights) != 2 or not all(isinstance(w, (int, float)) and math.isfinite(w) and w > 0 for w in weights):
            raise InvalidValue(
                f"data.weights must be two positive numbers, the shares of SlimPajama and Starcoder "
                f"(default [0.693584, 0.306416]); got {weights}. To train on SlimPajama alone set "
                f"data.use_starcoder false"
            )

    @property
    def slimpajama_train(self) -> Path:
        return Path(self.data_path) / "slimpajama" / "train"

    @property
    def slimpajama_val(self) -> Path:
        return Path(self.data_path) / "slimpajama" / "val"

    @property
    def starcoder_train(self) -> Path:
        return Path(self.data_path) / "starcoder"

    def prepared_dirs(self) -> List[Path]:
        return ([self.slimpajama_train] + self.validation_dirs()
                + ([self.starcoder_train] if self.use_starcoder else []))

    def validation_dirs(self) -> List[Path]:
        return [self.slimpajama_val] if self.validation else []

    def setup(self) -> None:
        self.check_weights()  # again here: subclasses with their own __post_init__ reach this
        self.check_layout(self.prepared_dirs())
        super().setup()
        if self.validation:
            train = [self.slimpajama_train] + ([self.starcoder_train] if self.use_starcoder else [])
            self.warn_of_validation_trained_on(self.slimpajama_val, train)

    def setup_validation(self) -> None:
        # evaluate reads slimpajama/val alone: the training directories need not be on this machine
        self.check_layout(self.validation_dirs())
        self.check_prepared(self.validation_dirs())

    def check_layout(self, dirs: List[Path]) -> None:
        """Each of `dirs` is there under data_path: the one key that places them all is named, with the layout
        (the preprocessors write each where their --output_dir says, so data_path is where the user put them)."""
        data_path = Path(self.data_path)
        layout = [path.relative_to(data_path) for path in dirs]
        missing = [relative for relative in layout if not (data_path / relative).exists()]
        if not missing:
            return
        # data_path given as one of the directories inside it (data/slimpajama, data/slimpajama/train)
        meant = next((above for above in (data_path.parent, data_path.parent.parent)
                      if all((above / relative).exists() for relative in layout)), None)
        written_by = ("each is the --output_dir of prepare_slimpajama or prepare_starcoder (data.use_starcoder false: "
                      "no starcoder, data.validation false: no slimpajama/val)" if self.slimpajama_train in dirs else
                      "it is the --output_dir of prepare_slimpajama run on SlimPajama's validation files")
        hint = f": did you mean --data.data_path {meant}?" if meant is not None else f"; {written_by}"
        raise MissingFile(f"data.data_path {data_path} holds no {missing[0]} ({data_path / missing[0]} does not exist): "
                          f"expected {', '.join(map(str, layout))} under it{hint}")

    def train_dataloader(self):
        if not self.use_starcoder:
            return token_train_loader([self.slimpajama_train], self.block_size, self.batch_size, self.num_workers,
                                      self.seed)
        # each dataset is read epoch after epoch: the shares hold for the whole run
        return token_train_loader([self.slimpajama_train, self.starcoder_train], self.block_size, self.batch_size,
                                  self.num_workers, self.seed, weights=self.weights)

    def val_dataloader(self):
        if not self.validation:
            return None
        return token_val_loader(self.slimpajama_val, self.block_size, self.batch_size, self.num_workers)
