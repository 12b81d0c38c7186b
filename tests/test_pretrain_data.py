"""fabric_lin/pretrain.py against its data and tokenizer: a data directory or tokenizer that is missing, blocks longer
than the data's chunk files, vocabularies larger than the model's, a tokenizer other than the one that made the data,
of the same size too (each refused before the model is built, naming the value); data smaller than a micro batch read epoch after epoch,
a run without a tokenizer warned of, the paths in hyperparameters.yaml made absolute, and the directories of a
failed run removed."""
import hashlib
import json
import os
import re
import shutil
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



def test_a_tokenizer_dir_that_is_not_there_names_the_data_s_own(tmp_path, prepared):
    """A --config recipe's tokenizer_dir (Llama-2's, that prepared its SlimPajama) stays set under --data TextFiles of a
    corpus prepared with another tokenizer: where it is not there, the error names the data's own tokenizer and how to
    take it."""
    from fabric_lin.data import TextFiles
    from fabric_lin.errors import MissingFile

    missing = tmp_path / "checkpoints" / "meta-llama" / "Llama-2-7b-hf"
    with pytest.raises(MissingFile, match=rf"^--tokenizer_dir {re.escape(str(missing))} does not exist; the data carries the "
                                          rf"tokenizer that prepared it, in {re.escape(str(prepared / 'tokens300'))}: give "
                                          r"--tokenizer_dir null to train with that one \(a --config file's tokenizer_dir"):
        setup_pretrain(tmp_path, tokenizer_dir=missing, data=TextFiles(train_dir=prepared / "tokens300", num_workers=0))
    assert not (tmp_path / "out").exists()

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Three small tokenizers (300, 320 and another of 300 pieces) and prepared directories of 4 chunk files of 1000
    tokens, written as the preprocessors write them: `tokens300`, `tokens320` and `tokens300b` by each tokenizer, with
    its files beside the tokens, and `tokens` by the first, without them (a directory copied without its tokenizer)."""
    import numpy as np

    from fabric_lin.data import Tokenizer
    from fabric_lin.data.train_tokenizer import main as train_tokenizer

    root = tmp_path_factory.mktemp("prepared")
    for name, vocab_size, words in (("tok300", 300, "some text for a tokenizer"), ("tok320", 320, "other words, other pieces"),
                                    ("tok300b", 300, "a third text, pieces of its own")):
        (root / f"{name}-raw").mkdir()
        (root / f"{name}-raw" / "a.txt").write_text("\n".join(f"line {i} of {words}" for i in range(500)))
        train_tokenizer(root / f"{name}-raw", root / name, vocab_size=vocab_size, num_threads=1)
    for name, tokenizer in (("tokens", "tok300"), ("tokens300", "tok300"), ("tokens320", "tok320"), ("tokens300b", "tok300b")):
        vocab_size = Tokenizer(root / tokenizer).vocab_size
        write_prepared(root / name, (np.arange(4000) % vocab_size).astype(np.uint16), Tokenizer(root / tokenizer))
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (root / "tokens" / name).unlink(missing_ok=True)
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


@pytest.mark.parametrize("damage,message", [
    # litdata waits for a chunk file to reach its size in index.json (a download in progress): a run on a cut one hung
    (lambda d: os.truncate(d / "chunk-0-1.bin", 100),
     r"{d} is damaged: chunk-0-1.bin has 100 bytes, 2,012 in index.json \(truncated\); copy the directory again"),
    (lambda d: (d / "chunk-0-2.bin").open("ab").write(b"more"), r"chunk-0-2.bin has 2,016 bytes, 2,012 in index.json \(grown\)"),
    (lambda d: (d / "index.json").write_bytes(b"\xff\xfe{"), r"{d}/index.json cannot be read as JSON: 'utf-8' codec can't decode"),
    (lambda d: (d / "prepared.json").write_text("[]"), r"{d}/prepared.json: expected a JSON object, got array"),
    (lambda d: (d / "prepared.json").write_text('{"complete": false}'),
     r"{d}/prepared.json does not mark the directory complete; prepare it again"),
    (lambda d: (d / "index.json").write_text('{"chunks": [{"dim": 1000}]}'),
     r"{d}/index.json: expected litdata's index: a list of chunks, each with its filename"),
    # a preprocessing run killed before its last write: prepared.json, or its mark, is not there
    (lambda d: (d / "prepared.json").unlink(), r"{d} is incomplete: prepared.json is missing \(written last"),
    (lambda d: (d / "prepared.json").write_text('{"tokenizer": {}}'), r"{d}/prepared.json does not mark the directory complete"),
    (lambda d: (d / "chunk-0-3.bin").unlink(),
     r"{d} is incomplete: 1 chunk file\(s\) listed in index.json are missing, e.g. chunk-0-3.bin"),
])
def test_a_damaged_prepared_directory_is_named_not_read(tmp_path, prepared, damage, message):
    """A chunk file of another size than its index gives, an index or prepared.json that is no JSON object or
    lists a chunk without its file, a prepared.json (or its mark of a complete directory) or a chunk file that is not
    there: one error naming the file (a traceback of UnicodeDecodeError, AttributeError, KeyError or FileNotFoundError,
    or for the chunk a run that waited for ever)."""
    import shutil

    from fabric_lin.data import check_prepared_dir
    from fabric_lin.errors import UserError

    directory = shutil.copytree(prepared / "tokens300", tmp_path / "tokens")
    damage(directory)
    with pytest.raises(UserError, match=message.format(d=directory)):
        check_prepared_dir(directory)


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
    with pytest.raises(ValueError, match=rf"the tokenizer in {prepared / 'tok300'} has 300 tokens but the model's vocab_size is 256"
                                         r".*pretrain list NAME > model.yaml"):
        setup_pretrain(tmp_path, model_name=None, model_config=config, tokenizer_dir=prepared / "tok300",
               data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_error_tokenizer_dir_differs_from_the_one_that_made_the_data(tmp_path, prepared):
    from fabric_lin.data import TokenChunks

    with pytest.raises(ValueError, match=rf"{prepared / 'tokens'} was tokenized with a different tokenizer \(vocab_size=300,"
                       rf".* than {prepared / 'tok320' / 'tokenizer.model'} \(vocab_size=320"):
        setup_pretrain(tmp_path, tokenizer_dir=prepared / "tok320", data=TokenChunks(data_path=prepared / "tokens", num_workers=0))


def test_the_tokenizer_files_beside_the_tokens_replaced_by_anothers_are_named_so(tmp_path, prepared):
    """Without --tokenizer_dir the run takes the data's own tokenizer files: another's copied over them is refused as
    such, not with the fix for a --tokenizer_dir of another tokenizer (prepare the data with it)."""
    import shutil

    from fabric_lin.data import TokenChunks, Tokenizer

    shutil.copytree(prepared / "tokens300", tmp_path / "tokens")
    shutil.copy(prepared / "tok300b" / "tokenizer.model", tmp_path / "tokens")
    with pytest.raises(ValueError) as refused:
        setup_pretrain(tmp_path, data=TokenChunks(data_path=tmp_path / "tokens", num_workers=0))
    assert str(refused.value).startswith(f"{tmp_path / 'tokens'} was tokenized with vocab_size=300, sha256=")
    assert str(refused.value).endswith(
        f"and {tmp_path / 'tokens' / 'tokenizer.model'} (vocab_size=300, sha256={Tokenizer(prepared / 'tok300b').model_hash[:12]}...), "
        "taken as the run's tokenizer, is not the one its own prepared.json records: the tokenizer files beside those "
        "tokens were replaced; put back the files of the tokenizer that prepared them, or give that one as --tokenizer_dir")


def test_data_smaller_than_a_micro_batch_is_read_epoch_after_epoch(tmp_path, prepared, capsys):
    """4 chunk files give 4 blocks of 501 tokens, half a micro batch of 8: the stream reads them again
    in the next epoch (in another order), so the micro batch holds each block twice, and the run says so."""
    from fabric_lin.data import TokenChunks

    data = TokenChunks(data_path=prepared / "tokens", num_workers=0)
    data.connect(batch_size=8, max_seq_length=500)
    data.setup()
    blocks = litdata_blocks(prepared / "tokens", 501)
    batch = next(iter(data.train_dataloader()))
    assert batch.shape == (8, 501) and len(blocks) == 4
    assert sorted(bytes(row.numpy()) for row in batch) == sorted(blocks * 2)
    train = TrainArgs(global_batch_size=8, micro_batch_size=8, max_steps=1, max_seq_length=500, save_interval=None)
    capsys.readouterr()
    setup_pretrain(tmp_path, data=data, train=train, eval=EvalArgs(final_validation=False))
    assert (tmp_path / "out" / "final").is_dir()
    assert (f"Note: over its 1 step of 8 samples this run reads {prepared / 'tokens'} 2.0 times over its 4 samples: their "
            "samples repeat, epoch after epoch, each in a new order") in capsys.readouterr().out


def test_no_tokenizer_is_warned_of(tmp_path, prepared, capsys):
    from fabric_lin.data import TokenChunks

    config = Config.from_name("gla-debug", vocab_size=320)
    setup_pretrain(tmp_path, model_name=None, model_config=config, eval=EvalArgs(final_validation=False),
           data=TokenChunks(data_path=prepared / "tokens", num_workers=0))
    assert "Warning: no tokenizer (--tokenizer_dir, or a data module that has one)" in capsys.readouterr().out
    assert (tmp_path / "out" / "final" / "lit_model.pth").exists()
    # no tokenizer files, but the record of the one that prepared the data: a tokenizer.model put there later is checked
    final = tmp_path / "out" / "final"
    assert not (final / "tokenizer.model").exists()
    data_tokenizer = json.loads((prepared / "tokens" / "prepared.json").read_text())["tokenizer"]
    assert json.loads((final / "trained_with.json").read_text())["tokenizer"] == data_tokenizer


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


def test_a_failed_run_removes_the_empty_output_directories_it_created(tmp_path, capsys):
    from fabric_lin.data import TokenChunks

    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):  # after the launch: the data is checked in main
        setup_pretrain(tmp_path, out_dir=tmp_path / "runs" / "a" / "b", data=TokenChunks(data_path=tmp_path / "nothing", num_workers=0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"] and not any((tmp_path / "runs").iterdir())
    # the missing path is the one thing said: no warning of a tokenizer the data could not be read for
    assert "Warning: no tokenizer" not in capsys.readouterr().out


# ---- one tokenizer per run: the data's directories agree, the checkpoints carry it, evaluate checks it


def test_directories_of_two_tokenizers_are_refused_naming_both(prepared):
    """A mix of two tokenizers' training directories, or validation data of another tokenizer than the training data,
    is refused in one line naming both directories and both hashes (no --tokenizer_dir: nothing else to compare to)."""
    import json

    from fabric_lin.data import TextFiles, TokenChunks

    sha = {n: json.loads((prepared / n / "prepared.json").read_text())["tokenizer"]["sha256"][:12] for n in ("tokens300", "tokens320")}
    for data in (TextFiles(train_dir=[prepared / "tokens300", prepared / "tokens320"], num_workers=0),
                 TextFiles(train_dir=prepared / "tokens300", val_dir=prepared / "tokens320", num_workers=0),
                 TokenChunks(data_path=prepared / "tokens300", val_path=prepared / "tokens320", num_workers=0)):
        data.connect(batch_size=1, max_seq_length=16, vocab_size=320)
        with pytest.raises(ValueError) as info:
            data.setup()
        message = str(info.value)
        assert "\n" not in message
        assert message.startswith(f"{prepared / 'tokens300'} and {prepared / 'tokens320'} were tokenized with different tokenizers")
        assert all(f"sha256={sha[n]}" in message for n in sha) and str(prepared / "tok320") in message


def test_tokenizers_of_one_vocabulary_size_are_told_apart_by_their_hash(prepared):
    """Another tokenizer of the same size makes other pieces of the same ids: prepared.json's sha256 of its
    tokenizer.model refuses mixing its directories with the first one's, and training them with the first one."""
    from fabric_lin.data import TextFiles, Tokenizer
    from fabric_lin.data.prepared import check_prepared_dir

    data = TextFiles(train_dir=[prepared / "tokens300", prepared / "tokens300b"], num_workers=0)
    data.connect(batch_size=1, max_seq_length=16, vocab_size=320)
    with pytest.raises(ValueError, match=rf"{prepared / 'tokens300'} and {prepared / 'tokens300b'} were tokenized with different"):
        data.setup()
    with pytest.raises(ValueError, match=rf"{prepared / 'tokens300b'} was tokenized with a different tokenizer \(vocab_size=300"):
        check_prepared_dir(prepared / "tokens300b", Tokenizer(prepared / "tok300"))


