"""Data modules: mixing weights, dataloader resume, validation order, TextFiles; the
training stream on any number of processes, workers and micro batch sizes, resumed from one layout on
another (8 -> 4, 2 -> 1, 1 -> 2 processes) with no sample repeated or skipped, by a checksum per sample; what a
change of order carries on (and refuses across another sequence length), weights that cannot mix. The sample order
itself, position by position: test_sample_order.py."""
import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fabric_lin.data import SlimPajamaStarcoder, TextFiles, TokenChunks, Tokenizer
from fabric_lin.data.train_tokenizer import main as train_tokenizer
from conftest import litdata_blocks
from helpers import cli_error, write_prepared

SEQ = 7  # max_seq_length: blocks of 8 tokens


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """slimpajama tokens are even, starcoder tokens odd: a block tells where it came from."""
    root = tmp_path_factory.mktemp("mix")
    raw = root / "raw"
    raw.mkdir()
    (raw / "a.txt").write_text("\n".join(f"line {i} of some text for a tokenizer" for i in range(500)))
    train_tokenizer(raw, root / "tokenizer", vocab_size=300, num_threads=1)
    tokenizer = Tokenizer(root / "tokenizer")
    rng = np.random.default_rng(0)
    slimpajama = (rng.integers(0, 150, 160_000) * 2).astype(np.uint16)
    starcoder = (rng.integers(0, 150, 100_000) * 2 + 1).astype(np.uint16)
    val = np.arange(8000, dtype=np.uint16) % 300
    write_prepared(root / "data" / "slimpajama" / "train", slimpajama, tokenizer, chunk_size=4000)
    write_prepared(root / "data" / "slimpajama" / "val", val, tokenizer, chunk_size=4000)
    write_prepared(root / "data" / "starcoder", starcoder, tokenizer, chunk_size=4000)
    return {"root": root, "data": root / "data", "tokenizer": tokenizer, "val": val, "slimpajama": slimpajama}


def torch_round_trip(obj):
    """What a checkpoint does to the state: torch.save, then torch.load."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def module(mix, batch_size, num_workers=0, **kwargs):
    data = SlimPajamaStarcoder(data_path=mix["data"], num_workers=num_workers, **kwargs)
    data.connect(mix["tokenizer"], batch_size=batch_size, max_seq_length=SEQ)
    data.setup()
    return data


def text_files(mix, batch_size, num_workers=0, **kwargs):
    """TextFiles over the fixture's two training directories (even and odd tokens), 3 : 1 unless told."""
    kwargs.setdefault("train_weights", [3.0, 1.0])
    data = TextFiles(train_dir=[mix["data"] / "slimpajama" / "train", mix["data"] / "starcoder"], num_workers=num_workers,
                     **kwargs)
    data.connect(mix["tokenizer"], batch_size=batch_size, max_seq_length=SEQ)
    data.setup()
    return data


MODULES = {"SlimPajamaStarcoder": module, "TextFiles": text_files}


@pytest.mark.parametrize("weights,share", [(None, 0.693584), ((3.0, 1.0), 0.75)])
def test_mixing_share_matches_weights(mix, weights, share):
    loader = module(mix, batch_size=100, **({} if weights is None else {"weights": weights})).train_dataloader()
    from_slimpajama = total = 0
    for i, batch in enumerate(loader):
        assert batch.dtype == torch.int64 and batch.shape == (100, SEQ + 1)
        parity = batch % 2
        assert torch.all(parity == parity[:, :1]), "a block mixes the two datasets"
        from_slimpajama += int((parity[:, 0] == 0).sum())
        total += len(batch)
        if total >= 20_000:
            break
    assert total == 20_000
    assert abs(from_slimpajama / total - share) < 0.01, from_slimpajama / total


@pytest.mark.parametrize("weights", [(0.7, 0.0), (0.7, -0.3), (float("nan"), 0.3), (0.5, 0.3, 0.2)])
def test_mix_weights_are_validated(mix, weights):
    with pytest.raises(ValueError, match=r"data.weights must be two positive numbers, the shares of SlimPajama and "
                       r"Starcoder \(default \[0.693584, 0.306416\]\); got \[" + ", ".join(map(str, weights))):
        SlimPajamaStarcoder(data_path=mix["data"], weights=weights)


def test_mix_weights_from_the_command_line(tmp_path, capsys):
    """--data.weights reaches the data module; a bad value stops the run before anything is written."""
    from jsonargparse import ArgumentParser

    from fabric_lin.cli import main as cli_main
    from fabric_lin.data import DataModule
    from fabric_lin.pretrain import setup  # noqa: F401  (enables data module subclasses)

    parser = ArgumentParser()
    parser.add_argument("--data", type=DataModule)
    cfg = parser.parse_args(["--data", "SlimPajamaStarcoder", "--data.weights", "[0.5, 0.5]"])
    assert tuple(parser.instantiate(cfg).data.weights) == (0.5, 0.5)
    assert tuple(SlimPajamaStarcoder().weights) == (0.693584, 0.306416)
    with pytest.raises(SystemExit) as info:
        cli_main(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                  "--data", "SlimPajamaStarcoder", "--data.weights", "[0.5, -1]"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("fabric-lin pretrain: error: data.weights must be two positive numbers") and "got [0.5, -1.0]" in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("weights,share", [([3.0, 1.0], 0.75), ([1, 4], 0.2), (None, 160_000 / 260_000)])
def test_text_files_mix_by_train_weights_or_by_size(mix, weights, share):
    """Two directories (even and odd tokens) mixed by train_weights, or by their token counts (160,000 : 100,000)."""
    iterator = iter(text_files(mix, batch_size=1024, train_weights=weights).train_dataloader())
    even = sum(int((next(iterator)[:, 0] % 2 == 0).sum()) for _ in range(10))
    assert abs(even - 10 * 1024 * share) <= 1, even


def test_text_files_draw_their_order_from_data_seed(mix):
    first = [next(iter(text_files(mix, batch_size=16, seed=seed).train_dataloader())) for seed in (1, 1, 2)]
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])


