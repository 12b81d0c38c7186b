"""SlimPajama mixed with Starcoder, as in TinyLlama's pretraining."""
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

from litdata.streaming import CombinedStreamingDataset
from litdata.utilities.env import _WorkerEnv

from fabric_lin.data.base import DataModule, token_dataloader, token_dataset


class MixedStreamingDataset(CombinedStreamingDataset):
    """CombinedStreamingDataset whose resume is exact with several DataLoader workers.

    litdata (0.2.76) restores each child dataset from the child's total sample count and splits that
    total over the workers as if they had taken whole batches from the child in turn. With weighted
    mixing a worker's batch holds samples of both children, so every worker resumes at a wrong place.
    The loader state does hold each worker's count per child (`num_samples_yielded`); here, inside the
    worker, each child is given the total whose round-robin split yields exactly this worker's count."""

    def __iter__(self):
        worker = _WorkerEnv.detect()
        counts = (self._num_samples_yielded or {}).get(worker.rank)
        if counts is not None:
            for dataset, count in zip(self._datasets, counts):
                state = getattr(dataset, "_state_dict", None)
                if state:
                    batch_size, num_workers = state["batch_size"], state["num_workers"]
                    full_rounds, rest = divmod(count, batch_size)
                    # full rounds for every worker, a full batch for each worker before this one, then `rest`
                    total = full_rounds * num_workers * batch_size + worker.rank * batch_size + rest
                    dataset._state_dict = {**state, "num_samples_yielded": total}
        return super().__iter__()


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
            raise ValueError(
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

    def setup(self) -> None:
        from fabric_lin.data.prepared import check_prepared_dir

        self.check_weights()  # again here: subclasses with their own __post_init__ reach this

        paths = [self.slimpajama_train] + ([self.slimpajama_val] if self.validation else [])
        for path in paths + ([self.starcoder_train] if self.use_starcoder else []):
            check_prepared_dir(path, self.tokenizer, self.vocab_size)

    def train_dataloader(self):
        datasets = [token_dataset(self.slimpajama_train, self.block_size, True, self.seed, self.tokenizer)]
        if self.use_starcoder:
            datasets.append(token_dataset(self.starcoder_train, self.block_size, True, self.seed, self.tokenizer))
            # iterate_over_all=False: sample by the weights; the epoch ends when one dataset runs out
            dataset = MixedStreamingDataset(
                datasets=datasets, seed=self.seed, weights=tuple(self.weights), iterate_over_all=False
            )
        else:
            dataset = datasets[0]
        return token_dataloader(dataset, self.batch_size, self.num_workers)

    def val_dataloader(self):
        if not self.validation:
            return None
        dataset = token_dataset(self.slimpajama_val, self.block_size, False, self.seed, self.tokenizer)
        return token_dataloader(dataset, self.batch_size, self.num_workers)
