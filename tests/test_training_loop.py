"""pretrain's loop in this process against a training loop written out here: gla-debug on the sample corpus, fp32 on
the CPU, a global batch of 4 in 2 micro batches of 2 (gradient accumulation 2), 3 steps of a cosine schedule with
one warmup step, clipping that takes effect. The reference reads the data module's own training loader, averages
the micro batches' losses, clips the gradients' norm, sets each step's learning rate (computed by hand) before
AdamW's update; the run must log the same loss, learning rate, gradient norm (before clipping) and data checksum at
every step, validate on the validation split, and end with the same weights. A stop asked for in the middle of a
step's micro batches saves that step whole, at the step boundary; one asked for during a validation ends it and saves
the step it followed."""
import os
import signal

import pytest
import torch

from fabric_lin.args import EvalArgs, OptimizerArgs, TrainArgs
from fabric_lin.batches import batch_fingerprint
from fabric_lin.config import Config
from fabric_lin.data import SampleCorpus
from fabric_lin.model import GPT
from helpers import final_weights, load_whole_checkpoint, metrics_records, setup_pretrain

SEED, BASE_LR, MIN_LR, MAX_NORM, SEQ = 42, 3e-3, 3e-4, 0.5, 32
# 1 warmup step, then a cosine over the 2 steps left that reaches min_lr at the end of the run (step 3): step 0 warms up
# to the base, step 1 starts the cosine at the base, step 2 is halfway down (cos(pi / 2) = 0)
LEARNING_RATES = [BASE_LR, BASE_LR, (BASE_LR + MIN_LR) / 2]
TRAIN = TrainArgs(global_batch_size=4, micro_batch_size=2, max_steps=3, max_seq_length=SEQ, lr_warmup_steps=1,
                  min_lr=MIN_LR, max_norm=MAX_NORM)
# AdamW's eps at 1e-4, as in test_pretrain_sharded.py: with 1e-8 a gradient component near zero, whose last bits
# follow the order of the sums, becomes an update of up to +-lr, and the two loops' weights differ by up to 1e-5 after
# 3 steps; with 1e-4 by 1.5e-6, well below one step's update of up to the learning rate (3e-3).
OPTIMIZER = OptimizerArgs(lr=BASE_LR, eps=1e-4)
WEIGHT_ATOL = 1e-5


def reference_training():
    """The reference loop's per-step losses, gradient norms, data checksums and weights after the step, and the
    validation loss at the end."""
    from fabric_lin.model_setup import no_decay_parameter_names
    from fabric_lin.run_start import load_tokenizer

    config = Config.from_name("gla-debug")
    data = SampleCorpus()
    data.prepare_data()
    data.connect(tokenizer=load_tokenizer(data.tokenizer_dir), batch_size=TRAIN.micro_batch_size, max_seq_length=SEQ,
                 vocab_size=config.vocab_size)
    data.setup()
    torch.manual_seed(SEED)
    model = GPT(config)
    no_decay = no_decay_parameter_names(model)
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in model.named_parameters() if n not in no_decay], "weight_decay": OPTIMIZER.weight_decay},
         {"params": [p for n, p in model.named_parameters() if n in no_decay], "weight_decay": 0.0}],
        lr=BASE_LR, betas=tuple(OPTIMIZER.betas), eps=OPTIMIZER.eps, fused=True,
    )
    batches = iter(data.train_dataloader())
    losses, norms, fingerprints, weights = [], [], [], []
    for lr in LEARNING_RATES:
        for group in optimizer.param_groups:
            group["lr"] = lr
        step_loss, fingerprint = 0.0, torch.zeros((), dtype=torch.int64)  # the checksums' sum wraps around in int64
        for _ in range(2):
            batch = next(batches)
            fingerprint += batch_fingerprint(batch)
            loss = model(batch[:, :SEQ], targets=batch[:, 1:])
            (loss / 2).backward()
            step_loss += loss.item() / 2
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        fingerprints.append(int(fingerprint))
        weights.append({name: value.clone() for name, value in model.state_dict().items()})
    model.eval()
    with torch.no_grad():  # eval.max_iters 1: one global batch, the first 4 blocks of the validation split
        val = [model(b[:, :-1], targets=b[:, 1:]).item() for _, b in zip(range(2), data.val_dataloader())]
    return losses, norms, fingerprints, weights, sum(val) / len(val)


@pytest.fixture(scope="module")
def reference():
    return reference_training()


