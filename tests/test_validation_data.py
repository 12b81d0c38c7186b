"""Validation data that the run's training data holds, in any data module: the same directory, a copy of it, another
preparation of the same input, or one of an input inside the other's (read recursively). Each is said once at
start-up, naming both directories: the validation loss would be measured on documents the model trains on. Data of
other inputs, and prepare_text's train/ and val/ of one preparation (or of one input read with two globs), say nothing;
its two splits given for each other are said."""
import shutil

import numpy as np
import pytest

from fabric_lin.data import SlimPajamaStarcoder, TextFiles, TokenChunks, Tokenizer
from fabric_lin.data.train_tokenizer import main as train_tokenizer
from helpers import write_prepared

SEQ = 7
HINT = "(prepare_text's --val_fraction holds documents out into OUT/val)"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    raw = tmp_path_factory.mktemp("raw")
    (raw / "a.txt").write_text("\n".join(f"line {i} of some text for a tokenizer" for i in range(500)))
    train_tokenizer(raw, raw / "tokenizer", vocab_size=300, num_threads=1)
    return Tokenizer(raw / "tokenizer")


def prepared(path, tokenizer, seed, **fields):
    tokens = np.random.default_rng(seed).integers(0, 300, 4000).astype(np.uint16)
    write_prepared(path, tokens, tokenizer, chunk_size=4000, **fields)
    return path


def set_up(data, tokenizer, capsys) -> str:
    capsys.readouterr()
    data.connect(tokenizer, batch_size=2, max_seq_length=SEQ)
    data.setup()
    return capsys.readouterr().out


def slimpajama_layout(root, tokenizer, train_input, val_input):
    """data_path of SlimPajamaStarcoder, its three directories prepared by the slimpajama and starcoder recipes from
    the raw directories named."""
    prepared(root / "slimpajama" / "train", tokenizer, 0, recipe="slimpajama", input_dir=str(train_input))
    prepared(root / "slimpajama" / "val", tokenizer, 1, recipe="slimpajama", input_dir=str(val_input))
    prepared(root / "starcoder", tokenizer, 2, recipe="starcoder", input_dir="/raw/starcoderdata")
    return root


