"""What evaluate keeps of the validation data where Ctrl-C or SIGTERM stops it, piece by piece, on made-up losses (no
model): `evaluate_length` carries the result of the batches it had read, equal to the mean of their losses, and none
where they hold no finite loss; `write_interrupted_data_results` writes the lengths read whole and that one, names the
lengths not reached (the one being read among them where it had no batch yet), and plots the partial length as
partial. The command around them: tests/test_evaluate_errors.py."""
import contextlib
import json
import math
import sys
import types

import pytest
import torch

import fabric_lin.evaluate as evaluate
from fabric_lin.evaluate import evaluate_length, write_interrupted_data_results

SEQ_LEN, BATCH_SIZE = 8, 2


class CPU:
    """What evaluate_length asks of Fabric."""

    device = torch.device("cpu")

    def autocast(self):
        return contextlib.nullcontext()


def measure(monkeypatch, losses, rows, interrupt_at=None, said="", counted=True):
    """evaluate_length over batches of `rows` rows each (at most BATCH_SIZE), batch k's every token of loss `losses[k]`,
    with a KeyboardInterrupt(`said`) as batch `interrupt_at` (from 1) is computed; `counted`: a loader whose length is
    known. The result, or the KeyboardInterrupt raised."""
    batches = [torch.arange(n * (SEQ_LEN + 1)).reshape(n, SEQ_LEN + 1) % 7 for n in rows]
    computed = []

    def token_losses(model, inputs, targets, eos_id=None):
        computed.append(1)
        if len(computed) == interrupt_at:
            raise KeyboardInterrupt(said)
        return torch.full(inputs.shape, losses[len(computed) - 1])

    monkeypatch.setattr(evaluate, "token_losses", token_losses)
    loader = batches if counted else (batch for batch in batches)
    try:
        return evaluate_length(CPU(), None, loader, SEQ_LEN, BATCH_SIZE, None, [0, 4])
    except KeyboardInterrupt as stopped:
        return stopped


@pytest.mark.parametrize("said, counted, how, read", [("", True, "Ctrl-C", "2 of 4 batches"),
                                                      ("SIGTERM", False, "SIGTERM", "2 batches")])
def test_an_interrupted_length_carries_the_mean_of_the_batches_read(monkeypatch, said, counted, how, read):
    """Batches of 2 and 1 rows (one short) with losses 1 and 4 read, Ctrl-C (or SIGTERM) as the third is computed: the
    mean over their 3 rows, 2.0 (by position too), not over the rows of a batch more or none of them."""
    stopped = measure(monkeypatch, [1.0, 4.0, 9.0, 9.0], [2, 1, 2, 2], interrupt_at=3, said=said, counted=counted)
    measured = stopped.measured
    assert (measured["loss"], measured["tokens"], measured["batches"], measured["short_batches"]) == (2.0, 24, 2, 1)
    assert measured["by_position"]["loss"] == [2.0, 2.0] and measured["by_position"]["tokens"] == [12, 12]
    assert measured["perplexity"] == pytest.approx(math.exp(2.0))
    assert (measured["partial"], measured["read"]) == (f"interrupted ({how}) after {read}", read)


@pytest.mark.parametrize("counted, read", [(False, "1 batch"), (True, "1 of 2 batches")])
def test_one_batch_read_is_one_batch_or_one_of_the_loader_s(monkeypatch, counted, read):
    stopped = measure(monkeypatch, [3.0, 9.0], [2, 2], interrupt_at=2, counted=counted)
    assert (stopped.measured["partial"], stopped.measured["loss"]) == (f"interrupted (Ctrl-C) after {read}", 3.0)


@pytest.mark.parametrize("losses, interrupt_at", [([1.0, float("nan"), 9.0], 3), ([9.0], 1)])
def test_nothing_is_measured_of_batches_without_a_finite_loss_or_of_none(monkeypatch, losses, interrupt_at):
    """A NaN loss in the second batch (the first is checked as it is read, the rest at the end): no result, which JSON
    could not hold; none either before the first batch."""
    stopped = measure(monkeypatch, losses, [2] * len(losses), interrupt_at=interrupt_at)
    assert isinstance(stopped, KeyboardInterrupt) and not hasattr(stopped, "measured")