def test_the_loop_trains_as_the_reference_loop(tmp_path, reference):
    losses, norms, fingerprints, weights, val_loss = reference
    assert all(norm > MAX_NORM for norm in norms)  # the clipping takes effect at every step
    setup_pretrain(tmp_path, train=TRAIN, optimizer=OPTIMIZER, seed=SEED,
                   eval=EvalArgs(interval=1000, max_iters=1, final_validation=True))
    records = metrics_records(tmp_path / "out")
    steps = [r for r in records if "data_fingerprint" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert [r["data_fingerprint"] for r in steps] == fingerprints
    assert [r["lr"] for r in steps] == pytest.approx(LEARNING_RATES, rel=1e-12)
    assert [r["loss"] for r in steps] == pytest.approx(losses, rel=1e-6)
    assert [r["grad_norm"] for r in steps] == pytest.approx(norms, rel=1e-5)
    assert [r["val_loss"] for r in records if "val_loss" in r] == [pytest.approx(val_loss, rel=1e-6)]
    got = final_weights(tmp_path / "out")
    assert got.keys() == weights[-1].keys()
    for name, value in weights[-1].items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)


def test_a_stop_asked_for_between_micro_batches_saves_the_whole_step(tmp_path, monkeypatch, capsys, reference):
    """SIGUSR1 while step 2's first micro batch is computed: the step's second micro batch and update are still made,
    step-00000002/ holds the reference's weights after 2 steps and the data position after 2 whole steps."""
    import fabric_lin.pretrain as pretrain

    micro_batches = []

    def loss_then_signal(*args, **kwargs):
        micro_batches.append(None)
        if len(micro_batches) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return compute_loss(*args, **kwargs)

    compute_loss = pretrain.compute_loss
    monkeypatch.setattr(pretrain, "compute_loss", loss_then_signal)
    setup_pretrain(tmp_path, train=TRAIN, optimizer=OPTIMIZER, seed=SEED, eval=EvalArgs(final_validation=False))
    out = tmp_path / "out"
    assert "Stopped by SIGUSR1 at step 2" in capsys.readouterr().out
    assert len(micro_batches) == 4 and not (out / "final").exists()
    state = load_whole_checkpoint(out / "step-00000002" / "lit_model.pth")
    assert (state["step_count"], state["iter_num"], state["train_dataloader"]["next_position"]) == (2, 4, 8)
    _, _, fingerprints, weights, _ = reference
    assert [r["data_fingerprint"] for r in metrics_records(out) if "data_fingerprint" in r] == fingerprints[:2]
    for name, value in weights[1].items():
        torch.testing.assert_close(state["model"][name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)


@pytest.mark.parametrize("validation", ["final", "periodic"])
def test_a_stop_asked_for_during_a_validation_ends_it_and_saves_the_step(tmp_path, monkeypatch, capsys, reference,
                                                                      validation):
    """SIGUSR1 during the first of a validation's two batches, the final one (after step 3) or the one after step 2
    (eval.interval 2): the validation read no further batch and logged nothing, step-0000000N/ holds the reference's
    weights after that step and there is no final/. The final validation went on to its end and saved final/ (minutes
    on a large model, past a scheduler's wait after its signal) and printed no stop. Resumed at the last step, the run
    validates, as the reference does, and writes final/."""
    import fabric_lin.pretrain as pretrain

    calls = []
    step = 3 if validation == "final" else 2
    signal_at = 2 * step + 1  # the training steps' two micro batches each, then the validation's first batch

    def loss_then_signal(*args, **kwargs):
        calls.append(None)
        if len(calls) == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        return compute_loss(*args, **kwargs)

    compute_loss = pretrain.compute_loss
    monkeypatch.setattr(pretrain, "compute_loss", loss_then_signal)
    eval_args = EvalArgs(interval=2 if validation == "periodic" else 1000, max_iters=1, final_validation=True)
    setup_pretrain(tmp_path, train=TRAIN, optimizer=OPTIMIZER, seed=SEED, eval=eval_args)
    out = tmp_path / "out"
    during = "the final validation" if validation == "final" else "its validation"
    assert f"Stopped by SIGUSR1 at step {step} during {during}: checkpoint saved in {out / f'step-{step:08d}'}" in (
        capsys.readouterr().out)
    assert len(calls) == signal_at and not (out / "final").exists()
    assert not [r for r in metrics_records(out) if "val_loss" in r]
    state = load_whole_checkpoint(out / f"step-{step:08d}" / "lit_model.pth")
    _, _, _, weights, val_loss = reference
    for name, value in weights[step - 1].items():
        torch.testing.assert_close(state["model"][name], value, rtol=0, atol=WEIGHT_ATOL, msg=name)
    if validation == "final":
        monkeypatch.setattr(pretrain, "compute_loss", compute_loss)
        setup_pretrain(tmp_path, train=TRAIN, optimizer=OPTIMIZER, seed=SEED, eval=eval_args, resume="auto")
        assert [r["val_loss"] for r in metrics_records(out) if "val_loss" in r] == [pytest.approx(val_loss, rel=1e-6)]
        assert (out / "final").is_dir()
