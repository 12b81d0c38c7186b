"""The training data as one stream of samples, the same on any number of processes.

Position p of the stream is a fixed sample, chosen from the seed alone: step s of a run trains on
positions [s * G, (s + 1) * G), G the global batch size, however they are split. Process `rank` of
`world_size` takes micro batches of B positions in turn: its t-th holds positions
`start + (t * world_size + rank) * B + [0, B)`. A checkpoint saves one number, the next position, so a
run resumed on another number of processes, DataLoader workers or micro batch size continues the same
stream: no sample is repeated or skipped, and each step sees the samples it would have seen.

A run resumed on other data on purpose (`--resume_changes data`: a new mix, another directory) starts a new
stream at position 0, in which each source that the old one read carries on in its old order after the
samples it gave (`carried`; a source is known by its index.json, wherever it lies), so none is read twice.

litdata's StreamingDataLoader cannot do this: its state is a count per process and per worker, striped
over the layout that wrote it, and a CombinedStreamingDataset resumes only on that same layout (it
fails inside litdata otherwise). litdata still reads the chunks: a sample is `StreamingDataset[i]`.

Validation reads a split the same way, unshuffled and once (`ValidationLoader`): position p is block p of
the split, and the processes take micro batches in turn as above, so the first N positions are the same
blocks on any layout and with any micro batch size.

Which sample a position holds:
- Mixing: positions come in groups (1,024 positions for the SlimPajama/Starcoder mix, `mix_group_size`);
  each group gives every source its share by the weights, exactly (the rounding carried from group to
  group), at seeded places within the group. So the number of samples each source gave before a position is known without counting.
- Each source is read in epochs, again and again. An epoch visits the source's chunk files in a seeded
  order, `WINDOW_CHUNKS` files at a time, the blocks of those files in a seeded order: every block once
  per epoch, reading a few files at a time (as litdata's own shuffle does) while mixing the documents
  of many.
"""
import hashlib
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from fabric_lin.data.prepared import INDEX_FILE, BlockTooLong, chunk_tokens
from fabric_lin.errors import InvalidValue

# chunk files whose blocks are shuffled together: enough files to mix many documents' blocks in a batch,
# few enough that the order of one window (its blocks' indices) stays small
WINDOW_CHUNKS = 16
STATE_FORMAT = "fabric-lin sample stream 2"
# seed streams of the three kinds of draw, so that no two draws share one
CHUNK_ORDER, WINDOW_ORDER, MIX_PLACES = 1, 2, 3


class SourceOrder:
    """The order in which one source's blocks are read: block index (litdata's) of its k-th sample."""

    def __init__(self, blocks: np.ndarray, seed: int, source: int, shuffle: bool):
        self.blocks = blocks  # per chunk file
        self.total = int(blocks.sum())
        self.chunk_starts = np.concatenate([[0], np.cumsum(blocks)])  # first block index of each chunk
        self.seed, self.source, self.shuffle = seed, source, shuffle
        # the last epoch's and window's orders: a process reads its source's samples in increasing k
        self._starts: Tuple[int, Optional[np.ndarray]] = (-1, None)
        self._window: Tuple[Tuple[int, int], Optional[np.ndarray]] = ((-1, -1), None)

    def block(self, k: int) -> int:
        epoch, i = divmod(k, self.total)
        window_starts = self.window_starts(epoch)
        window = int(np.searchsorted(window_starts, i, side="right")) - 1
        return int(self.window_blocks(epoch, window)[i - window_starts[window]])

    def chunk_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.blocks))
        return np.random.default_rng([self.seed, CHUNK_ORDER, self.source, epoch]).permutation(len(self.blocks))

    def window_starts(self, epoch: int) -> np.ndarray:
        """Position within the epoch of each window's first block."""
        if self._starts[0] != epoch:
            sizes = self.blocks[self.chunk_order(epoch)]
            per_window = np.add.reduceat(sizes, np.arange(0, len(sizes), WINDOW_CHUNKS))
            self._starts = (epoch, np.concatenate([[0], np.cumsum(per_window)[:-1]]))
        return self._starts[1]

    def window_blocks(self, epoch: int, window: int) -> np.ndarray:
        """The block indices of one window's chunk files, in the order they are read."""
        if self._window[0] != (epoch, window):
            chunks = self.chunk_order(epoch)[window * WINDOW_CHUNKS : (window + 1) * WINDOW_CHUNKS]
            indices = np.concatenate([np.arange(self.chunk_starts[c], self.chunk_starts[c + 1]) for c in chunks])
            if self.shuffle:
                np.random.default_rng([self.seed, WINDOW_ORDER, self.source, epoch, window]).shuffle(indices)
            self._window = ((epoch, window), indices)
        return self._window[1]