def test_text_files_one_directory_and_its_validation_in_order(mix, capsys):
    data = TextFiles(train_dir=mix["data"] / "starcoder", val_dir=mix["data"] / "slimpajama" / "val", num_workers=0)
    data.connect(mix["tokenizer"], batch_size=10, max_seq_length=SEQ)
    data.setup()
    assert all(torch.all(b % 2 == 1) for _, b in zip(range(20), data.train_dataloader()))
    tokens = torch.cat([b.flatten() for b in data.val_dataloader()]).numpy()
    assert np.array_equal(tokens, mix["val"].astype(np.int64))
    out = capsys.readouterr().out
    assert "no validation" not in out and "Warning" not in out


def test_text_files_validating_on_a_training_directory_says_so(mix, capsys):
    train = mix["data"] / "starcoder"
    for val_dir in (train, train / ".." / "starcoder"):  # the same directory, however written
        data = TextFiles(train_dir=[mix["data"] / "slimpajama" / "train", train], val_dir=val_dir, num_workers=0)
        data.connect(mix["tokenizer"], batch_size=10, max_seq_length=SEQ)
        data.setup()
        assert (f"Warning: data.val_dir {val_dir} is also data.train_dir: the validation loss is measured on training "
                "data") in capsys.readouterr().out


def test_text_files_without_a_validation_directory_says_so_once(mix, capsys, monkeypatch):
    from lightning_fabric.utilities.rank_zero import rank_zero_only

    data = text_files(mix, batch_size=2, val_dir=None)
    assert data.val_dataloader() is None
    assert next(iter(data.train_dataloader())).shape == (2, SEQ + 1)
    out = capsys.readouterr().out
    assert out.count("TextFiles: no validation: data.val_dir is not set") == 1, out
    monkeypatch.setattr(rank_zero_only, "rank", 1)  # the other processes of a run say nothing
    text_files(mix, batch_size=2)
    assert "no validation" not in capsys.readouterr().out


def test_text_files_val_dir_that_does_not_exist_is_an_error(mix, tmp_path, capsys):
    """A typo in data.val_dir names the path; it does not turn validation off."""
    with pytest.raises(FileNotFoundError, match=rf"^data.val_dir {tmp_path / 'vall'} does not exist: .* leave data.val_dir out"):
        text_files(mix, batch_size=2, val_dir=tmp_path / "vall")
    assert "no validation" not in capsys.readouterr().out


def test_text_files_errors_name_the_setting(mix, tmp_path):
    two = [mix["data"] / "slimpajama" / "train", mix["data"] / "starcoder"]
    for weights in ([1.0], [1.0, 0.0], [1.0, float("nan")], [1, 2, 3]):
        with pytest.raises(ValueError, match=r"data.train_weights must be one positive number per data.train_dir \(2: "
                           rf".*slimpajama/train, .*starcoder\); got \[{', '.join(map(str, weights))}\]"):
            TextFiles(train_dir=two, train_weights=weights)
    with pytest.raises(ValueError, match="TextFiles was given no directory: data.train_dir"):
        TextFiles().setup()
    validation_only = TextFiles(val_dir=mix["data"] / "slimpajama" / "val", num_workers=0)  # what evaluate reads
    validation_only.connect(mix["tokenizer"], batch_size=1, max_seq_length=SEQ)
    validation_only.setup()
    assert next(iter(validation_only.val_dataloader())).shape == (1, SEQ + 1)
    with pytest.raises(ValueError, match="TextFiles needs data.train_dir"):  # what pretrain reads
        validation_only.train_dataloader()
    data = TextFiles(train_dir=[two[0], tmp_path / "nowhere"])
    data.connect(mix["tokenizer"], batch_size=1, max_seq_length=SEQ)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        data.setup()