def test_data_of_a_vocabulary_one_token_larger_than_the_model_is_refused(prepared):
    """Ids 0-299 fit an embedding of 300 rows, not of 299."""
    from fabric_lin.data.prepared import check_prepared_dir

    check_prepared_dir(prepared / "tokens300", vocab_size=300)
    with pytest.raises(ValueError, match="a vocabulary of 300 tokens .* more than the model's vocab_size=299.*pretrain list"):
        check_prepared_dir(prepared / "tokens300", vocab_size=299)


def test_a_tokenizer_of_one_piece_more_than_the_model_s_embeddings_is_refused(prepared):
    from fabric_lin.data import Tokenizer

    tokenizer = Tokenizer(prepared / "tok300")
    tokenizer.check_fits(300, "model")
    with pytest.raises(ValueError, match=r"model: its tokenizer has 300 pieces and its model 299 embeddings"):
        tokenizer.check_fits(299, "model")


def test_the_tokenizer_carried_with_the_data_is_the_one_all_its_directories_were_tokenized_with(prepared):
    """The first directory holding the tokenizer files (`tokens` was copied without them); none where the directories
    were tokenized by two tokenizers (setup names them) or none holds the files."""
    from fabric_lin.data.prepared import carried_tokenizer_dir

    assert carried_tokenizer_dir([prepared / "tokens", prepared / "tokens300"]) == prepared / "tokens300"
    assert carried_tokenizer_dir([prepared / "tokens300", prepared / "tokens300b"]) is None
    assert carried_tokenizer_dir([prepared / "tokens320", prepared / "tokens300"]) is None
    assert carried_tokenizer_dir([prepared / "tokens"]) is None


