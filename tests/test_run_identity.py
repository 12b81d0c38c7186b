"""fabric_lin/run_identity.py, through pretrain's setup: what a resume may change (--resume_changes: the global
batch size, the step or token budget, the data) and what it may not (the model, the sequence length), each refusal
naming the values; other settings (the optimizer's, the micro batch size) pass with a note. A run resumed with a
larger global batch counts its tokens on and keeps the schedule in tokens; one resumed with another micro batch
size trains on the same samples and validates on the same blocks. The comparison on the files alone: what is no
change (a tuple read back as a list, the model's name, the loader workers, where the attempt writes and what it
resumes) and what is (another data module, a setting the checkpoint's file lacks); another sequence length refused
naming that flag alone."""
import json

import pytest
import torch

from conftest import logged_data_fingerprints
from fabric_lin.args import EvalArgs, OptimizerArgs, TrainArgs
from fabric_lin.config import Config
from fabric_lin.lr_schedule import learning_rate
from fabric_lin.model import GPT
from helpers import cli_error, logged_losses, metrics_records, setup_pretrain


def test_resume_with_another_global_batch_size_refuses_in_one_line(tmp_path, capsys):
    train = ["--train.max_steps", "1", "--train.micro_batch_size", "2", "--train.max_seq_length", "32"]
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    base = ["pretrain", "--out_dir", str(tmp_path / "again"), "--resume", str(final), "--logger_name", "csv", *train]
    err = cli_error([*base, "--model_name", "gla-debug", "--train.global_batch_size", "4"], capsys)
    assert err == (f"fabric-lin pretrain: error: --resume {final}: this run differs from the checkpoint's in "
                   f"train.global_batch_size: 2 in the checkpoint, 4 here. Resume with the checkpoint's values (its "
                   f"hyperparameters.yaml), or change them on purpose with --resume_changes '[train.global_batch_size]' "
                   f"(tutorials/resume.md says what then happens)\n")
    err = cli_error([*base, "--model_name", "gla-debug", "--train.global_batch_size", "2", "--resume_changes", "[optimizer.lr]"], capsys)
    assert err == ("fabric-lin pretrain: error: --resume_changes optimizer.lr: expected names among train.global_batch_size, "
                   "train.max_steps, train.max_tokens, data, seed\n")


def test_resume_with_another_model_refuses_naming_the_fields(tmp_path):
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with pytest.raises(ValueError, match=rf"--resume {final}: a resumed run trains the checkpoint's run, and this one differs in "
                       r"model: num_layers 4 in the checkpoint, 1 here; train.max_seq_length: 32 in the checkpoint, 16 here\. "
                       r"Resume it with the checkpoint's --model_name gla-debug --train.max_seq_length 32, or start this run "
                       r"without --resume \(the checkpoint's weights do not fit this model's shapes, so they cannot start it "
                       r"either\)"):
        setup_pretrain(tmp_path, out_dir=tmp_path / "again", resume=final, model_name=None,
               model_config=Config.from_name("gla-debug", num_layers=1),
               train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=16))
    # weights of the same shapes can start a new run of the other model (continued pretraining)
    with pytest.raises(ValueError, match=r"model: head_norm_eps 1e-06 in the checkpoint, 1e-05 here, norm_eps 1e-06 in the checkpoint, "
                       r"1e-05 here\. Resume it with the checkpoint's "
                       r"--model_name gla-debug, or start this run without --resume; or start this run from its weights: "
                       rf"fabric-lin convert_pretrained_checkpoint {final} --output_dir <DIR>, then --initial_checkpoint_dir <DIR>$"):
        setup_pretrain(tmp_path, out_dir=tmp_path / "again", resume=final, model_name=None,
                       model_config=Config.from_name("gla-debug", norm_eps=1e-5))
    # from another out_dir, a new run goes without --resume (above); in the checkpoint's own, to another out_dir
    with pytest.raises(ValueError, match=r"Resume it with the checkpoint's --train.max_seq_length 32, or write this run to "
                                         r"another --out_dir; or start this run from its weights"):
        setup_pretrain(tmp_path, resume="auto",
                       train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=1, max_seq_length=16))


