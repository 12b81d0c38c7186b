"""The training-checkpoint format (`fabric_lin.checkpoint`): atomic step directories (every file and directory
fsynced before the rename) and their manifests (each file's CRC-32 against zlib's of the whole file, the file read
in several blocks), verification (truncated, changed in any block, missing files, a missing manifest, checkpoints
from before manifests), finding the one to resume from and falling back past damaged ones, setting aside the later ones
that a resume from an earlier one trains again, pruning (complete ones counted, a kill leaving none half-deleted under
a step-* name), a final/ saved again at its step, a checkpoint replaced or an earlier run deleted with a kill in the
middle, the tokenizer and trained_with.json saved with the weights, RNG states, the round trip of a train state
through save and load, and a disk that fills up while the small files are written: the file system's error in one line
naming the checkpoint, the one before kept. (A full disk in a run of several processes: test_save_failures.py.
Reading a checkpoint's model weights, single-file and FSDP-sharded: test_convert_pretrained_checkpoint.py.)"""
import errno
import json
import os
import random
import re
import zlib
from pathlib import Path

import lightning_fabric as L
import pytest
import torch
import yaml

import fabric_lin.checkpoint as checkpoint_module
from fabric_lin.checkpoint import (
    CONFIG_FILE,
    HPARAMS_FILE,
    MANIFEST_FILE,
    MODEL_FILE,
    STEP_FILE,
    Checkpointer,
    checkpoint_dirs,
    delete_checkpoints,
    earlier_run_checkpoints,
    file_checksum,
    explicit_resume_dir,
    select_resume_dir,
    verify_checkpoint,
    final_checkpoint_step,
    get_rng_states,
    load_train_state,
    prune_checkpoints,
    set_aside_later_checkpoints,
    set_rng_states,
    step_checkpoints,
    train_state,
)
from fabric_lin.config import Config


def _make_ckpt(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "lit_model.pth").write_bytes(b"x")
    match = re.match(r"step-(\d+)$", name)
    if match:
        (d / "step.json").write_text(json.dumps({"step_count": int(match.group(1))}))
    return d


def test_a_resume_path_without_a_checkpoint_says_what_is_there(tmp_path):
    """--resume PATH that holds no checkpoint: one not there (a mistyped step) names the checkpoints of the run directory
    it points into, one that is there what it holds (an fla export here) and what takes a model's weights. Both said
    only 'expected a checkpoint directory holding lit_model.pth'."""
    _make_ckpt(tmp_path, "step-00000002")
    _make_ckpt(tmp_path, "step-00000004")
    with pytest.raises(FileNotFoundError) as missing:
        explicit_resume_dir(tmp_path / "step-4")
    assert str(missing.value) == (f"--resume {tmp_path / 'step-4'} does not exist: expected a training checkpoint (a "
                                  f"run's step-XXXXXXXX/ or final/); {tmp_path} holds step-00000004, step-00000002")
    with pytest.raises(FileNotFoundError, match=r"does not exist: expected a training checkpoint \(a run's step-XXXXXXXX/ "
                                                r"or final/\)$"):
        explicit_resume_dir(tmp_path / "elsewhere" / "final")
    # a word that is no path, meant for one of the words --resume takes (`resume: maybe` in a config file)
    with pytest.raises(FileNotFoundError) as word:
        explicit_resume_dir("maybe")
    assert str(word.value) == ("--resume maybe does not exist: expected a training checkpoint (a run's "
                               "step-XXXXXXXX/ or final/), or false, true or auto")
    export = tmp_path / "hf"
    export.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        (export / name).write_text("")
    with pytest.raises(FileNotFoundError) as not_a_checkpoint:
        explicit_resume_dir(export)
    assert str(not_a_checkpoint.value) == (
        f"--resume {export} is not a training checkpoint: it has no lit_model.pth (it holds config.json, "
        f"model.safetensors, tokenizer.model); --resume continues a run from its step-XXXXXXXX/ or final/, and a new "
        f"run starts from a model directory's weights with --initial_checkpoint_dir")