def mix_group_size(weights: Sequence[float]) -> int:
    """Positions per mixing group: a power of two >= 1024 that gives the least of the sources a share of
    at least one sample per source (so the rounding never takes a group's last place from a source)."""
    size = 1024
    while size * min(weights) < len(weights):
        size *= 2
    return size


class MixOrder:
    """Which source each position draws from, and how many samples that source gave before it."""

    def __init__(self, weights: Sequence[float], seed: int):
        total = sum(weights)
        self.shares = np.array([w / total for w in weights], dtype=np.float64)
        self.group = mix_group_size(self.shares)
        self.seed = seed
        self._places: Tuple[int, Optional[Tuple[np.ndarray, np.ndarray]]] = (-1, None)

    def given_before_group(self, group: int) -> np.ndarray:
        """Samples each source gave in groups [0, group): its share rounded down, the last source the rest."""
        n = group * self.group
        counts = np.floor(n * self.shares[:-1]).astype(np.int64)
        return np.append(counts, n - counts.sum())

    def group_places(self, group: int) -> Tuple[np.ndarray, np.ndarray]:
        """(source, that source's samples given before this place) of each place of one group."""
        if self._places[0] != group:
            self._places = (group, self.draw_places(group))
        return self._places[1]

    def draw_places(self, group: int) -> Tuple[np.ndarray, np.ndarray]:
        before = self.given_before_group(group)
        counts = self.given_before_group(group + 1) - before
        sources = np.repeat(np.arange(len(counts)), counts)
        np.random.default_rng([self.seed, MIX_PLACES, group]).shuffle(sources)
        given_before = np.empty_like(sources)
        for source in range(len(counts)):
            places = np.flatnonzero(sources == source)
            given_before[places] = before[source] + np.arange(len(places))
        return sources, given_before

    def sample(self, position: int) -> Tuple[int, int]:
        """(source, k): position `position` holds the source's k-th sample."""
        group, place = divmod(position, self.group)
        sources, given_before = self.group_places(group)
        return int(sources[place]), int(given_before[place])

    def given_before(self, position: int) -> np.ndarray:
        """Samples each source gave at positions [0, position)."""
        group, place = divmod(position, self.group)
        sources, _ = self.group_places(group)
        return self.given_before_group(group) + np.bincount(sources[:place], minlength=len(self.shares))


def source_key(path: Path) -> str:
    """What identifies a prepared directory's samples wherever it lies: a digest of its index.json."""
    return hashlib.sha256((Path(path) / INDEX_FILE).read_bytes()).hexdigest()[:16]