def test_resume_in_another_data_order_is_refused_naming_the_value(tmp_path):
    from fabric_lin.data import SampleCorpus

    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    final = tmp_path / "out" / "final"
    with pytest.raises(ValueError, match=rf"--resume {final}: this run differs from the checkpoint's in data.seed: 42 in the "
                       r"checkpoint, 7 here. Resume with the checkpoint's values \(its hyperparameters.yaml\), or change them "
                       r"on purpose with --resume_changes '\[data\]'"):
        setup_pretrain(tmp_path, out_dir=tmp_path / "again", resume=final, data=SampleCorpus(seed=7), eval=EvalArgs(final_validation=False))


def test_resume_with_other_optimizer_settings_passes_with_a_note(tmp_path, capsys):
    """The optimizer's settings are not the run's identity: a resume may change them, says so in one note, and trains
    with them (the optimizer state loaded from the checkpoint holds the checkpoint's weight decay, betas and eps)."""
    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    capsys.readouterr()
    setup_pretrain(tmp_path, resume=tmp_path / "out" / "final", out_dir=tmp_path / "again", resume_changes=["train.max_steps"],
           optimizer=OptimizerArgs(lr=1e-4, weight_decay=0.5, betas=(0.8, 0.9), eps=1e-6),
           eval=EvalArgs(final_validation=False, interval=5),
           train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32))
    out = capsys.readouterr().out
    assert ("Note: resuming with other settings than the checkpoint's: eval.interval: 1000 in the checkpoint, 5 here; "
            "optimizer.betas: [0.9, 0.95] in the checkpoint, [0.8, 0.9] here; optimizer.eps: 1e-08 in the checkpoint, "
            "1e-06 here; optimizer.lr: 0.0004 in the checkpoint, 0.0001 here; optimizer.weight_decay: 0.1 in the "
            "checkpoint, 0.5 here") in out
    assert "Resuming with a change of the run (--resume_changes): train.max_steps: 1 in the checkpoint, 2 here" in out
    assert json.loads((tmp_path / "again" / "final" / "step.json").read_text())["step_count"] == 2
    groups = torch.load(tmp_path / "again" / "final" / "lit_model.pth", weights_only=True)["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in groups] == [(0.5, (0.8, 0.9), 1e-6),
                                                                                  (0.0, (0.8, 0.9), 1e-6)]


def test_initial_checkpoint_dir_given_to_a_resume_is_said_to_be_left_unread(tmp_path, capsys, monkeypatch):
    """--initial_checkpoint_dir starts a new run's weights; a resume takes them from its checkpoint. Given to a resume
    where the checkpoint's run had none, it is not read, and the note says so rather than list it as a setting in use."""
    from fabric_lin import model_setup
    from fabric_lin.convert.model_dir import save_model_dir

    setup_pretrain(tmp_path, eval=EvalArgs(final_validation=False))
    (tmp_path / "model").mkdir()
    save_model_dir(GPT(Config.from_name("gla-debug")).state_dict(), Config.from_name("gla-debug"), tmp_path / "model")

    def read(*args, **kwargs):
        raise AssertionError("the initial weights were read")

    monkeypatch.setattr(model_setup, "load_initial_weights", read)
    capsys.readouterr()
    setup_pretrain(tmp_path, resume="auto", initial_checkpoint_dir=tmp_path / "model", resume_changes=["train.max_steps"],
                   train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32),
                   eval=EvalArgs(final_validation=False))
    assert (f"Note: resuming with other settings than the checkpoint's: initial_checkpoint_dir: None in the checkpoint, "
            f"'{tmp_path / 'model'}' here (not read: a resume's weights are its checkpoint's)") in capsys.readouterr().out


def test_a_resume_goes_on_when_the_model_directory_it_started_from_is_gone(tmp_path):
    """A run started from --initial_checkpoint_dir resumes with the same recipe after that model directory was deleted:
    the resume does not read it. A fresh start (--resume auto into an out_dir with no checkpoint) still needs it."""
    import shutil

    from fabric_lin.convert.model_dir import save_model_dir
    from fabric_lin.errors import MissingFile

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    save_model_dir(GPT(Config.from_name("gla-debug")).state_dict(), Config.from_name("gla-debug"), model_dir)
    setup_pretrain(tmp_path, initial_checkpoint_dir=model_dir, eval=EvalArgs(final_validation=False))
    shutil.rmtree(model_dir)
    setup_pretrain(tmp_path, resume="auto", initial_checkpoint_dir=model_dir, resume_changes=["train.max_steps"],
                   train=TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32),
                   eval=EvalArgs(final_validation=False))
    assert max(logged_losses(tmp_path / "out")) == 2
    with pytest.raises(MissingFile, match=f"--initial_checkpoint_dir '{model_dir}' is not a directory"):
        setup_pretrain(tmp_path, resume="auto", initial_checkpoint_dir=model_dir, out_dir=tmp_path / "fresh")