def test_a_training_directory_listed_twice_is_refused_naming_it(mix, tmp_path):
    """The same directory twice, under a second path (a link) or copied: each entry would be a source read in an order of
    its own, its samples repeating within an epoch; the error names both entries and data.train_weights. evaluate,
    which reads the run's val_dir alone (setup_validation), still sets such a module up."""
    import shutil

    train = mix["data"] / "starcoder"
    (tmp_path / "link").symlink_to(train)
    copy = shutil.copytree(train, tmp_path / "copy")
    other = mix["data"] / "slimpajama" / "train"
    for second, said in ((train, f"{train} twice"), (tmp_path / "link", f"{train} and {tmp_path / 'link'}, one directory"),
                         (copy, f"{train} and {copy}, one data set (their index.json is the same)")):
        data = TextFiles(train_dir=[train, other, second], val_dir=mix["data"] / "slimpajama" / "val", num_workers=0)
        data.connect(mix["tokenizer"], batch_size=2, max_seq_length=SEQ)
        data.setup_validation()
        assert next(iter(data.val_dataloader())).shape == (2, SEQ + 1)
        with pytest.raises(ValueError, match=rf"^data.train_dir lists {re.escape(said)}: each listed directory is read as a "
                           r"source of its own, .* give it a larger share with data.train_weights$"):
            data.setup()


def test_an_empty_directory_in_a_mix_by_size_is_named(mix, tmp_path):
    """A prepared directory whose index lists no chunk file, mixed by size (no train_weights): the error names it, not
    the zero weight its size would make."""
    import json
    import shutil

    empty = shutil.copytree(mix["data"] / "starcoder", tmp_path / "empty", ignore=shutil.ignore_patterns("chunk-*"))
    index = json.loads((empty / "index.json").read_text())
    (empty / "index.json").write_text(json.dumps({**index, "chunks": []}))
    data = TextFiles(train_dir=[mix["data"] / "slimpajama" / "train", empty], num_workers=0)
    data.connect(mix["tokenizer"], batch_size=2, max_seq_length=SEQ)
    data.setup()
    with pytest.raises(ValueError, match=rf"^{empty} holds no tokens \(0 chunk files in its index.json\): prepare it again"):
        data.train_dataloader()


def test_text_files_from_the_command_line_and_a_recipe(tmp_path):
    """--data TextFiles takes one directory or a list; over a config_hub recipe (SlimPajamaStarcoder's data
    block) it keeps none of that module's weights."""
    from jsonargparse import ArgumentParser

    from fabric_lin.pretrain import setup

    parser = ArgumentParser(exit_on_error=False)
    parser.add_function_arguments(setup)
    parser.add_argument("--config", action="config")
    data = parser.instantiate(parser.parse_args(
        ["--data", "TextFiles", "--data.train_dir", "[a/train, b/train]", "--data.train_weights", "[1, 2]", "--data.val_dir", "a/val"]
    )).data
    assert data == TextFiles(train_dir=[Path("a/train"), Path("b/train")], train_weights=[1.0, 2.0], val_dir=Path("a/val"))
    recipe = Path(__file__).resolve().parents[1] / "config_hub" / "gdn_340M.yaml"
    data = parser.instantiate(parser.parse_args(["--config", str(recipe), "--data", "TextFiles", "--data.train_dir", "x/train"])).data
    assert isinstance(data, TextFiles) and data.train_dirs == [Path("x/train")] and data.train_weights is None


def test_use_starcoder_false_reads_slimpajama_only(mix):
    loader = module(mix, batch_size=50, use_starcoder=False).train_dataloader()
    batches = [b for _, b in zip(range(20), loader)]
    assert all(torch.all(b % 2 == 0) for b in batches)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["SlimPajamaStarcoder", "TokenChunks", "TextFiles"])
def test_resume_continues_with_the_next_batch(mix, kind, num_workers):
    def make_loader():
        if kind == "TokenChunks":
            data = TokenChunks(data_path=mix["data"] / "starcoder", num_workers=num_workers)
            data.connect(mix["tokenizer"], batch_size=4, max_seq_length=SEQ)
            data.setup()
            return data.train_dataloader()
        return MODULES[kind](mix, batch_size=4, num_workers=num_workers).train_dataloader()

    for consumed in (1, 6, 11):
        loader = make_loader()
        iterator = iter(loader)
        for _ in range(consumed):
            next(iterator)
        state = loader.state_dict()
        expected = [next(iterator) for _ in range(4)]
        del iterator

        resumed = make_loader()
        resumed.load_state_dict(torch_round_trip(state))
        got = [b for _, b in zip(range(4), resumed)]
        assert len(got) == 4
        for a, b in zip(expected, got):
            assert torch.equal(a, b), f"resumed after {consumed} batches"
    # a fresh loader starts elsewhere, so the comparison above tells resumed from restarted
    assert not torch.equal(next(iter(make_loader())), expected[0])


# ---- the training stream on any layout


def sample_ids(batches) -> list:
    """A checksum per sample: its bytes (random tokens, so every block of the fixture's data is unique)."""
    return [bytes(row.numpy()) for batch in batches for row in batch]


class Layout:
    """The training loaders of the `world_size` processes of one layout, each read through one iterator
    as the training loop does; started at the position of `state` (rank 0's loader state) when given."""

    def __init__(self, mix, world_size: int, batch_size: int, num_workers: int = 0, state=None, make=module):
        self.loaders = []
        for rank in range(world_size):
            loader = make(mix, batch_size=batch_size, num_workers=num_workers).train_dataloader()
            loader.rank_and_world = (rank, world_size)
            if state is not None:
                loader.load_state_dict(torch_round_trip(state))
            self.loaders.append(loader)
        self.iterators = [iter(loader) for loader in self.loaders]
        self.batch_size = batch_size

    def take_steps(self, steps: int, global_batch: int):
        """What `steps` optimizer steps of `global_batch` samples read: per step, the samples of every
        micro batch of every process."""
        accumulation = global_batch // (len(self.loaders) * self.batch_size)
        return [sample_ids(next(it) for _ in range(accumulation) for it in self.iterators) for _ in range(steps)]