class SampleStream(IterableDataset):
    """The stream of `block_size`-token samples of one or more prepared directories, mixed by `weights`;
    iterated, the micro batches of one process (`place`) from a start position, forever. `seed` is the data module's,
    which its `validate()` checked."""

    def __init__(self, paths: Sequence[Path], block_size: int, seed: int, weights: Optional[Sequence[float]] = None,
                 shuffle: bool = True):
        from litdata.streaming import StreamingDataset, TokensLoader

        self.paths = [Path(p) for p in paths]
        # each source's samples first: a directory that gives none is named, not the zero weight its size would make
        self.orders = []
        for source, path in enumerate(self.paths):
            tokens = chunk_tokens(path)
            blocks = tokens // block_size
            if blocks.sum() == 0:
                raise BlockTooLong(path, block_size)
            self.orders.append(SourceOrder(blocks, seed, source, shuffle))
        weights = [1.0] * len(paths) if weights is None else [float(w) for w in weights]
        if len(weights) != len(paths) or not all(math.isfinite(w) and w > 0 for w in weights):
            raise InvalidValue(f"one positive, finite weight per data directory ({len(paths)}) expected; got {weights}")
        self.block_size, self.seed, self.weights, self.shuffle = block_size, seed, weights, shuffle
        self.mix = MixOrder(weights, seed)
        self.sources = [source_key(p) for p in self.paths]
        # per source: the seed and source number its order is drawn with, and the samples it gave before this
        # stream began; other than (seed, source, 0) only in a run resumed on other data (the module's docstring)
        self.carried: List[Tuple[int, int, int]] = [(seed, source, 0) for source in range(len(self.paths))]
        # litdata reads the blocks: StreamingDataset[i] is block i in the index's order, whatever the process
        self.datasets = [StreamingDataset(str(p), item_loader=TokensLoader(block_size=block_size), shuffle=False)
                         for p in self.paths]
        self.start, self.rank, self.world_size, self.batch_size = 0, 0, 1, 1
        self.end: Optional[int] = None

    def place(self, start: int, rank: int, world_size: int, batch_size: int, end: Optional[int] = None) -> None:
        """Where the next iteration reads: micro batches of `batch_size` of process `rank` from `start`; with
        `end`, only the positions before it (the last micro batches cut short, or empty for a process whose
        positions all lie past `end`), else forever."""
        self.start, self.rank, self.world_size, self.batch_size, self.end = start, rank, world_size, batch_size, end

    def sample(self, position: int) -> np.ndarray:
        source, k = self.mix.sample(position)
        return self.datasets[source][self.orders[source].block(self.carried[source][2] + k)]

    def carry_on(self, carried: Sequence[Sequence[int]]) -> None:
        """Read each source in the order of (seed, source number) after the samples it gave, as `carried` says."""
        self.carried = [(int(seed), int(number), int(given)) for seed, number, given in carried]
        for source, (seed, number, _) in enumerate(self.carried):
            if (seed, number) != (self.orders[source].seed, self.orders[source].source):
                self.orders[source] = SourceOrder(self.orders[source].blocks, seed, number, self.shuffle)

    def passes(self, positions: int) -> List[float]:
        """How many times over its samples each source is read by the end of the stream's first `positions` positions,
        counting the samples it gave before this stream began: above 1, its samples repeat."""
        given = self.mix.given_before(positions)
        return [(carried + int(n)) / order.total for (_, _, carried), n, order in zip(self.carried, given, self.orders)]

    def describe_carried(self, known_sources) -> str:
        """Where each source starts: after the samples it gave, for the sources among `known_sources` (keys), else at
        its beginning."""
        return "; ".join(
            f"{path} after the {given:,} samples it gave ({order.total:,} in an epoch)" if key in known_sources
            else f"{path} (new) at its beginning"
            for path, key, (_, _, given), order in zip(self.paths, self.sources, self.carried, self.orders)
        )

    def batch_positions(self, t: int) -> range:
        """The positions of this process's t-th micro batch."""
        first = self.start + (t * self.world_size + self.rank) * self.batch_size
        return range(first, first + self.batch_size)

    def __iter__(self):
        # DataLoader workers take the micro batches in turn, and the DataLoader returns them in that order
        worker = torch.utils.data.get_worker_info()
        t, step = (0, 1) if worker is None else (worker.id, worker.num_workers)
        batches = None if self.end is None else micro_batches_per_process(self.end - self.start, self.world_size,
                                                                          self.batch_size)
        while batches is None or t < batches:
            samples = [self.sample(p) for p in self.batch_positions(t) if self.end is None or p < self.end]
            if samples:
                yield torch.from_numpy(np.stack(samples).astype(np.int64))
            else:
                yield torch.empty((0, self.block_size), dtype=torch.int64)
            t += step

    def order_key(self) -> Dict:
        """What fixes the meaning of a position: saved with it, compared on resume."""
        return {
            "seed": self.seed,
            "weights": self.weights,
            "shuffle": self.shuffle,
            "block_size": self.block_size,
            "blocks_per_source": [order.total for order in self.orders],
            "sources": self.sources,
        }