def test_the_hyperparameters_yaml_of_a_run_resumed_from_a_named_checkpoint_continues_it(tmp_path, capsys):
    """A run resumed from a named earlier checkpoint (step 1 of 2, as back before a loss spike) recorded that --resume in
    its hyperparameters.yaml: `--config <its final>/hyperparameters.yaml` went back to step 1 once more and set the
    checkpoints saved since aside. The file records `resume: auto`, and continues the run from its newest checkpoint,
    and records neither --overwrite nor --resume_changes, which the first two commands were given."""
    import yaml

    from fabric_lin.cli import main as cli_main

    out, no_validation = tmp_path / "out", EvalArgs(final_validation=False)
    train = TrainArgs(global_batch_size=2, micro_batch_size=2, max_steps=2, max_seq_length=32, save_interval=1)
    setup_pretrain(tmp_path, train=train, eval=no_validation, overwrite=True)
    setup_pretrain(tmp_path, train=train, resume=out / "step-00000001", eval=no_validation,
                   resume_changes=["train.max_steps"])
    hparams = out / "final" / "hyperparameters.yaml"
    recorded = yaml.safe_load(hparams.read_text())
    assert recorded["resume"] == "auto"
    # actions of the command that ran, not settings of the run: `--config` with the file neither deletes the run
    # (overwrite) nor lets a setting change unasked (resume_changes)
    assert "overwrite" not in recorded and "resume_changes" not in recorded
    checkpoints = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    cli_main(["pretrain", "--config", str(hparams)])
    assert "Nothing to train: the checkpoint is at step 2" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == checkpoints  # none set aside


def test_a_larger_global_batch_on_resume_keeps_tokens_and_the_schedule_in_tokens(tmp_path, capsys):
    """Four steps of 2 x 32 tokens, then with --resume_changes a global batch of 4 to the end of a 512-token
    budget: two more steps of 128 tokens. The tokens count on, the learning rate is the schedule's at the
    tokens trained on (in steps of the first size), and the change is logged."""
    common = dict(eval=EvalArgs(final_validation=False), optimizer=OptimizerArgs(lr=1e-3))
    train = dict(micro_batch_size=2, max_seq_length=32, lr_warmup_steps=2, min_lr=1e-4, log_interval=1)
    setup_pretrain(tmp_path, train=TrainArgs(global_batch_size=2, max_tokens=256, **train), **common)
    final = tmp_path / "out" / "final"
    capsys.readouterr()
    setup_pretrain(tmp_path, resume=final, resume_changes=["train.global_batch_size", "train.max_tokens"],
           train=TrainArgs(global_batch_size=4, max_tokens=512, **train), **common)
    out = capsys.readouterr().out
    assert "Training finished: 512 tokens in total (256 in this run) | elapsed " in out
    assert " tokens/s after the first step (compilation and warm-up left out, as are validation and saving)" in out
    assert "Resuming with a change of the run (--resume_changes): train.global_batch_size: 2 in the checkpoint, 4 here" in out
    assert "Resuming with a change of the run (--resume_changes): train.max_tokens: 256 in the checkpoint, 512 here" in out
    records = metrics_records(tmp_path / "out")
    losses = [r for r in records if "loss" in r and "lr" in r]
    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5, 6]
    tokens = {r["step"]: r["tokens"] for r in records if "tokens" in r}
    assert tokens == {1: 64, 2: 128, 3: 192, 4: 256, 5: 384, 6: 512}
    # the first attempt's schedule: 4 steps; then, stretched to 512 tokens, 8 steps of 64 tokens, in which
    # steps 5 and 6 start at 256 and 384 tokens: positions 4 and 6
    expected = [learning_rate(position, 1e-3, 1e-4, 2, 4) for position in range(4)]
    expected += [learning_rate(position, 1e-3, 1e-4, 2, 8) for position in (4, 6)]
    assert [r["lr"] for r in losses] == pytest.approx(expected, rel=1e-12)
    (change,) = [r for r in records if "resume_changes" in r]
    assert change["step"] == 4 and change["attempt"] == 2 and len(change["resume_changes"]) == 2
    # the next resume goes on from the new batch size without naming it again
    setup_pretrain(tmp_path, resume=final, resume_changes=["train.max_tokens"],
           train=TrainArgs(global_batch_size=4, max_tokens=1024, **train), **common)
    tokens = {r["step"]: r["tokens"] for r in metrics_records(tmp_path / "out") if "tokens" in r}
    assert tokens[10] == 1024 and max(tokens) == 10