def test_an_epoch_of_a_source_reads_each_of_its_blocks_once(mix, capsys):
    data = TokenChunks(data_path=mix["data"] / "starcoder", num_workers=0)
    data.connect(mix["tokenizer"], batch_size=100, max_seq_length=SEQ)
    data.setup()
    assert "TokenChunks: no validation: data.val_path is not set" in capsys.readouterr().out  # eval.* would do nothing
    blocks = litdata_blocks(mix["data"] / "starcoder", SEQ + 1)
    assert len(blocks) == 12_500 and len(set(blocks)) == len(blocks)
    iterator = iter(data.train_dataloader())
    first, second = (sample_ids(next(iterator) for _ in range(125)) for _ in range(2))
    assert sorted(first) == sorted(blocks) and sorted(second) == sorted(blocks)
    assert first != second and first != blocks  # shuffled, and differently in each epoch


def test_each_group_of_1024_samples_holds_the_shares_exactly(mix):
    iterator = iter(module(mix, batch_size=1024).train_dataloader())
    given = 0
    for group in range(1, 40):  # more than an epoch of slimpajama (20,000 blocks)
        given += int((next(iterator)[:, 0] % 2 == 0).sum())
        assert abs(given - group * 1024 * 0.693584) < 1, group


@pytest.mark.parametrize("world_size,batch_size,num_workers", [(2, 4, 0), (4, 2, 2), (8, 1, 0)])
def test_the_stream_is_the_same_on_any_layout(mix, world_size, batch_size, num_workers):
    one_process = Layout(mix, 1, 8).take_steps(5, global_batch=16)
    assert Layout(mix, world_size, batch_size, num_workers).take_steps(5, global_batch=16) == one_process


@pytest.mark.parametrize("kind", ["SlimPajamaStarcoder", "TextFiles"])
@pytest.mark.parametrize("before,after", [((8, 2, 0), (4, 1, 2)), ((2, 2, 1), (1, 4, 0)), ((1, 4, 0), (2, 1, 2))],
                         ids=["8->4", "2->1", "1->2"])
def test_resumed_on_another_layout_no_sample_is_repeated_or_skipped(mix, before, after, kind):
    """(processes, micro batch size, workers) before and after the checkpoint, 32 samples a step."""
    make = MODULES[kind]
    uninterrupted = Layout(mix, 1, 8, make=make).take_steps(30, global_batch=32)
    first = Layout(mix, *before, make=make)
    seen = first.take_steps(12, global_batch=32)
    states = [loader.state_dict() for loader in first.loaders]
    assert all(state == states[0] for state in states)  # the position is the same on every process
    seen += Layout(mix, *after, state=states[0], make=make).take_steps(18, global_batch=32)  # rank 0's state, as Fabric saves it
    assert [sorted(step) for step in seen] == [sorted(step) for step in uninterrupted]
    consumed = [sample for step in seen for sample in step]
    # 960 samples: within one epoch of both sources, so no sample may appear twice
    assert len(consumed) == 960 and len(set(consumed)) == 960


def test_resuming_in_another_sample_order_is_refused(mix):
    state = module(mix, batch_size=4).train_dataloader().state_dict()
    with pytest.raises(ValueError, match=r"another sample order: seed is 7 here, 42 in the checkpoint; weights is \[0.5, 0.5\] "
                       r"here, \[0.693584, 0.306416\] in the checkpoint.* or go on in a new order with --resume_changes data"):
        module(mix, batch_size=4, seed=7, weights=(0.5, 0.5)).train_dataloader().load_state_dict(state)
    litdata_state = {"dataset": {}, "current_epoch": 1, "num_samples_yielded": [8], "latest_worker_idx": 0}
    with pytest.raises(ValueError, match=r"^the checkpoint's data position is not a fabric-lin sample stream's"):
        module(mix, batch_size=4).train_dataloader().load_state_dict(litdata_state)


def test_a_moved_data_directory_resumes_in_place_and_another_shuffle_is_refused(mix, tmp_path):
    """A source is known by its index.json wherever it lies (data moved to another file system between two
    attempts); the same directory read in another order (data.shuffle) is another sample order, and a directory of
    other data is named (the sample order's keys of the sources are hashes)."""
    import shutil

    def loader(path, **kwargs):
        data = TokenChunks(data_path=path, num_workers=0, **kwargs)
        data.connect(mix["tokenizer"], batch_size=4, max_seq_length=SEQ)
        data.setup()
        return data.train_dataloader()

    first = loader(mix["data"] / "starcoder")
    batches = iter(first)
    next(batches)
    state = torch_round_trip(first.state_dict())
    moved = loader(shutil.copytree(mix["data"] / "starcoder", tmp_path / "moved"))
    moved.load_state_dict(state)
    assert torch.equal(next(iter(moved)), next(batches))
    with pytest.raises(ValueError, match="another sample order: shuffle is False here, True in the checkpoint"):
        loader(mix["data"] / "starcoder", shuffle=False).load_state_dict(state)
    # data prepared again in its place (here: other data), whose index.json is all that the checkpoint knows it by
    other = mix["data"] / "slimpajama" / "train"
    with pytest.raises(ValueError, match=f"another sample order: {other} is not data the checkpoint's run read "
                                         r"\(another index.json: prepared again since, or another directory\); "):
        loader(other).load_state_dict(state)