def test_a_run_takes_the_data_s_tokenizer_and_evaluate_refuses_another_s_data(tmp_path, prepared, capsys):
    """TextFiles without --tokenizer_dir: the checkpoints hold the tokenizer that prepared the data (no warning), so
    `evaluate --data TextFiles` on data of another tokenizer is refused, naming the data and the checkpoint's tokenizer."""
    from fabric_lin.data import TextFiles
    from helpers import cli_error

    config = Config.from_name("gla-debug", vocab_size=320)
    setup_pretrain(tmp_path, model_name=None, model_config=config, eval=EvalArgs(final_validation=False),
                   data=TextFiles(train_dir=prepared / "tokens300", num_workers=0))
    assert "Warning: no tokenizer" not in capsys.readouterr().out
    final = tmp_path / "out" / "final"
    assert (final / "tokenizer.model").read_bytes() == (prepared / "tok300" / "tokenizer.model").read_bytes()
    err = cli_error(["evaluate", str(final), "--data", "TextFiles", "--data.val_dir", str(prepared / "tokens320"),
                     "--data.num_workers", "0"], capsys)
    assert f"--data: {prepared / 'tokens320'} was tokenized with vocab_size=320" in err
    assert f"were trained on the ids of {final / 'tokenizer.model'} (vocab_size=300" in err