def test_resume_with_another_micro_batch_size_trains_on_the_same_samples(tmp_path):
    """The data position is one number of samples: resumed with micro batches of 1 (two per step), the
    steps after the checkpoint train on the samples the uninterrupted run (micro batches of 2) took, and its
    final validation reads the blocks the uninterrupted run's read (eval.max_iters global batches of 2)."""
    common = dict(eval=EvalArgs(final_validation=True, interval=1000, max_iters=2))
    train = dict(global_batch_size=2, max_seq_length=32, save_interval=2)
    setup_pretrain(tmp_path, out_dir=tmp_path / "whole", train=TrainArgs(micro_batch_size=2, max_steps=4, **train), **common)
    setup_pretrain(tmp_path, out_dir=tmp_path / "split", train=TrainArgs(micro_batch_size=2, max_steps=2, **train), **common)
    setup_pretrain(tmp_path, out_dir=tmp_path / "split", resume=tmp_path / "split" / "final", resume_changes=["train.max_steps"],
           train=TrainArgs(micro_batch_size=1, max_steps=4, **train), **common)
    whole, split = logged_data_fingerprints(tmp_path / "whole"), logged_data_fingerprints(tmp_path / "split")
    assert sorted(whole) == [1, 2, 3, 4] and len(set(whole.values())) == 4
    assert split == whole
    (whole_final,), split_validations = ([r for r in metrics_records(tmp_path / run) if "val_loss" in r]
                                         for run in ("whole", "split"))
    assert [r["step"] for r in split_validations] == [2, 4]
    assert whole_final["val_tokens"] == split_validations[1]["val_tokens"] == 2 * 2 * 32
    assert split_validations[1]["val_loss"] == pytest.approx(whole_final["val_loss"], rel=1e-4)


def test_the_comparison_reads_the_checkpoint_s_files_as_yaml_holds_them(tmp_path):
    """compare_with_checkpoint on the files alone: a tuple given equals the list read back, the model's name, the number
    of loader workers and other settings' values are no change of the run; another data module of the same arguments
    is; --resume_changes data lets every data.* setting pass."""
    import yaml

    from fabric_lin.run_identity import compare_with_checkpoint

    def data(module="fabric_lin.data.TextFiles", **init_args):
        return {"class_path": module, "init_args": {"train_dir": "/data/train", "num_workers": 8, "seed": 42, **init_args}}

    saved = {"seed": 42, "train": {"max_seq_length": 32}, "optimizer": {"betas": [0.9, 0.95]}, "data": data()}
    (tmp_path / "hyperparameters.yaml").write_text(yaml.safe_dump(saved))
    (tmp_path / "model_config.yaml").write_text(yaml.safe_dump({"name": "gla-debug", "n_embd": 64}))
    model = {"name": "", "n_embd": 64}  # the same model, given by --model_config
    same = {**saved, "optimizer": {"betas": (0.9, 0.95)}, "data": data(num_workers=2)}
    assert compare_with_checkpoint(tmp_path, same, model, allowed=[]) == ([], [])
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in data: 'fabric_lin.data.TextFiles' in the "
                       r"checkpoint, 'fabric_lin.data.TokenChunks' here\. "):
        compare_with_checkpoint(tmp_path, {**saved, "data": data("fabric_lin.data.TokenChunks")}, model, allowed=[])
    assert compare_with_checkpoint(tmp_path, {**saved, "data": data(seed=7)}, model, allowed=["data"]) == (
        ["data.seed: 42 in the checkpoint, 7 here"], [])
    # how this attempt was started is no setting of the run
    started = {"out_dir": "/runs/b", "resume": "/runs/a/final", "model_name": None,
               "model_config": "/runs/a/final/model_config.yaml"}
    assert compare_with_checkpoint(tmp_path, {**saved, **started}, model, allowed=[]) == ([], [])
    # nor is the model given field by field (--model_config FILE, as hyperparameters.yaml then holds it) where the
    # checkpoint's run named it: the model itself is compared as one
    given_as_fields = {"model_name": None, "model_config": {"name": "", "n_embd": 64}}
    assert compare_with_checkpoint(tmp_path, {**saved, "model_name": "gla-debug"}, model, allowed=[]) == ([], [])
    assert compare_with_checkpoint(tmp_path, {**saved, **given_as_fields}, model, allowed=[]) == ([], [])
    # a setting the checkpoint's file does not hold is a change too
    with pytest.raises(ValueError, match=r"differs from the checkpoint's in data.val_dir: None in the checkpoint, "
                       r"'/data/val' here\. "):
        compare_with_checkpoint(tmp_path, {**saved, "data": data(val_dir="/data/val")}, model, allowed=[])