def test_a_new_mix_allowed_on_resume_reads_each_source_on_after_what_it_gave(mix):
    """--resume_changes data: the new stream (other weights and seed) starts at its position 0, and each
    source carries on after the samples it gave before, so no sample is read twice."""
    first = iter(module(mix, batch_size=16).train_dataloader())
    loader = module(mix, batch_size=16).train_dataloader()
    iterator = iter(loader)
    before = sample_ids(next(iterator) for _ in range(15))  # 240 samples of the default mix
    assert before == sample_ids(next(first) for _ in range(15))
    state = torch_round_trip(loader.state_dict())

    changed = module(mix, batch_size=16, seed=7, weights=(0.5, 0.5)).train_dataloader()
    with pytest.raises(ValueError, match="another sample order"):
        changed.load_state_dict(state)
    changed.new_order_allowed = True
    changed.load_state_dict(state)
    assert changed.next_position == 0
    after = [b for _, b in zip(range(64), changed)]  # a mixing group of 1,024 samples: half from each source
    assert sum(int((b[:, 0] % 2 == 0).sum()) for b in after) == 512
    # every block of the fixture's data is unique, and both runs stay inside one epoch of each source
    consumed = before + sample_ids(after)
    assert len(set(consumed)) == len(consumed) == 1264
    # and the state it saves carries the offsets on to the next resume
    again = module(mix, batch_size=16, seed=7, weights=(0.5, 0.5)).train_dataloader()
    again.load_state_dict(torch_round_trip(changed.state_dict()))
    assert again.dataset.carried == changed.dataset.carried != [(7, 0, 0), (7, 1, 0)]
    assert torch.equal(next(iter(again)), next(iter(changed)))


def test_a_new_order_says_where_each_directory_goes_on(mix):
    """--resume_changes data from SlimPajama alone to SlimPajama and Starcoder: the loader says that SlimPajama goes on
    after the 240 samples it gave (of its 20,000 blocks of 8 tokens) and that Starcoder, new, starts at its beginning.
    A resume in the same order says nothing."""
    slimpajama, starcoder = mix["data"] / "slimpajama" / "train", mix["data"] / "starcoder"

    def loader(train_dir):
        data = TextFiles(train_dir=train_dir, num_workers=0)
        data.connect(mix["tokenizer"], batch_size=16, max_seq_length=SEQ)
        data.setup()
        return data.train_dataloader()

    first = loader([slimpajama])
    batches = iter(first)
    for _ in range(15):
        next(batches)
    state = torch_round_trip(first.state_dict())
    same = loader([slimpajama])
    same.load_state_dict(state)
    assert same.new_order_note is None
    mixed = loader([slimpajama, starcoder])
    mixed.new_order_allowed = True
    mixed.load_state_dict(state)
    assert mixed.new_order_note == (
        "The training data goes on in a new sample order (--resume_changes data); each directory the checkpoint's run "
        "read goes on in its own order, none of its samples read again before its epoch ends: "
        f"{slimpajama} after the 240 samples it gave (20,000 in an epoch); {starcoder} (new) at its beginning")
    assert mixed.dataset.carried == [(42, 0, 240), (42, 1, 0)]  # (seed, source number, samples given) of each


def test_a_new_order_that_lists_the_directories_otherwise_reads_each_on_in_its_own_order(mix):
    """--resume_changes data with the two directories swapped: each is known by its index.json, not by its place in
    the list, and reads on after the samples it gave in the order it was read in, so none is read twice."""
    slimpajama, starcoder = mix["data"] / "slimpajama" / "train", mix["data"] / "starcoder"

    def loader(train_dir, weights):
        data = TextFiles(train_dir=train_dir, train_weights=weights, num_workers=0)
        data.connect(mix["tokenizer"], batch_size=16, max_seq_length=SEQ)
        data.setup()
        return data.train_dataloader()

    first = loader([slimpajama, starcoder], [1.0, 1.0])
    batches = iter(first)
    before = sample_ids(next(batches) for _ in range(15))
    swapped = loader([starcoder, slimpajama], [3.0, 1.0])
    swapped.new_order_allowed = True
    swapped.load_state_dict(torch_round_trip(first.state_dict()))
    given = first.dataset.mix.given_before(240).tolist()  # slimpajama's and starcoder's samples before position 240
    assert swapped.dataset.carried == [(42, 1, given[1]), (42, 0, given[0])]
    for new, old in ((0, 1), (1, 0)):  # each source's order goes on as the first run would have read it
        ks = range(given[old], given[old] + 1000)
        assert [swapped.dataset.orders[new].block(k) for k in ks] == [first.dataset.orders[old].block(k) for k in ks]
    after = sample_ids(b for _, b in zip(range(64), swapped))
    assert len(set(before + after)) == len(before + after) == 240 + 1024