def carried_after(order: Dict, carried: Sequence[Sequence[int]], position: int) -> Dict[str, Tuple[int, int, int]]:
    """source key -> (seed, source number, samples given) of each source at `position` of the stream `order`
    (an `order_key`) whose sources were `carried` into it."""
    given = MixOrder(order["weights"], order["seed"]).given_before(position)
    return {key: (int(carried[i][0]), int(carried[i][1]), int(carried[i][2]) + int(given[i]))
            for i, key in enumerate(order["sources"])}


def repeated_samples_note(stream: SampleStream, steps: int, global_batch_size: int) -> Optional[str]:
    """A line on the sources that a run of `steps` steps of `global_batch_size` samples reads more than once over
    (a small directory in a mix, or a long run), or None: nothing else says that their samples repeat."""
    shares = stream.mix.shares
    repeated = [
        f"{path}{f' ({share:.0%} of the mix)' if len(shares) > 1 else ''} {passes:.1f} times over its {order.total:,} samples"
        for path, share, passes, order in zip(stream.paths, shares, stream.passes(steps * global_batch_size), stream.orders)
        if passes > 1
    ]
    if not repeated:
        return None
    return (f"Note: over its {steps:,} step{'s' * (steps != 1)} of {global_batch_size:,} samples this run reads {'; '.join(repeated)}: "
            f"their samples repeat, epoch after epoch{', each in a new order' if stream.shuffle else ''}")