def test_weights_trained_with_another_tokenizer_are_refused_on_resume_and_as_initial_weights(tmp_path, prepared, capsys):
    """A run trained on tok300's ids, continued on data of tok300b (the same vocabulary size, other pieces): a resume
    with --resume_changes data, or its model directory as --initial_checkpoint_dir, is refused before the model is
    built, naming the weights' tokenizer and the data's; the same tokenizer's data starts from those weights. A model
    directory that records no tokenizer at all cannot be checked: the run says so (it went on without a word)."""
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TextFiles

    config = Config.from_name("gla-debug", vocab_size=320)
    run = dict(model_name=None, model_config=config, eval=EvalArgs(final_validation=False))
    setup_pretrain(tmp_path, **run, data=TextFiles(train_dir=prepared / "tokens300", num_workers=0))
    final = tmp_path / "out" / "final"
    convert_pretrained_checkpoint(final, tmp_path / "model")
    other_data = TextFiles(train_dir=prepared / "tokens300b", num_workers=0)
    longer = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32)
    with pytest.raises(ValueError) as info:
        setup_pretrain(tmp_path, **run, data=other_data, train=longer, resume=True, resume_changes=["data", "train.max_steps"])
    message = str(info.value)
    assert message.startswith(f"--resume {final}: its weights were trained on the ids of {final / 'tokenizer.model'} "
                              "(vocab_size=300, sha256=")
    assert f"this run reads those of {prepared / 'tokens300b' / 'tokenizer.model'} (vocab_size=300, sha256=" in message
    assert message.endswith(f"resume on data prepared with --tokenizer_path {final}, or train on this data in a new run")
    assert "\n" not in message and not (final.parent / "step-00000002").exists()

    with pytest.raises(ValueError, match=rf"^--initial_checkpoint_dir {tmp_path / 'model'}: its weights were trained on "
                       rf"the ids of {tmp_path / 'model' / 'tokenizer.model'} \(vocab_size=300, .* this run reads those of "
                       rf"{prepared / 'tokens300b' / 'tokenizer.model'} .*--tokenizer_path {tmp_path / 'model'}"):
        setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_weights", data=other_data,
                       initial_checkpoint_dir=tmp_path / "model")
    # without its tokenizer.model, the model directory's trained_with.json still says which ids its weights learnt
    bare = tmp_path / "bare"
    shutil.copytree(tmp_path / "model", bare)
    (bare / "tokenizer.model").unlink()
    with pytest.raises(ValueError) as info:
        setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_bare", data=other_data, initial_checkpoint_dir=bare)
    sha256 = json.loads((prepared / "tokens300" / "prepared.json").read_text())["tokenizer"]["sha256"]
    assert str(info.value).startswith(
        f"--initial_checkpoint_dir {bare}: its weights were trained on the ids of the tokenizer its trained_with.json "
        f"records (vocab_size=300, sha256={sha256[:12]}..., from {prepared / 'tok300'}), and this run reads those of "
        f"{prepared / 'tokens300b' / 'tokenizer.model'} (vocab_size=300, sha256="), str(info.value)
    # without the record too, nothing tells which ids the weights learnt: the run says so
    (bare / "trained_with.json").unlink()
    capsys.readouterr()
    setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_unrecorded", data=other_data, initial_checkpoint_dir=bare)
    other_sha = json.loads((prepared / "tokens300b" / "prepared.json").read_text())["tokenizer"]["sha256"]
    assert (f"Note: --initial_checkpoint_dir {bare} holds no tokenizer.model and no trained_with.json, so nothing tells "
            f"whether this run's data tokenizer (vocab_size=300, sha256={other_sha[:12]}..., from {prepared / 'tok300b'}) "
            "is the one its weights were trained with; under another one each id is another piece\n") in capsys.readouterr().out
    setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_weights", initial_checkpoint_dir=tmp_path / "model",
                   data=TextFiles(train_dir=prepared / "tokens300", num_workers=0))
    assert (tmp_path / "from_weights" / "final").is_dir()
    assert "Note: --initial_checkpoint_dir" not in capsys.readouterr().out