@pytest.fixture
def no_matplotlib(monkeypatch):
    """A stand-in for matplotlib that records the label of each line plotted."""
    labels = []

    class Axes:
        def plot(self, *args, label, **kwargs):
            labels.append(label)

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    class Figure:
        def __init__(self, *args, **kwargs):
            pass

        def subplots(self):
            return Axes()

        def savefig(self, path, **kwargs):
            open(path, "wb").close()

    monkeypatch.setitem(sys.modules, "matplotlib", types.ModuleType("matplotlib"))
    monkeypatch.setitem(sys.modules, "matplotlib.figure", types.SimpleNamespace(Figure=Figure))
    return labels


def results_of(*lengths) -> dict:
    return {"checkpoint": "/runs/out/final", "model": "gla-debug", "step": 4, "train_seq_len": SEQ_LEN,
            "lengths": list(lengths)}


def test_interrupted_in_the_first_length_its_batches_are_kept(monkeypatch, tmp_path, no_matplotlib):
    """Interrupted in the first of two lengths after two batches: their result is written, without the count of
    batches the line reports (`read`), marked partial, the second length not evaluated, and its line in the plot says
    partial."""
    stopped = measure(monkeypatch, [3.0, 5.0, 9.0], [2, 2, 2], interrupt_at=3)
    results = results_of()
    write_interrupted_data_results(results, tmp_path, stopped, SEQ_LEN, [SEQ_LEN, 16], [])
    written = json.loads((tmp_path / "evaluate.json").read_text())
    assert written["partial"] == (f"the evaluation was interrupted (Ctrl-C) as it read seq_len {SEQ_LEN}: seq_len "
                                  f"{SEQ_LEN} holds its first 2 of 3 batches; seq_len 16 was not evaluated")
    assert written["not_evaluated"] == {"seq_len": [16]}
    (kept,) = written["lengths"]
    assert kept == {key: value for key, value in stopped.measured.items() if key != "read"}
    assert (kept["loss"], kept["batches"]) == (4.0, 2)
    assert stopped.kept == (f"what had been measured is in {tmp_path / 'evaluate.json'}, marked partial (seq_len "
                            f"{SEQ_LEN} over its first 2 of 3 batches): evaluate again with --overwrite true for the "
                            f"whole evaluation")
    assert no_matplotlib == [f"seq_len {SEQ_LEN} (loss 4.000, partial: 2 batches)"]
    assert (tmp_path / "loss_by_position.png").is_file()


def test_interrupted_before_a_length_s_first_batch_that_length_is_not_evaluated(monkeypatch, tmp_path, no_matplotlib):
    """The first of three lengths whole, Ctrl-C as the second's first batch is computed: the first is written whole and
    plotted as such, the second named with the third as not evaluated."""
    whole = measure(monkeypatch, [2.0, 2.0], [2, 2])
    stopped = measure(monkeypatch, [9.0], [2], interrupt_at=1)
    results = results_of(whole)
    write_interrupted_data_results(results, tmp_path, stopped, 16, [SEQ_LEN, 16, 32], ["hellaswag"])
    written = json.loads((tmp_path / "evaluate.json").read_text())
    assert written["partial"] == (f"the evaluation was interrupted (Ctrl-C) as it read seq_len 16: seq_len {SEQ_LEN} "
                                  f"is whole; seq_len 16, 32 and the tasks were not evaluated")
    assert written["not_evaluated"] == {"seq_len": [16, 32], "tasks": ["hellaswag"]}
    assert written["lengths"] == [json.loads(json.dumps(whole))]
    assert no_matplotlib == [f"seq_len {SEQ_LEN} (loss 2.000)"]
