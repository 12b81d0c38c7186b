"""fabric_lin/run_start.py, in this process without a run: which --config files tell of a moved run (a checkpoint's own
hyperparameters.yaml, the last file that sets out_dir counting), and a model directory's weights checked against the
run's model (a name alone is no difference; the hint of the directory's own model only where its weights are that
model); which runs read --initial_checkpoint_dir at all, and what a rank whose peer is gone says of the checkpoints.
The refusals as a run meets them: test_pretrain.py, test_pretrain_data.py."""
import json
from dataclasses import replace

import pytest
import torch
import yaml

from fabric_lin.config import Config
from fabric_lin.model import GPT
from fabric_lin.run_start import check_config_of_a_moved_run, fits, load_initial_weights
from fabric_lin.weights import meta_model


def write_yaml(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(content))
    return path


def test_only_a_checkpoint_s_own_hyperparameters_yaml_tells_of_a_moved_run(tmp_path):
    """A run's checkpoint moved from old/ to moved/: its hyperparameters.yaml records out_dir old/ and is refused. A
    config file of one's own that sets out_dir, or a hyperparameters.yaml copied out of its checkpoint, says where to
    write, nothing else; so does a later --config that sets out_dir again (jsonargparse takes the last value). A
checkpoint that lies where its file says passes."""
    moved_checkpoint = tmp_path / "moved" / "step-00000002"
    hparams = write_yaml(moved_checkpoint / "hyperparameters.yaml", {"out_dir": str(tmp_path / "old")})
    (moved_checkpoint / "step.json").write_text(json.dumps({"step_count": 2}))
    own = write_yaml(tmp_path / "configs" / "run.yaml", {"out_dir": str(tmp_path / "runs" / "a")})
    copied = write_yaml(tmp_path / "configs" / "hyperparameters.yaml", {"out_dir": str(tmp_path / "old")})
    in_place = write_yaml(tmp_path / "old" / "final" / "hyperparameters.yaml", {"out_dir": str(tmp_path / "old")})
    (in_place.parent / "step.json").write_text(json.dumps({"step_count": 4}))
    for configs in ([in_place], [own], [copied], [hparams, own]):
        check_config_of_a_moved_run(configs)
    for configs in ([hparams], [own, hparams]):
        with pytest.raises(ValueError, match=rf"^--config {hparams}: it records out_dir {tmp_path / 'old'}, but its "
                           rf"checkpoint now lies in {tmp_path / 'moved'}"):
            check_config_of_a_moved_run(configs)


def test_weights_fit_the_model_of_their_shapes_only():
    config = Config.from_name("gla-debug")
    weights = meta_model(config).state_dict()
    assert fits(weights, config)
    assert not fits(weights, replace(config, num_layers=config.num_layers - 1))
    assert not fits(weights, replace(config, intermediate_size=config.intermediate_size * 2))


def test_a_model_directory_whose_config_differs_in_its_name_alone_is_loaded_without_a_warning(tmp_path):
    config = Config.from_name("gla-debug", num_layers=1)
    state = GPT(config).state_dict()
    (tmp_path / "model").mkdir()
    torch.save(state, tmp_path / "model" / "lit_model.pth")
    config.save(tmp_path / "model" / "model_config.yaml")
    logged = []
    loaded = load_initial_weights(tmp_path / "model", replace(config, name="my-gla"), log=logged.append)
    assert logged == [] and loaded.keys() == state.keys()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in state.items())


CONFIG = Config.from_name("gla-debug")  # the fresh run's model (the checkpoints here record none)


def training_checkpoint(directory):
    """What --resume takes for a training checkpoint: its weights and step.json."""
    directory.mkdir(parents=True)
    (directory / "lit_model.pth").write_bytes(b"x")
    (directory / "step.json").write_text(json.dumps({"step_count": 2}))
    return directory


def test_a_resume_from_another_out_dir_into_a_used_one_is_refused(tmp_path):
    """--resume naming a checkpoint of another run, into an out_dir that holds an earlier run's checkpoints, would put the
    two runs' checkpoints side by side, as a fresh run would: refused; --overwrite true (which deletes out_dir's) lets it
    go on. A checkpoint of out_dir itself continues that run there."""
    from fabric_lin.run_start import check_earlier_run

    out, other = tmp_path / "out", tmp_path / "other"
    for run in (out, other):
        training_checkpoint(run / "step-00000002")
    with pytest.raises(FileExistsError, match=rf"^out_dir {out} holds the checkpoints of an earlier run \(step-00000002\)"):
        check_earlier_run(out, other / "step-00000002", overwrite=False, config=CONFIG)
    check_earlier_run(out, other / "step-00000002", overwrite=True, config=CONFIG)
    check_earlier_run(out, out / "step-00000002", overwrite=False, config=CONFIG)


def test_a_checkpoint_of_out_dir_named_through_a_link_is_out_dir_s(tmp_path):
    """out_dir given through a symbolic link and --resume naming its checkpoint by the real path, or the reverse: it is
    out_dir's own checkpoint, which --resume continues there and which --overwrite true would delete before the resume."""
    from fabric_lin.run_start import check_earlier_run

    checkpoint = training_checkpoint(tmp_path / "scratch" / "out" / "step-00000002")
    (tmp_path / "runs").symlink_to(tmp_path / "scratch", target_is_directory=True)
    for out_dir, named in ((tmp_path / "runs" / "out", checkpoint),
                           (tmp_path / "scratch" / "out", tmp_path / "runs" / "out" / "step-00000002")):
        check_earlier_run(out_dir, named, overwrite=False, config=CONFIG)
        with pytest.raises(ValueError, match=rf"^--overwrite true would delete the checkpoint --resume {named} names"):
            check_earlier_run(out_dir, named, overwrite=True, config=CONFIG)