def test_data_without_its_tokenizer_files_is_still_checked_against_the_weights_tokenizer(tmp_path, prepared):
    """Data copied without its tokenizer.model (the run then has no tokenizer) still records its tokenizer in
    prepared.json: tok300b's data on weights trained on tok300's ids is refused as --initial_checkpoint_dir and on
    --resume, naming both tokenizers; tok300's data so copied trains on from them."""
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TextFiles

    config = Config.from_name("gla-debug", vocab_size=320)
    run = dict(model_name=None, model_config=config, eval=EvalArgs(final_validation=False))
    setup_pretrain(tmp_path, **run, data=TextFiles(train_dir=prepared / "tokens300", num_workers=0))
    final, model = tmp_path / "out" / "final", tmp_path / "model"
    convert_pretrained_checkpoint(final, model)
    bare_other = shutil.copytree(prepared / "tokens300b", tmp_path / "tokens300b-bare")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (bare_other / name).unlink(missing_ok=True)
    data_sha = json.loads((bare_other / "prepared.json").read_text())["tokenizer"]["sha256"]
    data_named = (f"this run reads those of the tokenizer its data's prepared.json records (vocab_size=300, "
                  f"sha256={data_sha[:12]}..., from {prepared / 'tok300b'})")

    with pytest.raises(ValueError) as info:
        setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_weights", initial_checkpoint_dir=model,
                       data=TextFiles(train_dir=bare_other, num_workers=0))
    assert str(info.value).startswith(f"--initial_checkpoint_dir {model}: its weights were trained on the ids of "
                                      f"{model / 'tokenizer.model'} (vocab_size=300, sha256="), str(info.value)
    assert data_named in str(info.value)
    longer = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32)
    with pytest.raises(ValueError, match=rf"^--resume {final}: its weights were trained on the ids of .*"
                       + re.escape(data_named)):
        setup_pretrain(tmp_path, **run, data=TextFiles(train_dir=bare_other, num_workers=0), train=longer, resume=True,
                       resume_changes=["data", "train.max_steps"])
    assert not (tmp_path / "from_weights" / "final").exists() and not (tmp_path / "out" / "step-00000002").exists()
    setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_weights", initial_checkpoint_dir=model,
                   data=TextFiles(train_dir=prepared / "tokens", num_workers=0))
    assert (tmp_path / "from_weights" / "final").is_dir()