def test_a_resume_on_directories_the_checkpoint_never_read_names_them_all(mix):
    slimpajama, starcoder = mix["data"] / "slimpajama" / "train", mix["data"] / "starcoder"
    data = TokenChunks(data_path=mix["data"] / "slimpajama" / "val", num_workers=0)
    data.connect(mix["tokenizer"], batch_size=4, max_seq_length=SEQ)
    data.setup()
    state = torch_round_trip(data.train_dataloader().state_dict())
    with pytest.raises(ValueError, match=f"another sample order: {slimpajama}, {starcoder} are not data the checkpoint's "
                                         r"run read \(another index.json"):
        text_files(mix, batch_size=4).train_dataloader().load_state_dict(state)


def test_a_new_order_of_another_sequence_length_is_refused(mix):
    """Positions of 8-token samples say nothing of which 16-token samples were read: --resume_changes data does not
    carry the sources on across another train.max_seq_length."""
    state = torch_round_trip(module(mix, batch_size=4).train_dataloader().state_dict())
    data = SlimPajamaStarcoder(data_path=mix["data"], num_workers=0)
    data.connect(mix["tokenizer"], batch_size=4, max_seq_length=2 * SEQ + 1)
    data.setup()
    longer = data.train_dataloader()
    longer.new_order_allowed = True
    with pytest.raises(ValueError, match=r"the checkpoint's data position counts samples of 8 tokens, this run's are 16"):
        longer.load_state_dict(state)


@pytest.mark.parametrize("weights", [[1.0, 0.0], [1.0], [1.0, float("inf")]])
def test_the_sample_stream_refuses_weights_that_cannot_mix(mix, weights):
    """Named in one line (a zero weight let through would double the mixing group until an OverflowError)."""
    from fabric_lin.data.sample_order import SampleStream

    with pytest.raises(ValueError, match=r"one positive, finite weight per data directory \(2\) expected"):
        SampleStream([mix["data"] / "slimpajama" / "train", mix["data"] / "starcoder"], SEQ + 1, 42, weights)


def test_a_run_that_reads_a_source_more_than_once_says_so(mix):
    """64,000 samples at 3 : 1 draw 48,000 from SlimPajama's 20,000 blocks (2.4 times over) and 16,000 from
    Starcoder's 12,500 (1.3 times); 10,240 samples read each less than once over: nothing to say."""
    from fabric_lin.data.sample_order import repeated_samples_note

    stream = text_files(mix, batch_size=4).train_dataloader().dataset
    assert repeated_samples_note(stream, 1000, 64) == (
        f"Note: over its 1,000 steps of 64 samples this run reads {mix['data'] / 'slimpajama' / 'train'} (75% of the mix) "
        f"2.4 times over its 20,000 samples; {mix['data'] / 'starcoder'} (25% of the mix) 1.3 times over its 12,500 "
        "samples: their samples repeat, epoch after epoch, each in a new order")
    assert repeated_samples_note(stream, 160, 64) is None


def test_a_source_read_exactly_once_over_is_not_said_to_repeat(mix):
    """One unshuffled directory of 12,500 samples: read once over, nothing to say; read twice over in one step, the
    note says so without a share of a mix or a new order each epoch."""
    from fabric_lin.data.sample_order import SampleStream, repeated_samples_note

    path = mix["data"] / "starcoder"
    stream = SampleStream([path], SEQ + 1, seed=0, shuffle=False)
    assert stream.orders[0].total == 12_500
    assert repeated_samples_note(stream, 125, 100) is None
    assert repeated_samples_note(stream, 1, 25_000) == (
        f"Note: over its 1 step of 25,000 samples this run reads {path} 2.0 times over its 12,500 samples: their samples "
        "repeat, epoch after epoch")


def test_an_unshuffled_stream_of_blocks_that_do_not_divide_its_chunk_files_is_litdata_s(mix):
    """Blocks of 7 tokens in chunk files of 4,000: each file's last 3 tokens are in no block (litdata's TokensLoader cuts
    a block inside one file). Unshuffled, the stream is litdata's blocks in order, across files, and an epoch has as many;
    a source carried in after 100 samples is read that much further."""
    from fabric_lin.data.sample_order import SampleStream

    path = mix["data"] / "starcoder"
    blocks = litdata_blocks(path, 7)
    stream = SampleStream([path], 7, seed=0, shuffle=False)
    assert stream.orders[0].total == len(blocks)
    assert [bytes(np.asarray(stream.sample(p)).astype(np.int64)) for p in range(1200)] == blocks[:1200]
    stream.carry_on([(0, 0, 100)])
    assert stream.passes(len(blocks)) == [pytest.approx((len(blocks) + 100) / len(blocks))]


def test_val_dataloader_is_in_order(mix):
    loader = module(mix, batch_size=10).val_dataloader()
    tokens = torch.cat([b.flatten() for b in loader]).numpy()
    # chunks of 4000 tokens hold 500 blocks of 8, so every token is used, in order
    assert np.array_equal(tokens, mix["val"].astype(np.int64))