def test_a_resume_of_another_sequence_length_names_that_flag_alone(tmp_path):
    import yaml

    from fabric_lin.run_identity import compare_with_checkpoint

    Config.from_name("gla-debug").save(tmp_path / "model_config.yaml")
    (tmp_path / "hyperparameters.yaml").write_text(yaml.safe_dump({"train": {"max_seq_length": 32}}))
    with pytest.raises(ValueError) as refused:
        compare_with_checkpoint(tmp_path, {"out_dir": str(tmp_path.parent), "train": {"max_seq_length": 16}},
                                Config.from_name("gla-debug").to_dict(), [])
    assert str(refused.value) == (
        f"--resume {tmp_path}: a resumed run trains the checkpoint's run, and this one differs in train.max_seq_length: "
        f"32 in the checkpoint, 16 here. Resume it with the checkpoint's --train.max_seq_length 32, or write this run to "
        f"another --out_dir; or start this run from its weights: fabric-lin convert_pretrained_checkpoint {tmp_path} "
        f"--output_dir <DIR>, then --initial_checkpoint_dir <DIR>")


def test_naming_one_change_of_the_run_lets_that_one_pass_and_no_other(tmp_path):
    """The seed of the weights is part of the run: another one is refused unless --resume_changes names it, and naming
    another change (the step budget) does not let it pass. The micro batch size and the schedule's shape are no change
    of the run: they pass, reported."""
    import yaml

    from fabric_lin.run_identity import compare_with_checkpoint

    train = {"max_seq_length": 32, "max_steps": 10, "micro_batch_size": 2, "lr_schedule": "cosine"}
    saved = {"seed": 42, "train": train}
    (tmp_path / "hyperparameters.yaml").write_text(yaml.safe_dump(saved))
    (tmp_path / "model_config.yaml").write_text(yaml.safe_dump({"name": "gla-debug", "n_embd": 64}))
    model = {"name": "gla-debug", "n_embd": 64}
    seed_refused = (r"differs from the checkpoint's in seed: 42 in the checkpoint, 7 here\. Resume with the checkpoint's "
                    r"values \(its hyperparameters.yaml\), or change them on purpose with --resume_changes '\[seed\]'")
    with pytest.raises(ValueError, match=seed_refused):
        compare_with_checkpoint(tmp_path, {**saved, "seed": 7}, model, allowed=[])
    with pytest.raises(ValueError, match=seed_refused):
        compare_with_checkpoint(tmp_path, {"seed": 7, "train": {**train, "max_steps": 20}}, model,
                                allowed=["train.max_steps"])
    assert compare_with_checkpoint(tmp_path, {"seed": 7, "train": {**train, "max_steps": 20}}, model,
                                   allowed=["train.max_steps", "seed"]) == (
        ["seed: 42 in the checkpoint, 7 here", "train.max_steps: 10 in the checkpoint, 20 here"], [])
    assert compare_with_checkpoint(tmp_path, {**saved, "train": {**train, "micro_batch_size": 1, "lr_schedule": "wsd"}},
                                   model, allowed=[]) == (
        [], ["train.lr_schedule: 'cosine' in the checkpoint, 'wsd' here", "train.micro_batch_size: 2 in the checkpoint, 1 here"])