def test_checkpoints_record_the_data_s_tokenizer_which_another_tokenizer_model_cannot_pass_for(tmp_path, prepared, capsys):
    """The run's checkpoints record the tokenizer that prepared its data (prepared.json's), and a model directory
    converted from one keeps the record. Its tokenizer.model replaced by tok300b's (the same size, other pieces), with
    data prepared by tok300b too, --initial_checkpoint_dir is refused before the model is built, in one line naming the
    directory, the file and both hashes; evaluate refuses the checkpoint so altered alike."""
    from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
    from fabric_lin.data import TextFiles
    from helpers import cli_error

    config = Config.from_name("gla-debug", vocab_size=320)
    run = dict(model_name=None, model_config=config, eval=EvalArgs(final_validation=False))
    setup_pretrain(tmp_path, **run, data=TextFiles(train_dir=prepared / "tokens300", num_workers=0))
    final, model = tmp_path / "out" / "final", tmp_path / "model"
    convert_pretrained_checkpoint(final, model)
    data_tokenizer = json.loads((prepared / "tokens300" / "prepared.json").read_text())["tokenizer"]
    for directory in (final, model):
        assert json.loads((directory / "trained_with.json").read_text())["tokenizer"] == data_tokenizer

    sha = {name: hashlib.sha256((prepared / name / "tokenizer.model").read_bytes()).hexdigest()[:12]
           for name in ("tok300", "tok300b")}
    for directory in (final, model):
        shutil.copy(prepared / "tok300b" / "tokenizer.model", directory / "tokenizer.model")
    refusal = ("{0}: {0}/tokenizer.model (vocab_size=300, sha256={1}...) is not the tokenizer its weights were trained "
               "with (vocab_size=300, sha256={2}..., from {3}, recorded in trained_with.json): an id is another piece in "
               "each; put back the tokenizer.model the model was trained with")
    with pytest.raises(ValueError) as info:
        setup_pretrain(tmp_path, **run, out_dir=tmp_path / "from_weights", initial_checkpoint_dir=model,
                       data=TextFiles(train_dir=prepared / "tokens300b", num_workers=0))
    assert str(info.value) == "--initial_checkpoint_dir: " + refusal.format(model, sha["tok300b"], sha["tok300"], prepared / "tok300")
    assert not (tmp_path / "from_weights" / "final").exists()
    err = cli_error(["evaluate", str(final), "--max_batches", "1"], capsys)
    assert err == "fabric-lin evaluate: error: checkpoint_dir: " + refusal.format(final, sha["tok300b"], sha["tok300"], prepared / "tok300") + "\n"


@pytest.mark.parametrize("module,option,suggested,anchored", [
    ("TextFiles", "train_dir", "train", False), ("TextFiles", "val_dir", "val", True),
    ("TokenChunks", "data_path", "train", False), ("TokenChunks", "val_path", "val", True),
])
def test_prepare_text_output_given_as_a_data_dir_suggests_its_split(tmp_path, prepared, module, option, suggested,
                                                                    anchored):
    """prepare_text's --output_dir holds train/ and val/: given as data.train_dir (data_path), the error names
    OUT/train; given as data.val_dir or val_path (pretrain's, or evaluate's held-out text), OUT/val, not OUT/train:
    validating on training data is what the split exists to avoid."""
    import shutil

    import fabric_lin.data

    for split in ("train", "val"):
        shutil.copytree(prepared / "tokens300", tmp_path / "out" / split)
    data = getattr(fabric_lin.data, module)(**{option: tmp_path / "out"}, num_workers=0)
    data.connect(batch_size=1, max_seq_length=16)
    message = (rf"{tmp_path / 'out'} has no index.json; it holds prepared directories \(train, val\): did you mean "
               rf"{tmp_path / 'out' / suggested}\?")
    for check in (data.setup, data.setup_validation) if anchored else (data.setup,):
        with pytest.raises(FileNotFoundError, match=rf"^data.{option} {message}$" if anchored else message):
            check()