@pytest.mark.parametrize("world_size,batch_size,num_workers", [(1, 64, 0), (3, 7, 2), (4, 1, 0)])
def test_validation_reads_each_block_once_by_position_on_any_layout(mix, world_size, batch_size, num_workers):
    """The validation loaders of all the processes together: position p (process `rank`'s micro batch t holds
    positions (t * world_size + rank) * batch_size + [0, batch_size)) is block p of litdata's own reading of the split,
    each of the 1,000 blocks once; every process gets as many batches, the last ones short or empty."""
    import math

    from fabric_lin.data.base import token_val_loader

    path = mix["data"] / "slimpajama" / "val"
    blocks = litdata_blocks(path, SEQ + 1)
    read = {}
    for rank in range(world_size):
        loader = token_val_loader(path, SEQ + 1, batch_size, num_workers)
        loader.rank_and_world = (rank, world_size)
        batches = list(loader)
        assert len(batches) == len(loader) == math.ceil(len(blocks) / (world_size * batch_size))
        for t, batch in enumerate(batches):
            assert batch.dtype == torch.int64 and batch.shape[1] == SEQ + 1 and len(batch) <= batch_size
            for j, row in enumerate(batch):
                position = (t * world_size + rank) * batch_size + j
                assert position not in read
                read[position] = bytes(row.numpy())
    assert [read.get(p) for p in range(len(blocks))] == blocks and len(read) == len(blocks)


def test_validation_false_needs_no_val_split(mix, tmp_path):
    # a copy of the data without slimpajama/val: setup refuses it unless validation is off
    import shutil

    data_path = tmp_path / "data"
    shutil.copytree(mix["data"], data_path)
    shutil.rmtree(data_path / "slimpajama" / "val")
    with_validation = SlimPajamaStarcoder(data_path=data_path, num_workers=0)
    with_validation.connect(mix["tokenizer"], batch_size=2, max_seq_length=SEQ)
    with pytest.raises(FileNotFoundError, match="val"):
        with_validation.setup()
    data = SlimPajamaStarcoder(data_path=data_path, num_workers=0, validation=False)
    data.connect(mix["tokenizer"], batch_size=2, max_seq_length=SEQ)
    data.setup()
    assert data.val_dataloader() is None
    assert next(iter(data.train_dataloader())).shape == (2, SEQ + 1)


def test_the_validation_split_alone_is_set_up_without_the_training_directories(mix, tmp_path):
    """evaluate reads slimpajama/val alone (setup_validation): a data_path holding only it is read, its blocks those of
    the prepared tokens; one without it names it. pretrain's setup still needs the training directories."""
    import shutil

    data_path = tmp_path / "data"
    shutil.copytree(mix["data"] / "slimpajama" / "val", data_path / "slimpajama" / "val")
    data = SlimPajamaStarcoder(data_path=data_path, num_workers=0)
    data.connect(mix["tokenizer"], batch_size=2, max_seq_length=SEQ)
    data.setup_validation()
    first = next(iter(data.val_dataloader()))
    assert first.tolist() == mix["val"][: 2 * (SEQ + 1)].reshape(2, SEQ + 1).tolist()
    with pytest.raises(FileNotFoundError, match="holds no slimpajama/train"):
        data.setup()
    nowhere = SlimPajamaStarcoder(data_path=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError) as info:
        nowhere.setup_validation()
    assert str(info.value) == (
        f"data.data_path {tmp_path / 'nowhere'} holds no slimpajama/val ({tmp_path / 'nowhere' / 'slimpajama' / 'val'} "
        "does not exist): expected slimpajama/val under it; it is the --output_dir of prepare_slimpajama run on "
        "SlimPajama's validation files")


def test_a_data_module_given_no_directory_names_its_training_and_its_validation_key():
    """Given no directory at all, the error names both keys: pretrain needs the training one, evaluate (which reads the
    validation split alone, tutorials/evaluate.md) the validation one, so naming the training key alone sends the
    user of `evaluate --data TokenChunks` to the wrong one."""
    with pytest.raises(ValueError, match=r"^TokenChunks was given no directory: data\.data_path \(to train on\) or "
                                         r"data\.val_path \(to validate on; all that evaluate reads\)"):
        TokenChunks().setup()
    with pytest.raises(ValueError, match=r"^TextFiles was given no directory: data\.train_dir \(to train on\) or "
                                         r"data\.val_dir \(to validate on; all that evaluate reads\)"):
        TextFiles().setup()


