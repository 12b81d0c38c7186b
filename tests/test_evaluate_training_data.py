"""evaluate on the data its model was trained on: the weights record their training data (trained_with.json's "data",
written by pretrain and carried by the converters; a checkpoint from before that record, its hyperparameters.yaml), and
validation data that is that data (the same directory, a copy or a moved one with the same index.json, or documents of
the same input) is said in one Warning line naming both: its loss is no held-out loss. The run's own held-out data, and
data of other documents, say nothing."""
import hashlib
import json
import shutil

import pytest
import yaml

from conftest import train_evaluate_run
from fabric_lin.checkpoint_kinds import recorded_training_data
from fabric_lin.convert.pretrained_checkpoint import convert_pretrained_checkpoint
from fabric_lin.data import TokenChunks
from fabric_lin.evaluate import main as evaluate

NOT_HELD_OUT = "the loss on it is not a held-out loss"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """conftest's train_evaluate_run (TokenChunks: train/ to train on, val/ to validate on), and its final checkpoint
    converted into a model directory, model/."""
    root = train_evaluate_run(tmp_path_factory.mktemp("trained_on"))
    convert_pretrained_checkpoint(root / "out" / "final", root / "model")
    return root


def warnings_of(weights, val_path, out_dir, capsys):
    capsys.readouterr()
    evaluate(weights, data=TokenChunks(val_path=val_path, num_workers=0), max_batches=1, out_dir=out_dir, device="cpu")
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("Warning")]


def test_the_weights_record_the_data_they_were_trained_on(run):
    """The index.json digest, against sha256 of the file; the directory as the run named it, absolute; what its
    prepared.json says of the input (helpers.write_prepared: recipe "test" alone)."""
    index = hashlib.sha256((run / "train" / "index.json").read_bytes()).hexdigest()[:16]
    for weights in (run / "out" / "final", run / "model"):
        recorded = json.loads((weights / "trained_with.json").read_text())["data"]
        assert recorded == [{"dir": str(run / "train"), "index": index, "documents": {"recipe": "test"}}]


def test_evaluating_on_the_training_data_is_one_warning_line(run, tmp_path, capsys):
    final, model = run / "out" / "final", run / "model"
    assert warnings_of(final, run / "train", tmp_path / "a", capsys) == [
        f"Warning: --data: {run / 'train'} is the data the model was trained on (as {final / 'trained_with.json'} "
        f"records): {NOT_HELD_OUT}"]
    shutil.copytree(run / "train", tmp_path / "copy")
    assert warnings_of(model, tmp_path / "copy", tmp_path / "b", capsys) == [
        f"Warning: --data: {tmp_path / 'copy'} holds documents of {run / 'train'}, which the model was trained on: their "
        f"index.json is the same, one data set (as {model / 'trained_with.json'} records): {NOT_HELD_OUT}"]
    # the run's own held-out data, and data of other documents: nothing said
    assert warnings_of(final, run / "val", tmp_path / "c", capsys) == []
    capsys.readouterr()
    evaluate(final, max_batches=1, out_dir=tmp_path / "d", device="cpu")
    assert "Warning" not in capsys.readouterr().out


def test_a_checkpoint_without_the_record_is_compared_by_its_hyperparameters(run, tmp_path):
    """A training checkpoint written before trained_with.json recorded the data: the training directories of the data
    module its hyperparameters.yaml names, as they are now."""
    old = tmp_path / "final"
    shutil.copytree(run / "out" / "final", old)
    record = json.loads((old / "trained_with.json").read_text())
    (old / "trained_with.json").write_text(json.dumps({"tokenizer": record["tokenizer"]}))
    hparams = yaml.safe_load((old / "hyperparameters.yaml").read_text())
    assert recorded_training_data(old, hparams) == (record["data"], old / "hyperparameters.yaml")
    assert recorded_training_data(run / "model", None)[1] == run / "model" / "trained_with.json"
    assert recorded_training_data(old, None) == ([], None)


def test_a_run_from_earlier_weights_records_their_data_first(run):
    """--resume's or --initial_checkpoint_dir's weights were trained on their data: the run's record holds it, then
    this run's, each entry once (a resume on the same data adds none)."""
    from fabric_lin.run_start import with_training_data

    class Data:
        def __init__(self, record):
            self.record = record

        def training_data_record(self):
            return self.record

    earlier = json.loads((run / "model" / "trained_with.json").read_text())
    tokenizer = {"tokenizer": earlier["tokenizer"]}
    other = {"dir": "/data/other", "index": "0" * 16, "documents": {}}
    assert with_training_data(tokenizer, Data([other]), run / "model") == {**tokenizer, "data": earlier["data"] + [other]}
    assert with_training_data(tokenizer, Data(earlier["data"]), run / "model") == earlier
    assert with_training_data(tokenizer, Data([other]), None) == {**tokenizer, "data": [other]}
    assert with_training_data(None, Data([other]), run / "model") is None