def test_raw_text_given_as_prepared_data_says_to_prepare_it(tmp_path):
    """A folder of raw text, or one file of it, where a prepared directory is expected (--data.val_dir, train_dir,
    data_path): the error says it is raw text and names prepare_text, not that a file there does not exist or that a
    preparation of it did not finish."""
    from fabric_lin.data.prepared import read_prepared_dir

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("some text\n")
    with pytest.raises(ValueError) as info:
        read_prepared_dir(tmp_path / "raw" / "a.txt")
    assert str(info.value) == (f"{tmp_path / 'raw' / 'a.txt'} is a file, expected a prepared data directory (index.json, "
                               f"prepared.json and token chunks): raw text is tokenized first, e.g. fabric-lin prepare_text "
                               f"--input_dir {tmp_path / 'raw'} --output_dir DIR --tokenizer_path TOKENIZER_DIR")
    with pytest.raises(FileNotFoundError) as info:
        read_prepared_dir(tmp_path / "raw")
    assert str(info.value) == (f"{tmp_path / 'raw'} has no index.json: it holds raw text (a.txt), which is tokenized first, "
                               f"e.g. fabric-lin prepare_text --input_dir {tmp_path / 'raw'} --output_dir DIR "
                               f"--tokenizer_path TOKENIZER_DIR")


def test_a_validation_split_too_small_for_a_sample_says_raise_val_fraction(tmp_path, prepared):
    """A validation split of prepare_text holding fewer tokens than one sample: raise --val_fraction, not the chunk size."""
    import numpy as np

    from fabric_lin.data import TextFiles, Tokenizer

    write_prepared(tmp_path / "val", np.arange(100, dtype=np.uint16), Tokenizer(prepared / "tok300"), recipe="text",
                   split="val", val_fraction=0.005)
    data = TextFiles(train_dir=prepared / "tokens", val_dir=tmp_path / "val", num_workers=0)
    data.connect(batch_size=2, max_seq_length=128)
    data.setup()
    with pytest.raises(ValueError, match=rf"train.max_seq_length=128 is too long for {tmp_path / 'val'}: .* it holds 100 "
                       r"tokens in all; prepare it again with a larger --val_fraction \(this split held out 0.005 of the "
                       r"documents\), or lower train.max_seq_length$"):
        data.val_dataloader()


def test_a_training_split_too_small_for_a_sample_is_not_told_to_raise_val_fraction(tmp_path, prepared):
    """prepare_text's train/ records its --val_fraction too: where it is too small for one sample, a larger share held
    out would only shrink it further, so the fix is a shorter length or more data."""
    import numpy as np

    from fabric_lin.data import Tokenizer
    from fabric_lin.data.prepared import BlockTooLong

    write_prepared(tmp_path / "train", np.arange(100, dtype=np.uint16), Tokenizer(prepared / "tok300"), recipe="text",
                   split="train", val_fraction=0.005)
    assert str(BlockTooLong(tmp_path / "train", 129)) == (
        f"train.max_seq_length=128 is too long for {tmp_path / 'train'}: a sample is a block of train.max_seq_length + 1 "
        f"= 129 tokens from one chunk file, and it holds 100 tokens in all; lower train.max_seq_length or give it more data")


def test_tokens_enough_for_one_sample_in_all_but_not_in_one_chunk_file_say_so(tmp_path, prepared):
    """Exactly one sample's tokens in all, cut into two chunk files: the chunk files are what is too small (a larger
    chunk_size), not the amount of data."""
    import numpy as np

    from fabric_lin.data import Tokenizer
    from fabric_lin.data.prepared import BlockTooLong

    write_prepared(tmp_path / "val", np.arange(129, dtype=np.uint16), Tokenizer(prepared / "tok300"), item=65,
                   chunk_size=65, recipe="text", split="val", val_fraction=0.005)
    assert str(BlockTooLong(tmp_path / "val", 129)).endswith(
        "and its largest chunk file holds 65 tokens; lower train.max_seq_length or prepare the data with a larger chunk_size")