def test_checkpoints_are_found_newest_first(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    assert select_resume_dir(fabric, "auto", tmp_path) is None and select_resume_dir(fabric, False, tmp_path) is None
    with pytest.raises(FileNotFoundError, match="--resume true: no checkpoint"):
        select_resume_dir(fabric, True, tmp_path)
    _make_ckpt(tmp_path, "step-00000002")
    _make_ckpt(tmp_path, "step-00000010")
    _make_ckpt(tmp_path, ".tmp-step-00000012")  # interrupted save: never chosen
    (tmp_path / "notes").mkdir()
    assert checkpoint_dirs(tmp_path) == [tmp_path / "step-00000010", tmp_path / "step-00000002"]
    # a path: the directory or the lit_model.pth in it
    assert explicit_resume_dir(tmp_path / "step-00000002") == tmp_path / "step-00000002"
    assert explicit_resume_dir(tmp_path / "step-00000002" / "lit_model.pth") == tmp_path / "step-00000002"
    (tmp_path / "step-00000011").mkdir()  # nothing in it
    with pytest.raises(FileNotFoundError, match="step-00000011 is not a training checkpoint: it has no lit_model.pth "
                                                r"\(it is empty\)"):
        explicit_resume_dir(tmp_path / "step-00000011")
    with pytest.raises(ValueError, match="an unfinished checkpoint"):
        explicit_resume_dir(tmp_path / ".tmp-step-00000012")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "lit_model.pth").write_bytes(b"x")  # the weights alone: a model directory
    with pytest.raises(ValueError, match=rf"it is not a training checkpoint .* use --initial_checkpoint_dir {model_dir}"):
        explicit_resume_dir(model_dir)
    final = _make_ckpt(tmp_path, "final")  # its step.json unreadable: first, so that verifying it sets it aside
    assert checkpoint_dirs(tmp_path)[0] == final and final_checkpoint_step(tmp_path) is None
    # a run extended past its first max_steps saves step-* directories after its old final/
    (final / "step.json").write_text('{"step_count": 4}')
    assert checkpoint_dirs(tmp_path)[:2] == [tmp_path / "step-00000011", tmp_path / "step-00000010"]
    (final / "step.json").write_text('{"step_count": 11}')  # a tie: final/, whose validation is done
    assert checkpoint_dirs(tmp_path)[0] == final and final_checkpoint_step(tmp_path) == 11


def test_prune_keeps_newest(tmp_path):
    for step in (2, 4, 6, 8):
        _make_ckpt(tmp_path, f"step-{step:08d}")
    prune_checkpoints(tmp_path, keep_last_n=2)
    assert [p.name for p in step_checkpoints(tmp_path)] == ["step-00000006", "step-00000008"]
    assert not list(tmp_path.glob(".tmp-*"))