def test_a_slimpajama_starcoder_directory_not_there_names_data_path_and_its_layout(mix, tmp_path):
    """The directories SlimPajamaStarcoder reads lie at fixed places under data.data_path: one missing is named with that
    key and the layout expected, and a data_path given as one of the directories inside it (data/slimpajama, as
    prepare_slimpajama's --output_dir was given) is answered with the one meant. Both said only that the directory
    does not exist and to run a preprocessor."""
    layout = "expected slimpajama/train, slimpajama/val, starcoder under it"
    for given in (mix["data"] / "slimpajama", mix["data"] / "slimpajama" / "train"):
        data = SlimPajamaStarcoder(data_path=given)
        with pytest.raises(FileNotFoundError) as info:
            data.setup()
        assert str(info.value) == (f"data.data_path {given} holds no slimpajama/train ({given / 'slimpajama' / 'train'} "
                                   f"does not exist): {layout}: did you mean --data.data_path {mix['data']}?")
    data = SlimPajamaStarcoder(data_path=tmp_path / "nowhere", use_starcoder=False)
    with pytest.raises(FileNotFoundError) as info:
        data.setup()
    assert str(info.value) == (
        f"data.data_path {tmp_path / 'nowhere'} holds no slimpajama/train ({tmp_path / 'nowhere' / 'slimpajama' / 'train'} "
        "does not exist): expected slimpajama/train, slimpajama/val under it; each is the --output_dir of "
        "prepare_slimpajama or prepare_starcoder (data.use_starcoder false: no starcoder, data.validation false: no "
        "slimpajama/val)")


def test_setup_errors_name_the_directory(mix, tmp_path):
    data = SlimPajamaStarcoder(data_path=tmp_path / "nowhere")
    data.connect(mix["tokenizer"], batch_size=1, max_seq_length=SEQ)
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere" / "slimpajama" / "train")):
        data.setup()
    with pytest.raises(ValueError, match="TokenChunks was given no directory: data.data_path"):
        TokenChunks().setup()
    unconnected = SlimPajamaStarcoder(data_path=mix["data"], num_workers=0)
    with pytest.raises(ValueError, match="max_seq_length"):
        unconnected.train_dataloader()


def test_a_negative_worker_count_or_seed_is_named():
    with pytest.raises(ValueError, match=r"^data.num_workers must be 0 \(load in the training process\) or a positive "
                                         r"number of DataLoader worker processes per rank, got -1$"):
        TokenChunks(num_workers=-1).validate()
    with pytest.raises(ValueError, match=r"^data.seed must be a non-negative integer \(it seeds the data order\), got -1$"):
        TokenChunks(seed=-1).validate()


def test_a_negative_seed_stops_pretrain_in_one_line_before_anything_is_written(tmp_path, capsys):
    """The data module's validate() is where data.seed is checked, before the data or the model is loaded."""
    err = cli_error(["pretrain", "--model_name", "gla-debug", "--out_dir", str(tmp_path / "out"), "--train.max_steps", "1",
                     "--data", "SampleCorpus", "--data.seed", "-1"], capsys)
    assert err == "fabric-lin pretrain: error: data.seed must be a non-negative integer (it seeds the data order), got -1\n"
    assert not (tmp_path / "out").exists()


def test_dataloader_workers_leave_the_stop_signals_to_the_trainer(mix):
    """Ctrl-C and a scheduler's SIGTERM reach the DataLoader workers too; a worker that ended on one would fail the batch
    the trainer needs for the step it stops at with a checkpoint. Each worker starts by ignoring them."""
    import signal

    from fabric_lin.data.base import leave_stop_signals_to_the_trainer
    from fabric_lin.stopping import STOP_SIGNALS

    before = {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS}
    try:
        leave_stop_signals_to_the_trainer(worker_id=0)
        assert {name: signal.getsignal(getattr(signal, name)) for name in STOP_SIGNALS} == dict.fromkeys(STOP_SIGNALS,
                                                                                                          signal.SIG_IGN)
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
    data = TokenChunks(data_path=mix["data"] / "starcoder", val_path=mix["data"] / "slimpajama" / "val", num_workers=2)
    data.connect(mix["tokenizer"], batch_size=4, max_seq_length=SEQ)
    data.setup()
    assert data.train_dataloader().worker_init_fn is data.val_dataloader().worker_init_fn is leave_stop_signals_to_the_trainer


@pytest.mark.parametrize("kind", ["SlimPajamaStarcoder", "TextFiles", "TokenChunks"])
def test_from_setup_on_each_prepared_json_is_read_once(mix, kind, prepared_json_reads):
    """pretrain's use of a data module once its tokenizer is chosen: setup() checks every directory, then the run
    records the tokenizer its checkpoints are trained with and builds its loaders. Only setup() reads each directory's
    prepared.json; what comes after takes what it read."""
    from fabric_lin.run_start import training_data_tokenizer

    data_dir = mix["data"]
    data = {"SlimPajamaStarcoder": SlimPajamaStarcoder(data_path=data_dir, num_workers=0),
            "TextFiles": TextFiles(train_dir=[data_dir / "slimpajama" / "train", data_dir / "starcoder"],
                                   val_dir=data_dir / "slimpajama" / "val", num_workers=0),
            "TokenChunks": TokenChunks(data_path=data_dir / "starcoder", val_path=data_dir / "slimpajama" / "val",
                                       num_workers=0)}[kind]
    data.connect(mix["tokenizer"], batch_size=2, max_seq_length=SEQ)
    data.setup()
    trained_with = training_data_tokenizer(data, mix["tokenizer"])
    next(iter(data.train_dataloader()))
    next(iter(data.val_dataloader()))
    assert trained_with == {"tokenizer": mix["tokenizer"].record()}
    assert dict(prepared_json_reads) == {path: 1 for path in data.prepared_dirs()}