def test_validation_covers_the_same_tokens_whatever_the_micro_batch_and_processes(prepared):
    """pretrain's validate reads eval.max_iters global batches: the mean cross-entropy of the first max_iters x
    global_batch_size blocks of the split whatever the micro batch size and the number of processes (each process's
    share weighted by its tokens, as the all-reduce adds them up), and of the whole split, each block once, where it
    holds fewer; against the cross-entropy of the model's logits over litdata's own reading of the blocks."""
    from types import SimpleNamespace

    import lightning_fabric as L
    import numpy as np
    import torch
    import torch.nn.functional as F

    from fabric_lin.data.base import token_val_loader
    from fabric_lin.model import GPT
    from fabric_lin.pretrain import validate
    from fabric_lin.stopping import StopRequest

    path, seq, global_batch = prepared / "tokens", 31, 12  # blocks of 32 tokens: 31 per chunk file, 124 in all
    torch.manual_seed(0)
    model = GPT(Config.from_name("gla-debug", vocab_size=300, num_layers=1))
    blocks = torch.from_numpy(np.stack([np.frombuffer(b, dtype=np.int64) for b in litdata_blocks(path, seq + 1)]))
    fabric = L.Fabric(accelerator="cpu", devices=1)
    for max_iters, covered in ((2, 24), (50, len(blocks))):
        with torch.no_grad():
            expected = F.cross_entropy(model(blocks[:covered, :-1]).flatten(0, 1), blocks[:covered, 1:].flatten()).item()
        for micro_batch, world_size in ((12, 1), (4, 1), (3, 2), (2, 3)):
            loss_sum = tokens = 0
            for rank in range(world_size):  # each process's validate; the all-reduce of one process is the identity
                loader = token_val_loader(path, seq + 1, micro_batch, 0)
                loader.rank_and_world = (rank, world_size)
                run = SimpleNamespace(val_dataloader=loader, eval=EvalArgs(max_iters=max_iters), cuda_graphs=False,
                                      train=TrainArgs(micro_batch_size=micro_batch),
                                      accumulation=global_batch // (micro_batch * world_size), eos_id=None,
                                      stop=StopRequest())
                loss, n = validate(fabric, model, run)
                loss_sum, tokens = loss_sum + loss * n, tokens + n
            layout = f"max_iters {max_iters}, micro batch {micro_batch}, {world_size} process(es)"
            assert tokens == covered * seq, layout
            assert loss_sum / tokens == pytest.approx(expected, rel=1e-5), layout


def test_a_recipe_s_loader_workers_on_fewer_cores_start_one_per_core(tmp_path, prepared, monkeypatch, capsys):
    """data.num_workers 4 (a recipe's 8, say) on a CPU run that may use one core: the training loader starts one
    worker, in one line that says so, and hyperparameters.yaml keeps the 4 asked, which a larger machine runs."""
    import torch.utils.data
    import yaml

    import fabric_lin.cpu_cores
    from fabric_lin.data import TokenChunks

    started = []
    data_loader_init = torch.utils.data.DataLoader.__init__

    def recorded(self, *args, **kwargs):
        started.append(kwargs["num_workers"])
        data_loader_init(self, *args, **kwargs)

    monkeypatch.setattr(torch.utils.data.DataLoader, "__init__", recorded)
    monkeypatch.setattr(fabric_lin.cpu_cores, "usable_cpu_cores", lambda: 1)
    setup_pretrain(tmp_path, data=TokenChunks(data_path=prepared / "tokens300", num_workers=4),
                   model_config=Config.from_name("gla-debug", vocab_size=320), model_name=None)
    assert started == [1]
    assert "Note: data.num_workers 4: 1 loader worker, one per CPU core this process may use" in capsys.readouterr().out
    hparams = yaml.safe_load((tmp_path / "out" / "final" / "hyperparameters.yaml").read_text())
    assert hparams["data"]["init_args"]["num_workers"] == 4