def test_a_copy_of_the_training_directory_given_for_validation_is_said(tmp_path, tokenizer, capsys):
    """A copy has other paths: only a val_dir equal to a train_dir was said."""
    train = prepared(tmp_path / "train", tokenizer, 0)
    shutil.copytree(train, tmp_path / "copy")
    out = set_up(TextFiles(train_dir=train, val_dir=tmp_path / "copy", num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: data.val_dir {tmp_path / 'copy'} holds documents that data.train_dir {train} trains on: "
                   f"their index.json is the same, one data set: the validation loss is measured on training data {HINT}\n")
    out = set_up(TokenChunks(data_path=train, val_path=tmp_path / "copy", num_workers=0), tokenizer, capsys)
    assert out.startswith(f"Warning: data.val_path {tmp_path / 'copy'} holds documents that data.data_path {train} "
                          f"trains on")
    out = set_up(TokenChunks(data_path=train, val_path=train, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: data.val_path {train} is also data.data_path: the validation loss is measured on training "
                   f"data\n")


def test_slimpajama_validation_prepared_from_the_training_files_is_said(tmp_path, tokenizer, capsys):
    """prepare_slimpajama's val/ from the training files (README's line copied, --input_dir left at .../train), or
    training data prepared from the whole download, which holds validation/ too: SlimPajamaStarcoder said nothing."""
    data = slimpajama_layout(tmp_path / "same", tokenizer, "/raw/slimpajama/train", "/raw/slimpajama/train")
    out = set_up(SlimPajamaStarcoder(data_path=data, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: {data / 'slimpajama' / 'val'} holds documents that {data / 'slimpajama' / 'train'} trains "
                   f"on: both were prepared from slimpajama of /raw/slimpajama/train: the validation loss is measured on "
                   f"training data\n")
    data = slimpajama_layout(tmp_path / "whole", tokenizer, "/raw/slimpajama", "/raw/slimpajama/validation")
    out = set_up(SlimPajamaStarcoder(data_path=data, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: {data / 'slimpajama' / 'val'} holds documents that {data / 'slimpajama' / 'train'} trains "
                   f"on: it was prepared from /raw/slimpajama/validation, inside /raw/slimpajama, which the training "
                   f"data was prepared from (its files found recursively): the validation loss is measured on "
                   f"training data\n")
    data = slimpajama_layout(tmp_path / "apart", tokenizer, "/raw/slimpajama/train", "/raw/slimpajama/validation")
    assert set_up(SlimPajamaStarcoder(data_path=data, num_workers=0), tokenizer, capsys) == ""


def test_prepare_text_inputs_one_inside_the_other_are_said_where_read_recursively(tmp_path, tokenizer, capsys):
    """The validation data prepared from a corpus that holds the training corpus's folder (every file, recursively);
    with a --pattern of its own the files read are not known to overlap."""
    text = dict(recipe="text", text_key="text")
    train = prepared(tmp_path / "a" / "train", tokenizer, 0, input_dir="/corpus/2024", pattern="**/*", **text)
    val = prepared(tmp_path / "b" / "val", tokenizer, 1, input_dir="/corpus", pattern="**/*", split="val",
                   val_fraction=0.01, **text)
    out = set_up(TextFiles(train_dir=train, val_dir=val, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: data.val_dir {val} holds documents that data.train_dir {train} trains on: it was "
                   f"prepared from /corpus, which holds /corpus/2024, which the training data was prepared from (its "
                   f"files found recursively): the validation loss is measured on training data {HINT}\n")
    other = prepared(tmp_path / "c" / "val", tokenizer, 2, input_dir="/corpus", pattern="2025/*.jsonl", split="val",
                     val_fraction=0.01, **text)
    assert set_up(TextFiles(train_dir=train, val_dir=other, num_workers=0), tokenizer, capsys) == ""
    # prepare_text's own train/ and val/ hold other documents of one input
    split = dict(input_dir="/corpus/2024", pattern="**/*", val_fraction=0.01, **text)
    own_train = prepared(tmp_path / "own" / "train", tokenizer, 3, split="train", **split)
    own_val = prepared(tmp_path / "own" / "val", tokenizer, 4, split="val", **split)
    assert set_up(TextFiles(train_dir=own_train, val_dir=own_val, num_workers=0), tokenizer, capsys) == ""


def test_another_preparation_of_the_files_the_training_data_read_is_told_by_those_files(tmp_path, tokenizer, capsys):
    """prepare_text holds a document out by a hash of its path relative to --input_dir: the tutorial's two ways of
    reading one folder's files (--input_dir corpus --pattern '2024/*.jsonl', or --input_dir corpus/2024) hold out other
    documents, so a val/ of one and a train/ of the other share most of them, which was not said (the training data's
    --pattern was no '**/*'). Under one --input_dir, two globs of the same files hold out the same documents: said only
    where the shares differ (it was said, as an input inside itself). The documents each holds are counted by
    prepare_text's own rule (`held_out`), the reference."""
    from data_prep.prepare_text import held_out

    corpus = (tmp_path / "corpus").resolve()
    (corpus / "2024").mkdir(parents=True)
    lines = 400
    for name in ("a.jsonl", "b.jsonl"):
        (corpus / "2024" / name).write_text("".join(f'{{"text": "document {i} of {name}"}}\n' for i in range(lines)))
    (corpus / "README.md").write_text("not read")

    def shared(val_prefix, val_fraction, train_prefix, train_fraction):  # documents in the val/ and in the train/
        return sum(held_out(f"{val_prefix}{name}", i, val_fraction) and not held_out(f"{train_prefix}{name}", i, train_fraction)
                   for name in ("a.jsonl", "b.jsonl") for i in range(lines))

    text = dict(recipe="text", text_key="text")
    train = prepared(tmp_path / "by-pattern" / "train", tokenizer, 0, input_dir=str(corpus), pattern="2024/*.jsonl",
                     split="train", val_fraction=0.05, **text)
    val = prepared(tmp_path / "by-folder" / "val", tokenizer, 1, input_dir=str(corpus / "2024"), pattern="**/*",
                   split="val", val_fraction=0.05, **text)
    assert shared("", 0.05, "2024/", 0.05) > 30
    out = set_up(TextFiles(train_dir=train, val_dir=val, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: data.val_dir {val} holds documents that data.train_dir {train} trains on: it was prepared "
                   f"from {corpus / '2024'}, the training data from {corpus}, and both read 2 file(s) (e.g. "
                   f"{corpus / '2024' / 'a.jsonl'}): their splits hold out other documents of them (by their path "
                   f"relative to each input): the validation loss is measured on training data {HINT}\n")

    train = prepared(tmp_path / "jsonl" / "train", tokenizer, 2, input_dir=str(corpus), pattern="**/*.jsonl",
                     split="train", val_fraction=0.05, **text)
    val = prepared(tmp_path / "all" / "val", tokenizer, 3, input_dir=str(corpus), pattern="**/*", split="val",
                   val_fraction=0.05, **text)
    assert shared("2024/", 0.05, "2024/", 0.05) == 0
    assert set_up(TextFiles(train_dir=train, val_dir=val, num_workers=0), tokenizer, capsys) == ""
    larger = prepared(tmp_path / "larger" / "val", tokenizer, 4, input_dir=str(corpus), pattern="**/*", split="val",
                      val_fraction=0.2, **text)
    assert shared("2024/", 0.2, "2024/", 0.05) > 30
    out = set_up(TextFiles(train_dir=train, val_dir=larger, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: data.val_dir {larger} holds documents that data.train_dir {train} trains on: both were "
                   f"prepared from {corpus}, with the --pattern '**/*' and '**/*.jsonl', which both read 2 file(s) (e.g. "
                   f"{corpus / '2024' / 'a.jsonl'}), with other shares held out (--val_fraction 0.2 and 0.05): the "
                   f"validation loss is measured on training data {HINT}\n")


def test_prepare_text_s_two_splits_given_for_each_other_are_said(tmp_path, tokenizer, capsys):
    """--data.train_dir OUT/val --data.val_dir OUT/train trained on the held-out share alone, repeated, and said
    nothing of it. Each the right way round, or a val/ mixed into the training data beside its train/, says nothing;
    TokenChunks' data_path and val_path are told the same."""
    split = dict(recipe="text", input_dir="/corpus", pattern="**/*", text_key="text", val_fraction=0.01)
    train = prepared(tmp_path / "out" / "train", tokenizer, 0, split="train", **split)
    val = prepared(tmp_path / "out" / "val", tokenizer, 1, split="val", **split)
    out = set_up(TextFiles(train_dir=val, val_dir=train, num_workers=0), tokenizer, capsys)
    assert out == (f"Warning: data.train_dir {val} is the val/ split that prepare_text held out and data.val_dir {train} "
                   f"the train/ split of the same input, given for each other: the run trains on the held-out documents "
                   f"and validates on the others; did you mean --data.train_dir {train} --data.val_dir {val}?\n")
    out = set_up(TokenChunks(data_path=val, val_path=train, num_workers=0), tokenizer, capsys)
    assert out.startswith(f"Warning: data.data_path {val} is the val/ split that prepare_text held out and "
                          f"data.val_path {train} the train/ split of the same input")
    assert set_up(TextFiles(train_dir=train, val_dir=val, num_workers=0), tokenizer, capsys) == ""
    assert set_up(TextFiles(train_dir=[train, val], num_workers=0), tokenizer, capsys).startswith("TextFiles: no validation")