def test_prune_counts_only_complete_checkpoints(tmp_path):
    """A step directory without its weights (emptied by hand, say) is not one of the newest kept: pruning to 1 keeps
    the newest complete checkpoint, and leaves the incomplete one to --resume's verification."""
    for step in (2, 4):
        _make_ckpt(tmp_path, f"step-{step:08d}")
    (tmp_path / "step-00000006").mkdir()
    prune_checkpoints(tmp_path, keep_last_n=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000006"]
    assert (tmp_path / "step-00000004" / "lit_model.pth").is_file()


def killed_while_deleting(path, *args, **kwargs):
    """shutil.rmtree killed (a second Ctrl-C, SIGKILL) after it deleted the weights of `path` and before the rest."""
    (Path(path) / "lit_model.pth").unlink()
    raise KeyboardInterrupt


def test_a_kill_while_pruning_leaves_no_step_directory_half_deleted(tmp_path, monkeypatch):
    """Killed while deleting the oldest checkpoint (its weights gone, the rest not yet): what is left under a step-*
    name is whole, the half-deleted one lies under a .tmp- name that nothing reads."""
    for step in (2, 4):
        _make_ckpt(tmp_path, f"step-{step:08d}")
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(tmp_path, keep_last_n=1)
    steps = [p for p in tmp_path.iterdir() if p.name.startswith("step-")]
    assert [p.name for p in steps] == ["step-00000004"] and (steps[0] / "lit_model.pth").is_file()


def test_a_kill_while_deleting_an_earlier_run_leaves_no_checkpoint_half_deleted(tmp_path, monkeypatch):
    """--overwrite true deletes an earlier run's checkpoints; killed while deleting one, what is left under a step-* or
    final name is whole."""
    for name in ("step-00000002", "final"):
        _make_ckpt(tmp_path, name)
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        delete_checkpoints(tmp_path)
    left = [p for p in tmp_path.iterdir() if not p.name.startswith(".tmp-")]
    assert left and all((p / "lit_model.pth").is_file() for p in left)


def test_a_resume_from_an_earlier_checkpoint_of_out_dir_sets_only_the_later_ones_aside(tmp_path):
    """Resumed from step 2 of out_dir: step 3 and final/ (at step 3) are renamed .superseded-*, step 1 and step 2 stay.
    A checkpoint of another directory sets nothing of out_dir aside: out_dir's checkpoints are not of its run."""
    out = tmp_path / "out"
    for step in (1, 2, 3):
        _make_ckpt(out, f"step-{step:08d}")
    (_make_ckpt(out, "final") / "step.json").write_text('{"step_count": 3}')
    elsewhere = _make_ckpt(tmp_path / "other", "step-00000001")
    assert set_aside_later_checkpoints(out, elsewhere) == []
    assert sorted(p.name for p in out.iterdir()) == ["final", "step-00000001", "step-00000002", "step-00000003"]
    moved = set_aside_later_checkpoints(out, out / "step-00000002")
    assert sorted(p.name for p in moved) == [".superseded-final", ".superseded-step-00000003"]
    assert sorted(p.name for p in out.iterdir()) == [".superseded-final", ".superseded-step-00000003", "step-00000001",
                                                     "step-00000002"]


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


def whole_file_checksum(path: Path) -> dict:
    """What the manifest must say of a file: its size and zlib's CRC-32 of all its bytes at once."""
    data = path.read_bytes()
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_file_checksum_is_the_crc32_of_the_whole_file_across_read_blocks(tmp_path, monkeypatch):
    """file_checksum reads a file block by block: the CRC carried from block to block must be zlib's CRC-32
    of the whole file, for sizes on and around the block boundaries; and one file just past the real block."""
    monkeypatch.setattr(checkpoint_module, "READ_BLOCK", 64)
    data = bytes(random.Random(0).randrange(256) for _ in range(64 * 3 + 17))
    for size in (0, 1, 63, 64, 65, 128, 64 * 3 + 17):
        path = tmp_path / f"{size}.bin"
        path.write_bytes(data[:size])
        assert file_checksum(path) == whole_file_checksum(path), f"{size} bytes"
    monkeypatch.undo()
    path = tmp_path / "past-one-block.bin"
    path.write_bytes(bytes(range(256)) * (checkpoint_module.READ_BLOCK // 256) + b"one more")
    assert file_checksum(path) == whole_file_checksum(path)


def test_save_writes_a_complete_directory_then_load_restores_the_state(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_module, "READ_BLOCK", 256)  # lit_model.pth's ~2 kB are read in several blocks
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={"samples": 12})
    state.update(iter_num=6, step_count=3, skipped_steps=1)
    config = Config.from_name("gla-debug")
    hparams = {"model_name": "gla-debug", "out_dir": str(tmp_path), "train": {"max_steps": 5}}
    checkpointer = Checkpointer(tmp_path, hparams, config, keep_last_n=2)
    saved = checkpointer.save(fabric, state)
    assert saved == tmp_path / "step-00000003"
    assert {p.name for p in saved.iterdir()} == {MODEL_FILE, STEP_FILE, HPARAMS_FILE, CONFIG_FILE, MANIFEST_FILE}
    assert json.loads((saved / STEP_FILE).read_text()) == {"step_count": 3}
    # the manifest: every other file, its size and CRC-32 (zlib's, of the whole file)
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    assert sorted(manifest["files"]) == sorted([MODEL_FILE, STEP_FILE, HPARAMS_FILE, CONFIG_FILE])
    assert (saved / MODEL_FILE).stat().st_size > 3 * checkpoint_module.READ_BLOCK
    for name, entry in manifest["files"].items():
        assert entry == whole_file_checksum(saved / name), name
    assert verify_checkpoint(saved).ok
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
    assert final_checkpoint_step(tmp_path) == 5 and select_resume_dir(fabric, "auto", tmp_path) == tmp_path / "final"
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
    # what the killed save left is no part of the new checkpoint (nor of its manifest)
    assert {p.name for p in (tmp_path / "step-00000002").iterdir()} == {MODEL_FILE, STEP_FILE, HPARAMS_FILE, CONFIG_FILE,
                                                                       MANIFEST_FILE}
    assert (tmp_path / "step-00000002" / MODEL_FILE).is_file() and not list(tmp_path.glob(".tmp-*"))


def test_a_final_saved_again_at_its_own_step_replaces_it(tmp_path):
    """final/ kept as a step-* checkpoint is the end of a run continued to a later step; saved again at the same step,
    final/ is replaced and no second copy of it is left."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    checkpointer = Checkpointer(tmp_path, {}, Config.from_name("gla-debug"))
    for seed in (0, 1):
        model, optimizer = small_state(seed)
        state = train_state(model, optimizer, train_dataloader={})
        state["step_count"] = 3
        checkpointer.save(fabric, state, final=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    saved = torch.load(tmp_path / "final" / MODEL_FILE, weights_only=True)["model"]
    assert torch.equal(saved["weight"], model.weight)  # the second save's


def test_a_checkpoint_holds_its_tokenizer_and_what_its_weights_were_trained_with(tmp_path):
    """The tokenizer's files and trained_with.json (which tokenizer the weights' ids are) are saved, and in the manifest."""
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.model").write_bytes(b"sentencepiece bytes")
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")
    trained_with = {"tokenizer": {"vocab_size": 300, "sha256": "ab" * 32}}
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={})
    checkpointer = Checkpointer(tmp_path / "out", {}, Config.from_name("gla-debug"), tokenizer_dir=tokenizer_dir,
                                trained_with=trained_with)
    saved = checkpointer.save(L.Fabric(accelerator="cpu", devices=1), state)
    assert (saved / "tokenizer.model").read_bytes() == b"sentencepiece bytes"
    assert json.loads((saved / "trained_with.json").read_text()) == trained_with
    listed = json.loads((saved / MANIFEST_FILE).read_text())["files"]
    assert {"tokenizer.model", "tokenizer_config.json", "trained_with.json"} <= set(listed) and verify_checkpoint(saved).ok


def test_a_kill_while_replacing_a_checkpoint_leaves_a_whole_one_under_its_name(tmp_path, monkeypatch):
    """A resumed run saving a step it had saved before replaces that directory. Killed while the old one is being
    deleted, the step's name holds a whole checkpoint (the new one); the old one lies under a .tmp- name."""
    saved_checkpoint(tmp_path, 2)
    monkeypatch.setattr(checkpoint_module.shutil, "rmtree", killed_while_deleting)
    with pytest.raises(KeyboardInterrupt):
        saved_checkpoint(tmp_path, 2)
    assert verify_checkpoint(tmp_path / "step-00000002").ok
    # the half-deleted one left under its .tmp- name is deleted by the next save of that step, which replaces it
    assert [p.name for p in tmp_path.glob(".tmp-*")] == [".tmp-old-step-00000002"]
    monkeypatch.undo()
    saved_checkpoint(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert verify_checkpoint(tmp_path / "step-00000002").ok


def test_a_finished_run_continued_past_a_step_it_also_saved_keeps_that_checkpoint(tmp_path):
    """final/ at step 3 beside step-00000003 (a run stopped by a signal at its last step, then finished by a resume):
    continued to step 5, the new final/ replaces the old one, and step-00000003 stays as it was."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    checkpointer = Checkpointer(tmp_path, {}, Config.from_name("gla-debug"))
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={})
    state["step_count"] = 3
    step_3 = checkpointer.save(fabric, state)
    checkpointer.save(fabric, state, final=True)
    state["step_count"] = 5
    checkpointer.save(fabric, state, final=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step-00000003"]
    assert final_checkpoint_step(tmp_path) == 5 and verify_checkpoint(step_3).ok


def test_a_finished_run_continued_keeps_its_end_as_final_until_the_new_end_and_never_prunes_it(tmp_path):
    """A finished run (final/ at step 1) continued with keep_last_n=1: its step saves leave final/ as it was (the end of
    the run it still is, if this one is stopped), and the new final/ keeps it as step-00000001, which no pruning counts
    among the step saves of the continued run."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    checkpointer = Checkpointer(tmp_path, {}, Config.from_name("gla-debug"), keep_last_n=1)
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={})
    state["step_count"] = 1
    checkpointer.save(fabric, state, final=True)
    first_end = (tmp_path / "final" / MODEL_FILE).read_bytes()
    for step in (2, 3):
        state["step_count"] = step
        checkpointer.save(fabric, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step-00000003"]
    assert final_checkpoint_step(tmp_path) == 1 and (tmp_path / "final" / MODEL_FILE).read_bytes() == first_end
    state["step_count"] = 4
    checkpointer.save(fabric, state, final=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step-00000001", "step-00000003"]
    assert (tmp_path / "step-00000001" / MODEL_FILE).read_bytes() == first_end and final_checkpoint_step(tmp_path) == 4


def test_a_ctrl_c_between_the_renames_that_replace_a_checkpoint_waits_for_both(tmp_path, monkeypatch):
    """Ctrl-C right after the old checkpoint is renamed out of the way: the new one is renamed into place, the old one
    deleted, and then the KeyboardInterrupt raised; the step's name holds the new checkpoint."""
    import signal

    saved_checkpoint(tmp_path, 2)
    real_replace = os.replace

    def replace_then_ctrl_c(src, dst):
        real_replace(src, dst)
        if Path(dst).name == ".tmp-old-step-00000002":
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(os, "replace", replace_then_ctrl_c)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # a foreground job's, as in a terminal
    try:
        with pytest.raises(KeyboardInterrupt):
            saved_checkpoint(tmp_path, 2, seed=1)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]
    assert verify_checkpoint(tmp_path / "step-00000002").ok
    weights = torch.load(tmp_path / "step-00000002" / MODEL_FILE, weights_only=True)["model"]["weight"]
    assert torch.equal(weights, small_state(1)[0].weight)


def test_an_out_dir_that_refuses_a_write_is_refused_before_the_run_and_left_as_it_was(tmp_path, monkeypatch):
    """A file system that takes a write and refuses it only at fsync (a quota, NFS, a full disk under delayed
    allocation): out_dir is refused before the run trains, and the probe written there is gone again."""
    from fabric_lin.checkpoint import check_out_dir
    from fabric_lin.errors import UserError

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / "out"
    check_out_dir(out, Config.from_name("gla-debug"))
    assert list(out.iterdir()) == []
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(UserError, match=rf"^out_dir {out} is not writable: \[Errno {errno.ENOSPC}\] "
                                        f"{os.strerror(errno.ENOSPC)}$"):
        check_out_dir(out, Config.from_name("gla-debug"))
    assert list(out.iterdir()) == []


def test_load_of_a_model_directory_points_to_initial_checkpoint_dir(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = small_state(0)
    torch.save(model.state_dict(), tmp_path / MODEL_FILE)  # a model directory: the weights alone
    with pytest.raises(ValueError, match=rf"not a training checkpoint .*use --initial_checkpoint_dir {tmp_path}"):
        load_train_state(fabric, tmp_path, train_state(model, optimizer, {}))


# ---------------------------------------------------------------- verification


def saved_checkpoint(out_dir: Path, step: int = 2, fabric=None, seed: int = 0) -> Path:
    fabric = fabric or L.Fabric(accelerator="cpu", devices=1)
    model, optimizer = small_state(seed)
    state = train_state(model, optimizer, train_dataloader={"samples": 4})
    state["step_count"] = step
    return Checkpointer(out_dir, {"train": {"micro_batch_size": 2}}, Config.from_name("gla-debug")).save(fabric, state)


@pytest.mark.parametrize("sharded", [False, True])
def test_save_flushes_every_file_and_directory_before_the_rename_and_out_dir_after_it(tmp_path, monkeypatch, sharded):
    """A checkpoint renamed into place must outlive a crash of the machine, not only of the run: every file and
    directory of it (under FSDP lit_model.pth/ and its shards too) is fsynced under its `.tmp-` name, then out_dir,
    which makes the rename itself last."""
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out_dir = tmp_path.resolve()  # as /proc names the files
    saved = saved_checkpoint(out_dir, fabric=ShardedSaveFabric() if sharded else None)
    assert (saved / MODEL_FILE).is_dir() == sharded
    tmp_dir = out_dir / f".tmp-{saved.name}"
    written = {tmp_dir / path.relative_to(saved) for path in saved.rglob("*")} | {tmp_dir}
    written = {path.with_name(f"{MANIFEST_FILE}.tmp") if path.name == MANIFEST_FILE else path for path in written}
    assert written - set(synced[:-1]) == set() and synced[-1] == out_dir


def test_a_truncated_file_is_found(tmp_path):
    saved = saved_checkpoint(tmp_path)
    size = (saved / MODEL_FILE).stat().st_size
    with open(saved / MODEL_FILE, "r+b") as f:
        f.truncate(size - 1000)
    check = verify_checkpoint(saved)
    assert not check.ok
    assert check.problems == [f"{MODEL_FILE} has {size - 1000:,} bytes, {size:,} when it was written (truncated)"]
    with open(saved / CONFIG_FILE, "ab") as f:
        f.write(b"# appended\n")
    config_size = json.loads((saved / MANIFEST_FILE).read_text())["files"][CONFIG_FILE]["size"]
    assert verify_checkpoint(saved).problems[1:] == [f"{CONFIG_FILE} has {config_size + 11:,} bytes, {config_size:,} when it "
                                                     f"was written (grown)"]


@pytest.mark.parametrize("where", ["first block", "middle", "last byte"])
def test_changed_bytes_are_found(tmp_path, monkeypatch, where):
    """The same size, one byte different: what a size check misses and the checksum sees, in any of the
    blocks the file is read in."""
    monkeypatch.setattr(checkpoint_module, "READ_BLOCK", 256)
    saved = saved_checkpoint(tmp_path)
    data = bytearray((saved / MODEL_FILE).read_bytes())
    assert len(data) > 3 * checkpoint_module.READ_BLOCK
    data[{"first block": 10, "middle": len(data) // 2, "last byte": -1}[where]] ^= 0x01
    (saved / MODEL_FILE).write_bytes(data)
    check = verify_checkpoint(saved)
    assert len(check.problems) == 1
    assert check.problems[0].startswith(f"{MODEL_FILE}'s bytes changed since it was written (CRC-32 ")


def test_a_missing_file_is_found(tmp_path):
    saved = saved_checkpoint(tmp_path)
    (saved / CONFIG_FILE).unlink()
    assert verify_checkpoint(saved).problems == [f"{CONFIG_FILE} is missing"]
    (saved / MODEL_FILE).unlink()
    assert verify_checkpoint(saved).problems == [f"{MODEL_FILE} is missing", f"{CONFIG_FILE} is missing"]


def test_a_missing_or_unreadable_manifest_is_found(tmp_path):
    saved = saved_checkpoint(tmp_path)
    (saved / MANIFEST_FILE).unlink()
    assert verify_checkpoint(saved).problems[0].startswith(f"{MANIFEST_FILE} is missing")
    (saved / MANIFEST_FILE).write_text("{not json")
    assert verify_checkpoint(saved).problems[0].startswith(f"{MANIFEST_FILE} is unreadable (JSONDecodeError")
    (saved / MANIFEST_FILE).write_text(json.dumps({"format": 1, "files": [MODEL_FILE]}))
    assert verify_checkpoint(saved).problems[0].startswith(f"{MANIFEST_FILE} is unreadable (InvalidValue")


def test_a_manifest_without_the_weights_or_naming_a_file_outside_the_checkpoint_is_found(tmp_path):
    saved = saved_checkpoint(tmp_path)
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    weights = manifest["files"].pop(MODEL_FILE)
    (saved / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert verify_checkpoint(saved).problems == [f"{MANIFEST_FILE} lists no {MODEL_FILE}"]
    (tmp_path / "outside.txt").write_text("not the checkpoint's")
    manifest["files"].update({MODEL_FILE: weights, "../outside.txt": whole_file_checksum(tmp_path / "outside.txt")})
    (saved / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert verify_checkpoint(saved).problems == [f"{MANIFEST_FILE} lists '../outside.txt', which is not a path inside the checkpoint"]

def test_a_checkpoint_without_its_manifest_is_damaged(tmp_path, capsys):
    """The manifest is written last: a directory without it was never completed, or lost it since. It is set
    aside like any damaged checkpoint, and named with the reason when given to --resume."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    older = saved_checkpoint(tmp_path, 2, fabric)
    saved = saved_checkpoint(tmp_path, 4, fabric)
    (saved / MANIFEST_FILE).unlink()
    reason = f"{MANIFEST_FILE} is missing (it is written last: the checkpoint was never completed, or lost it since)"
    assert verify_checkpoint(saved).problems == [reason]
    with pytest.raises(ValueError, match=rf"--resume {saved}: the checkpoint is damaged: {MANIFEST_FILE} is missing"):
        select_resume_dir(fabric, saved, tmp_path)
    assert select_resume_dir(fabric, "auto", tmp_path) == older
    assert f"Warning: checkpoint {saved} is damaged: {reason}. Set aside as {tmp_path / '.damaged-step-00000004'}" in capsys.readouterr().out


def test_resume_falls_back_to_the_newest_verified_checkpoint_and_sets_the_damaged_aside(tmp_path, capsys):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    for step in (2, 4, 6):
        saved_checkpoint(tmp_path, step, fabric)
    final = tmp_path / "final"
    (tmp_path / "step-00000006").rename(final)  # final/ at step 6: the newest
    with open(final / MODEL_FILE, "r+b") as f:
        f.truncate(100)
    (tmp_path / "step-00000004" / HPARAMS_FILE).write_text("train: {micro_batch_size: 3}\n")
    capsys.readouterr()
    assert select_resume_dir(fabric, "auto", tmp_path) == tmp_path / "step-00000002"
    out = capsys.readouterr().out
    assert f"Warning: checkpoint {final} is damaged: {MODEL_FILE} has 100 bytes" in out
    assert f"Set aside as {tmp_path / '.damaged-final'}" in out
    assert f"Warning: checkpoint {tmp_path / 'step-00000004'} is damaged: {HPARAMS_FILE}'s bytes changed" in out
    assert f"Warning: resuming from {tmp_path / 'step-00000002'}, the newest checkpoint that verifies" in out
    # set aside, never deleted; out of the way of --resume and of the next search
    assert sorted(p.name for p in tmp_path.iterdir()) == [".damaged-final", ".damaged-step-00000004", "step-00000002"]
    assert (tmp_path / ".damaged-final" / MODEL_FILE).stat().st_size == 100
    assert checkpoint_dirs(tmp_path) == [tmp_path / "step-00000002"]
    # damaged again under the same name: a second name
    saved_checkpoint(tmp_path, 4, fabric)
    (tmp_path / "step-00000004" / CONFIG_FILE).unlink()
    assert select_resume_dir(fabric, True, tmp_path) == tmp_path / "step-00000002"
    assert (tmp_path / ".damaged-step-00000004-2").is_dir()
    saved_checkpoint(tmp_path, 4, fabric)
    (tmp_path / "step-00000004" / CONFIG_FILE).unlink()
    assert select_resume_dir(fabric, True, tmp_path) == tmp_path / "step-00000002"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".damaged-step-00000004")) == [
        ".damaged-step-00000004", ".damaged-step-00000004-2", ".damaged-step-00000004-3"]


def test_resume_with_every_checkpoint_damaged_refuses(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    saved = saved_checkpoint(tmp_path, 2, fabric)
    (saved / MODEL_FILE).unlink()
    refusal = (r"--resume {}: no checkpoint in .* verifies; the damaged ones are set aside as \.damaged-step-00000002\. "
               r"Resume from a good copy of one with --resume <dir>, start again in a new --out_dir, or start again from "
               r"step 0 in this one with --resume false --overwrite true \(deletes them\)$")
    with pytest.raises(ValueError, match=refusal.format("auto")):
        select_resume_dir(fabric, "auto", tmp_path)
    # set aside by the first attempt: the next one, with nothing left to try, does not start from step 0 unasked
    for resume in ("auto", True):
        with pytest.raises(ValueError, match=refusal.format(resume)):
            select_resume_dir(fabric, resume, tmp_path)
    assert earlier_run_checkpoints(tmp_path) == [".damaged-step-00000002"]  # so --resume false is refused too


def test_resume_from_a_named_damaged_directory_refuses_with_the_reason(tmp_path):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    saved = saved_checkpoint(tmp_path, 2, fabric)
    (saved / CONFIG_FILE).write_text((saved / CONFIG_FILE).read_text().replace("gla-debug", "gla-DEBUG"))
    with pytest.raises(ValueError, match=rf"--resume {saved}: the checkpoint is damaged: {CONFIG_FILE}'s bytes changed since "
                       r"it was written .* It is not loaded: pass an older checkpoint directory, or --resume auto"):
        select_resume_dir(fabric, saved, tmp_path)
    assert saved.is_dir()  # named by the user: reported, not moved


def test_a_sharded_model_directory_is_listed_file_by_file(tmp_path):
    """Under FSDP lit_model.pth is a directory of shards (DCP): each of its files is in the manifest,
    and a damaged shard is found by name."""
    fabric = ShardedSaveFabric()
    saved = saved_checkpoint(tmp_path, 2, fabric)
    manifest = json.loads((saved / MANIFEST_FILE).read_text())
    shards = sorted(n for n in manifest["files"] if n.startswith(MODEL_FILE + "/"))
    assert shards == [f"{MODEL_FILE}/.metadata", f"{MODEL_FILE}/__0_0.distcp", f"{MODEL_FILE}/__1_0.distcp", f"{MODEL_FILE}/meta.pt"]
    assert verify_checkpoint(saved).ok
    (saved / MODEL_FILE / "__1_0.distcp").write_bytes(b"shard 1, fewer bytes")
    assert verify_checkpoint(saved).problems == [f"{MODEL_FILE}/__1_0.distcp has 20 bytes, 700 when it was written (truncated)"]
    (saved / MODEL_FILE / "meta.pt").unlink()
    assert verify_checkpoint(saved).problems[-1] == f"{MODEL_FILE}/meta.pt is missing"


class ShardedSaveFabric:
    """What Checkpointer.save asks of Fabric, its strategy saving lit_model.pth as FSDP's sharded form does: a
    directory."""

    global_rank, world_size = 0, 1

    @property
    def strategy(self):
        return self

    def save_checkpoint(self, path, state):
        path.mkdir()
        (path / ".metadata").write_bytes(b"metadata")
        for rank in range(2):
            (path / f"__{rank}_0.distcp").write_bytes(f"shard {rank}".encode() * 100)
        (path / "meta.pt").write_bytes(b"meta")

    def barrier(self):
        pass

    def broadcast(self, obj, src=0):
        return obj

    def print(self, *args):
        pass


class InterruptedSaveFabric(ShardedSaveFabric):
    """A second Ctrl-C while the model is being written."""

    def save_checkpoint(self, path, state):
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"half a shard")
        raise KeyboardInterrupt


def test_an_interrupted_save_leaves_the_complete_checkpoints_and_no_temporary_directory(tmp_path):
    saved = saved_checkpoint(tmp_path, 2)
    model, optimizer = small_state(0)
    state = train_state(model, optimizer, train_dataloader={})
    state["step_count"] = 4
    with pytest.raises(KeyboardInterrupt):
        Checkpointer(tmp_path, {}, Config.from_name("gla-debug")).save(InterruptedSaveFabric(), state)
    assert sorted(p.name for p in tmp_path.iterdir()) == [saved.name] and verify_checkpoint(saved).ok


def test_a_full_disk_while_the_small_files_are_written_names_the_checkpoint(tmp_path, monkeypatch):
    """The disk fills up after the weights, as hyperparameters.yaml is written: Python's OSError names no file, which the
    CLI took for a bug (a traceback); the error names the checkpoint being written, and the one before stays."""
    from fabric_lin.cli import expected_failure

    saved = saved_checkpoint(tmp_path, 2)

    def full(hparams, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_module, "save_hparams", full)
    with pytest.raises(OSError) as info:
        saved_checkpoint(tmp_path, 4)
    assert (info.value.errno, info.value.filename) == (errno.ENOSPC, str(tmp_path / ".tmp-step-00000004"))
    assert expected_failure(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [saved.name] and verify_checkpoint(saved).ok


def test_an_earlier_run_is_found_and_deleted_whole(tmp_path):
    for name in ("step-00000002", "step-00000004", "final", ".damaged-step-00000006", ".tmp-step-00000008"):
        _make_ckpt(tmp_path, name)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "compile_cache").mkdir()
    assert earlier_run_checkpoints(tmp_path) == ["final", "step-00000002", "step-00000004", ".damaged-step-00000006"]
    deleted = delete_checkpoints(tmp_path)
    assert deleted == [".damaged-step-00000006", ".tmp-step-00000008", "final", "step-00000002", "step-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compile_cache", "metrics.jsonl"]  # pretrain removes metrics.jsonl
    assert earlier_run_checkpoints(tmp_path) == [] and delete_checkpoints(tmp_path / "none") == []


def evaluated(out_dir: Path, *names: str) -> None:
    """evaluate's results (and plot) of out_dir's checkpoints `names`, where it writes them by default."""
    for name in names:
        (out_dir / "evaluate" / name).mkdir(parents=True, exist_ok=True)
        (out_dir / "evaluate" / name / "evaluate.json").write_text(json.dumps({"checkpoint": str(out_dir / name)}))
        (out_dir / "evaluate" / name / "loss_by_position.png").write_bytes(b"png")


def test_an_earlier_run_s_evaluations_are_deleted_with_its_checkpoints(tmp_path):
    """--overwrite true deletes the earlier run's checkpoints: evaluate's results of them in out_dir/evaluate/ go too,
    or the new run would seem to have them. What else the user keeps there stays."""
    _make_ckpt(tmp_path, "final")
    evaluated(tmp_path, "final", "step-00000002")
    (tmp_path / "evaluate" / "final" / "notes.txt").write_text("mine\n")
    (tmp_path / "evaluate" / "summary.csv").write_text("mine\n")
    assert delete_checkpoints(tmp_path) == ["final", "evaluate/final", "evaluate/step-00000002"]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "evaluate", "evaluate/final", "evaluate/final/notes.txt", "evaluate/summary.csv"]
    (tmp_path / "evaluate" / "final" / "notes.txt").unlink()
    (tmp_path / "evaluate" / "summary.csv").unlink()
    evaluated(tmp_path, "step-00000004")
    assert delete_checkpoints(tmp_path) == ["evaluate/step-00000004"] and list(tmp_path.iterdir()) == []


def test_a_checkpoint_saved_over_another_takes_the_others_evaluation_with_it(tmp_path):
    """A resumed run that saves a step it had saved before replaces that checkpoint: evaluate's results of the one
    replaced would be taken for the new one's. Those of other checkpoints stay."""
    saved_checkpoint(tmp_path, 2)
    evaluated(tmp_path, "step-00000002", "step-00000004")
    saved_checkpoint(tmp_path, 2)
    assert not (tmp_path / "evaluate" / "step-00000002").exists()
    assert sorted(p.name for p in (tmp_path / "evaluate" / "step-00000004").iterdir()) == [
        "evaluate.json", "loss_by_position.png"]


def test_checksum_cost_on_a_debug_checkpoint(tmp_path):
    """The manifest's cost, measured: a gla-debug checkpoint's files are read once more at the save and at
    a resume. Printed for the record; the bound only catches a pathological slowdown."""
    import time

    from fabric_lin.model import GPT

    fabric = L.Fabric(accelerator="cpu", devices=1)
    model = GPT(Config.from_name("gla-debug"))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 4096, (1, 9))).sum().backward()
    optimizer.step()
    state = train_state(model, optimizer, train_dataloader={})
    saved = Checkpointer(tmp_path, {}, Config.from_name("gla-debug")).save(fabric, state)
    size = sum(p.stat().st_size for p in saved.iterdir())
    start = time.perf_counter()
    assert verify_checkpoint(saved).ok
    seconds = time.perf_counter() - start
    print(f"verified {size / 1e6:.1f} MB in {seconds * 1e3:.1f} ms ({size / seconds / 1e9:.2f} GB/s)")
    assert size > 20e6 and seconds < 5.0


def test_signals_during_the_renames_go_to_their_handler_afterwards():
    """Between the two renames that replace a checkpoint, a Ctrl-C would leave neither directory in place:
    it is held until the renames are done, then raised."""
    import signal

    from fabric_lin.checkpoint import signals_deferred

    done = []
    # Python's own Ctrl-C handler, as a terminal's foreground job has it (a shell's background job, `pytest &`,
    # starts with SIGINT ignored, and Python then leaves it so)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with signals_deferred(signal.SIGINT, signal.SIGTERM):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000):  # Python would run a handler here
                    done.append(1)
        assert len(done) == 1000
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_each_rank_checksums_the_shards_it_wrote_and_a_share_of_the_rest():
    from fabric_lin.checkpoint import share

    names = ["hyperparameters.yaml", "lit_model.pth/.metadata", "lit_model.pth/__0_0.distcp", "lit_model.pth/__1_0.distcp",
             "lit_model.pth/__2_0.distcp", "lit_model.pth/__3_0.distcp", "lit_model.pth/meta.pt", "step.json"]
    shares = [share(names, rank, 4) for rank in range(4)]
    assert sorted(n for part in shares for n in part) == names  # each file once
    assert all(f"lit_model.pth/__{rank}_0.distcp" in shares[rank] for rank in range(4))
    assert max(map(len, shares)) - min(map(len, shares)) <= 2
    assert share(names, 0, 1) == names
