"""fabric_lin/pretrain.py against its data and tokenizer: a data directory or tokenizer that is missing, blocks longer
than the data's chunk files, vocabularies larger than the model's, a tokenizer other than the one that made the data
(each refused before the model is built, naming the value); data smaller than a micro batch read epoch after epoch,
a run without a tokenizer warned of, the paths in hyperparameters.yaml made absolute, and the directories of a
failed run removed."""
import os
from pathlib import Path

import pytest

from conftest import litdata_blocks
from fabric_lin.args import EvalArgs, TrainArgs
from fabric_lin.config import Config
from helpers import setup_pretrain, write_prepared


def test_error_data_dir_without_index(tmp_path):
    from fabric_lin.data import TokenChunks

    empty = tmp_path / "tokens"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"{empty} has no index.json"):
        setup_pretrain(tmp_path, data=TokenChunks(data_path=empty, num_workers=0))


def test_error_missing_tokenizer(tmp_path):
    from fabric_lin.data import TokenChunks

    with pytest.raises(FileNotFoundError, match=str(tmp_path / "no_tokenizer")):
        setup_pretrain(tmp_path, data=TokenChunks(data_path=tmp_path, num_workers=0), tokenizer_dir=tmp_path / "no_tokenizer")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Two small tokenizers (300 and 320 pieces) and prepared directories made with the first: `tokens` of
    4 chunk files of 1000 tokens, written as the preprocessors write them."""
    import numpy as np

    from fabric_lin.data import Tokenizer
    from fabric_lin.data.train_tokenizer import main as train_tokenizer

    root = tmp_path_factory.mktemp("prepared")
    for name, vocab_size, words in (("tok300", 300, "some text for a tokenizer"), ("tok320", 320, "other words, other pieces")):
        (root / f"{name}-raw").mkdir()
        (root / f"{name}-raw" / "a.txt").write_text("\n".join(f"line {i} of {words}" for i in range(500)))
        train_tokenizer(root / f"{name}-raw", root / name, vocab_size=vocab_size, num_threads=1)
    write_prepared(root / "tokens", (np.arange(4000) % 300).astype(np.uint16), Tokenizer(root / "tok300"))
    return root


def test_error_max_seq_length_beyond_the_data(tmp_path, prepared):
    """Chunk files of 1000 tokens hold no block of 1000 + 1: refused before the model is built."""
    from fabric_lin.data import TokenChunks

    data = TokenChunks(data_path=prepared / "tokens", num_workers=0)
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=1000)
    with pytest.raises(ValueError, match=rf"max_seq_length=1000 is too long for {prepared / 'tokens'}: .* 1001 tokens .*"
                       r"its largest chunk file holds 1000 tokens"):
        setup_pretrain(tmp_path, data=data, train=train)
    assert not (tmp_path / "out" / "final").exists()


def test_error_data_vocab_larger_than_the_model_without_tokenizer(tmp_path, prepared):
    """No tokenizer_dir: prepared.json's vocab_size (300) is checked against the model's (256)."""
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=256)
    with pytest.raises(ValueError, match=rf"{prepared / 'tokens'} was tokenized with a vocabulary of 300 tokens .*"
                       r"the model's vocab_size=256"):
        setup_pretrain(tmp_path, model_name=None, model_config=config, data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_error_tokenizer_vocab_larger_than_the_model(tmp_path, prepared):
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=256)
    with pytest.raises(ValueError, match=rf"the tokenizer in {prepared / 'tok300'} has 300 tokens but the model's vocab_size is 256"):
        setup_pretrain(tmp_path, model_name=None, model_config=config, tokenizer_dir=prepared / "tok300",
               data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_error_tokenizer_dir_differs_from_the_one_that_made_the_data(tmp_path, prepared):
    from fabric_lin.data import TokenChunks

    with pytest.raises(ValueError, match=rf"{prepared / 'tokens'} was tokenized with a different tokenizer \(vocab_size=300,"
                       rf".* than {prepared / 'tok320' / 'tokenizer.model'} \(vocab_size=320"):
        setup_pretrain(tmp_path, tokenizer_dir=prepared / "tok320", data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_data_smaller_than_a_micro_batch_is_read_epoch_after_epoch(tmp_path, prepared):
    """4 chunk files give 4 blocks of 501 tokens, half a micro batch of 8: the stream reads them again
    in the next epoch (in another order), so the micro batch holds each block twice."""
    from fabric_lin.data import TokenChunks

    data = TokenChunks(data_path=prepared / "tokens", num_workers=0)
    data.connect(batch_size=8, max_seq_length=500)
    data.setup()
    blocks = litdata_blocks(prepared / "tokens", 501)
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (8, 501) and len(blocks) == 4
    assert sorted(bytes(row.numpy()) for row in batch) == sorted(blocks * 2)
    train = TrainArgs(global_batch_size=8, micro_batch_size=8, max_steps=1, max_seq_length=500, save_interval=None)
    setup_pretrain(tmp_path, data=data, train=train, eval=EvalArgs(final_validation=False))
    assert (tmp_path / "out" / "final").is_dir()


def test_no_tokenizer_is_warned_of(tmp_path, prepared, capsys):
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=320)
    setup_pretrain(tmp_path, model_name=None, model_config=config, eval=EvalArgs(final_validation=False),
           data=TokenChunks(data_path=prepared / "tokens", num_workers=0))
    assert "Warning: no tokenizer (--tokenizer_dir, or a data module that has one)" in capsys.readouterr().out
    assert (tmp_path / "out" / "final" / "lit_model.pth").exists()


def test_hyperparameters_yaml_holds_absolute_paths(tmp_path, monkeypatch, prepared):
    import yaml

    from fabric_lin.data import TokenChunks

    monkeypatch.chdir(tmp_path)
    data = TokenChunks(data_path=Path(os.path.relpath(prepared / "tokens", tmp_path)), num_workers=0)
    config = Config.from_name("gla-debug", vocab_size=320)
    setup_pretrain(tmp_path, model_name=None, model_config=config, out_dir=Path("runs/out"), data=data,
           tokenizer_dir=Path(os.path.relpath(prepared / "tok300", tmp_path)), eval=EvalArgs(final_validation=False))
    hparams = yaml.safe_load((tmp_path / "runs" / "out" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["out_dir"] == str(tmp_path / "runs" / "out")
    assert hparams["tokenizer_dir"] == str(prepared / "tok300")
    assert hparams["data"]["init_args"]["data_path"] == str(prepared / "tokens")


def test_a_failed_run_removes_the_empty_output_directories_it_created(tmp_path):
    from fabric_lin.data import TokenChunks

    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):  # after the launch: the data is checked in main
        setup_pretrain(tmp_path, out_dir=tmp_path / "runs" / "a" / "b", data=TokenChunks(data_path=tmp_path / "nothing", num_workers=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())