def test_a_run_reached_through_a_link_has_not_moved(tmp_path):
    """out_dir recorded through a symbolic link (/runs -> /scratch, say) is where the checkpoint lies, by either path."""
    real, link = tmp_path / "scratch", tmp_path / "runs"
    checkpoint = real / "out" / "step-00000002"
    hparams = write_yaml(checkpoint / "hyperparameters.yaml", {"out_dir": str(link / "out")})
    (checkpoint / "step.json").write_text(json.dumps({"step_count": 2}))
    link.symlink_to(real, target_is_directory=True)
    check_config_of_a_moved_run([hparams])
    check_config_of_a_moved_run([link / "out" / "step-00000002" / "hyperparameters.yaml"])


def test_weights_that_are_not_their_directory_s_model_either_get_no_hint_of_it(tmp_path):
    """A model directory whose weights fit neither this run's model nor its own model_config.yaml: no flag is suggested
    that would build a model the weights do not fit either."""
    (tmp_path / "model").mkdir()
    torch.save(GPT(Config.from_name("gla-debug", num_layers=1)).state_dict(), tmp_path / "model" / "lit_model.pth")
    Config.from_name("gla-debug", num_layers=2).save(tmp_path / "model" / "model_config.yaml")
    with pytest.raises(ValueError) as mismatch:
        load_initial_weights(tmp_path / "model", Config.from_name("gla-debug"), log=lambda line: None)
    assert "holds a GLA model (1 layer, " in str(mismatch.value) and "--model" not in str(mismatch.value)
    assert str(mismatch.value).endswith("nor are they the model of its model_config.yaml, gla-debug: put back the "
                                        "model_config.yaml written with these weights, then start this run with the "
                                        "model it names")


def test_only_a_run_that_may_start_from_step_0_reads_its_initial_checkpoint_dir(tmp_path):
    """A model directory that is gone is refused where the run may start from step 0, and not read where the run resumes
    (--resume true or <dir>) or --resume auto finds out_dir's run to continue or to refuse: a checkpoint set aside as
    damaged, or one that metrics.jsonl records as saved (each refusal names those checkpoints, not the model)."""
    from fabric_lin.errors import MissingFile
    from fabric_lin.run_start import check_initial_checkpoint_dir

    gone, out = tmp_path / "model", tmp_path / "out"
    out.mkdir()
    for resume in (False, None, "auto"):
        with pytest.raises(MissingFile, match="is not a directory"):
            check_initial_checkpoint_dir(gone, resume, out)
    for resume in (True, tmp_path / "other" / "step-00000002"):
        check_initial_checkpoint_dir(gone, resume, out)
    (out / ".damaged-step-00000002").mkdir()
    check_initial_checkpoint_dir(gone, "auto", out)
    (out / ".damaged-step-00000002").rmdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 2, "checkpoint": "step-00000002"}) + "\n")
    check_initial_checkpoint_dir(gone, "auto", out)
    with pytest.raises(MissingFile, match="is not a directory"):
        check_initial_checkpoint_dir(gone, False, out)


def test_a_rank_whose_peer_is_gone_names_the_newest_checkpoint_and_whose_run_it_is(tmp_path):
    """The newest of out_dir's checkpoints by step; under --overwrite true, the earlier run's until the start-up deleted
    them, the run's own after that."""
    from fabric_lin.run_start import how_to_continue_without_the_peer

    for step in (4, 12):
        (tmp_path / f"step-{step:08d}").mkdir()
    newest = f"the newest complete checkpoint is {tmp_path / 'step-00000012'}: to continue from it, run the same command "
    assert how_to_continue_without_the_peer(tmp_path, "auto", False, False) == newest + "with --resume auto"
    assert how_to_continue_without_the_peer(tmp_path, False, True, True) == (
        newest + "with --resume auto instead of --overwrite true")
    assert how_to_continue_without_the_peer(tmp_path, False, True, False).startswith(
        f"the checkpoints in {tmp_path} are still the earlier run's")


@pytest.mark.parametrize("name", ["final", "step-00000002"])
def test_a_resume_by_the_name_of_out_dir_s_checkpoint_names_its_path(tmp_path, capsys, monkeypatch, name):
    """`--resume final` is a path relative to the current directory, where there is none: the error named the current
    directory's checkpoints (none) and the words --resume takes, not out_dir's checkpoint of that name. A name that is
    none of out_dir's is said as before."""
    from helpers import cli_error

    out = tmp_path / "runs" / "a"
    training_checkpoint(out / name)
    monkeypatch.chdir(tmp_path)
    argv = ["pretrain", "--model_name", "gla-debug", "--train.max_steps", "2", "--out_dir", str(out), "--resume"]
    assert cli_error([*argv, name], capsys) == (
        f"fabric-lin pretrain: error: --resume {name} does not exist (a path is relative to the current directory): did "
        f"you mean --resume {out / name}, out_dir's checkpoint, or --resume auto for its newest?\n")
    assert cli_error([*argv, "step-00000003"], capsys) == (
        "fabric-lin pretrain: error: --resume step-00000003 does not exist: expected a training checkpoint (a run's "
        "step-XXXXXXXX/ or final/), or false, true or auto\n")