def micro_batches_per_process(positions: int, world_size: int, batch_size: int) -> int:
    """Micro batches of `batch_size` that each of `world_size` processes, taking them in turn, reads of
    `positions` positions: the same number on every process."""
    return -(-positions // (world_size * batch_size))


def process_place() -> Tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class TrainLoader(DataLoader):
    """The training DataLoader of a `SampleStream`: batches [batch_size, block_size] (int64) of this
    process, forever; `state_dict()` is the next position of the stream, whatever the layout."""

    def __init__(self, stream: SampleStream, batch_size: int, num_workers: int, worker_init_fn=None):
        super().__init__(stream, batch_size=None, num_workers=num_workers, pin_memory=torch.cuda.is_available(),
                         worker_init_fn=worker_init_fn)
        self.micro_batch_size = batch_size
        self.next_position = 0
        # whether load_state_dict may go on from a checkpoint of another sample order (--resume_changes data), and
        # where it then says each source goes on
        self.new_order_allowed = False
        self.new_order_note: Optional[str] = None
        self.rank_and_world: Optional[Tuple[int, int]] = None  # None: torch.distributed's

    def __iter__(self):
        rank, world_size = self.rank_and_world or process_place()
        start = self.next_position
        self.dataset.place(start, rank, world_size, self.micro_batch_size)
        for taken, batch in enumerate(super().__iter__(), 1):
            # every process takes as many batches as the others, so each has the same next position
            self.next_position = start + taken * world_size * self.micro_batch_size
            yield batch

    def state_dict(self) -> Dict:
        return {"format": STATE_FORMAT, "next_position": self.next_position, "order": self.dataset.order_key(),
                "carried": [list(c) for c in self.dataset.carried]}

    def load_state_dict(self, state: Dict) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise InvalidValue(
                "the checkpoint's data position is not a fabric-lin sample stream's; continue from its weights: "
                "fabric-lin convert_pretrained_checkpoint <checkpoint> --output_dir <DIR>, then --initial_checkpoint_dir <DIR>"
            )
        saved, here = state["order"], self.dataset.order_key()
        if saved == here:
            self.dataset.carry_on(state["carried"])
            self.next_position = int(state["next_position"])
            return
        if not self.new_order_allowed:
            changed = [f"{key} is {here[key]} here, {saved.get(key)} in the checkpoint" for key in here if saved.get(key) != here[key]]
            unread = [str(path) for path, key in zip(self.dataset.paths, here["sources"])
                      if key not in saved.get("sources", [])]
            if unread:  # the keys are hashes: name the directories they stand for
                are = "is" if len(unread) == 1 else "are"
                changed.insert(0, f"{', '.join(unread)} {are} not data the checkpoint's run read (another index.json: "
                                  f"prepared again since, or another directory)")
            raise InvalidValue(
                f"the checkpoint's data position is a place in another sample order: {'; '.join(changed)} (blocks_per_source: "
                f"the data directories' sizes in samples of block_size tokens; sources: their index.json). Resume with "
                f"the data and data.seed, data.weights and train.max_seq_length of the checkpoint's hyperparameters.yaml, "
                f"or go on in a new order with --resume_changes data (each source read on after the samples it gave)"
            )
        if saved["block_size"] != here["block_size"]:
            raise InvalidValue(
                f"the checkpoint's data position counts samples of {saved['block_size']} tokens, this run's are "
                f"{here['block_size']} (train.max_seq_length + 1): a new order cannot tell which of them were read"
            )
        # the new stream starts at position 0; each source known to the old one carries on where it stopped
        old = carried_after(saved, state["carried"], int(state["next_position"]))
        self.dataset.carry_on([old.get(key, fresh) for key, fresh in zip(self.dataset.sources, self.dataset.carried)])
        self.next_position = 0
        self.new_order_note = (f"The training data goes on in a new sample order (--resume_changes data); each directory "
                               f"the checkpoint's run read goes on in its own order, none of its samples read again before "
                               f"its epoch ends: {self.dataset.describe_carried(old)}")


class ValidationLoader(DataLoader):
    """The validation DataLoader of one prepared directory, a `SampleStream` of it unshuffled: each of its blocks
    once, in order, in micro batches of `batch_size` that the processes take in turn (`SampleStream.batch_positions`).
    The blocks a validation reads, the first N positions, are so the same whatever the number of processes,
    DataLoader workers or the micro batch size. Every process gets as many batches (`len()`): the last ones may be
    short, or empty for a process with no block left, so that processes whose model gathers its weights in every
    forward pass (FSDP) stay in step."""

    def __init__(self, path: Path, block_size: int, batch_size: int, num_workers: int, worker_init_fn=None):
        stream = SampleStream([path], block_size, seed=0, shuffle=False)  # unshuffled: the seed draws nothing
        super().__init__(stream, batch_size=None, num_workers=num_workers, pin_memory=torch.cuda.is_available(),
                         worker_init_fn=worker_init_fn)
        self.micro_batch_size = batch_size
        self.blocks = stream.orders[0].total  # in the split
        self.rank_and_world: Optional[Tuple[int, int]] = None  # None: torch.distributed's

    def __iter__(self):
        rank, world_size = self.rank_and_world or process_place()
        self.dataset.place(0, rank, world_size, self.micro_batch_size, end=self.blocks)
        yield from super().__iter__()

    def __len__(self) -> int:
        _, world_size = self.rank_and_world or process_place()
        return micro_batches_per_process(self.blocks, world_size, self.micro_batch_size)
