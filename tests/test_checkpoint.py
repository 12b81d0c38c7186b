"""The training-checkpoint format (`fabric_lin.checkpoint`): atomic step directories, finding the one to
resume from, pruning, RNG states, and the round trip of a train state through save and load. (Reading a
checkpoint's model weights, single-file and FSDP-sharded: test_convert_pretrained_checkpoint.py.)"""
import json
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from fabric_lin.checkpoint import (
    CONFIG_FILE,
    HPARAMS_FILE,
    MODEL_FILE,
    STEP_FILE,
    Checkpointer,
    find_resume_dir,
    final_checkpoint_step,
    get_rng_states,
    load_train_state,
    prune_checkpoints,
    set_rng_states,
    step_checkpoints,
    train_state,
)
from fabric_lin.config import Config


def _make_ckpt(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "lit_model.pth").write_bytes(b"x")
    return d


def test_find_resume_dir(tmp_path):
    assert find_resume_dir("auto", tmp_path) is None
    assert find_resume_dir(False, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="--resume true: no checkpoint"):
        find_resume_dir(True, tmp_path)
    _make_ckpt(tmp_path, "step-00000002")
    _make_ckpt(tmp_path, "step-00000010")
    _make_ckpt(tmp_path, ".tmp-step-00000012")  # interrupted save: never chosen
    (tmp_path / "step-00000011").mkdir()  # no lit_model.pth: not complete
    assert find_resume_dir("auto", tmp_path) == tmp_path / "step-00000010"
    assert find_resume_dir(True, tmp_path) == tmp_path / "step-00000010"
    # a path: the directory or the lit_model.pth in it
    assert find_resume_dir(tmp_path / "step-00000002", tmp_path) == tmp_path / "step-00000002"
    assert find_resume_dir(tmp_path / "step-00000002" / "lit_model.pth", tmp_path) == tmp_path / "step-00000002"
    with pytest.raises(FileNotFoundError, match="step-00000011"):
        find_resume_dir(tmp_path / "step-00000011", tmp_path)
    final = _make_ckpt(tmp_path, "final")  # without step.json (older runs): taken as the newest
    assert find_resume_dir("auto", tmp_path) == tmp_path / "final"
    # a run extended past its first max_steps saves step-* directories after its old final/
    (final / "step.json").write_text('{"step_count": 4}')
    assert find_resume_dir("auto", tmp_path) == tmp_path / "step-00000010"
    (final / "step.json").write_text('{"step_count": 10}')  # a tie: final/, whose validation is done
    assert find_resume_dir(True, tmp_path) == tmp_path / "final"


def test_prune_keeps_newest(tmp_path):
    for step in (2, 4, 6, 8):
        _make_ckpt(tmp_path, f"step-{step:08d}")
    prune_checkpoints(tmp_path, keep_last_n=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000006", "step-00000008"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_rng_states_round_trip():
    import random

    import numpy as np

    states = get_rng_states()
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_states(states)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a


def small_state(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_save_writes_a_complete_directory_then_load_restores_the_state(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={"samples": 12})
    state.update(iter_num=6, step_count=3, skipped_steps=1)
    config = Config.from_name("gla-debug")
    hparams = {"model_name": "gla-debug", "out_dir": str(tmp_path), "train": {"max_steps": 5}}
    checkpointer = Checkpointer(tmp_path, hparams, config, keep_last_n=2)
    saved = checkpointer.save(fabric, state)
    assert saved == tmp_path / "step-00000003"
    assert {p.name for p in saved.iterdir()} == {MODEL_FILE, STEP_FILE, HPARAMS_FILE, CONFIG_FILE}
    assert json.loads((saved / STEP_FILE).read_text()) == {"step_count": 3}
    assert yaml.safe_load((saved / HPARAMS_FILE).read_text()) == hparams
    assert Config.from_checkpoint(saved) == config
    assert not list(tmp_path.glob(".tmp-*"))
    after_save = torch.rand(3)  # what the generator gives next, from the saved RNG state

    # a fresh model and optimizer, restored from the checkpoint
    other_model, other_optimizer = small_state(1)
    restored = train_state(other_model, other_optimizer, train_dataloader={"samples": 0})
    load_train_state(fabric, saved, restored)
    assert (restored["iter_num"], restored["step_count"], restored["skipped_steps"]) == (6, 3, 1)
    assert restored["train_dataloader"] == {"samples": 12}
    for a, b in zip(other_model.parameters(), model.parameters()):
        assert torch.equal(a, b)
    moments = other_optimizer.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], optimizer.state_dict()["state"][i]["exp_avg"]) for i in moments)
    assert torch.equal(torch.rand(3), after_save)

    # more saves: keep_last_n step directories stay; final/ is not pruned and is the newest
    for step in (4, 5):
        state["step_count"] = step
        checkpointer.save(fabric, state)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000004", "step-00000005"]
    checkpointer.save(fabric, state, final=True)
    assert final_checkpoint_step(tmp_path) == 5 and find_resume_dir("auto", tmp_path) == tmp_path / "final"
    assert len(step_checkpoints(tmp_path)) == 2 and not list(tmp_path.glob(".tmp-*"))


def test_save_replaces_a_directory_of_the_same_step_and_a_leftover_temporary_one(tmp_path):
    """A resumed run passing a step it saved before, after a kill that left its .tmp- directory."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={})
    state["step_count"] = 2
    checkpointer = Checkpointer(tmp_path, {}, Config.from_name("gla-debug"))
    (tmp_path / "step-00000002").mkdir(parents=True)
    (tmp_path / "step-00000002" / "stale.txt").write_text("from before")
    (tmp_path / ".tmp-step-00000002").mkdir()
    (tmp_path / ".tmp-step-00000002" / "half.bin").write_bytes(b"x")
    checkpointer.save(fabric, state)
    assert not (tmp_path / "step-00000002" / "stale.txt").exists()
    assert (tmp_path / "step-00000002" / MODEL_FILE).is_file() and not list(tmp_path.glob(".tmp-*"))


def test_load_of_a_model_directory_points_to_initial_checkpoint_dir(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = small_state(0)
    torch.save(model.state_dict(), tmp_path / MODEL_FILE)  # a model directory: the weights alone
    with pytest.raises(ValueError, match=rf"not a training checkpoint .*use --initial_checkpoint_dir {tmp_path}"):
        load_train_state(fabric, tmp_path, train_state(model, optimizer, {}))
