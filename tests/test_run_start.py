"""fabric_lin/run_start.py, in this process without a run: which --config files tell of a moved run (a checkpoint's own
hyperparameters.yaml, the last file that sets out_dir counting), and a model directory's weights checked against the
run's model (a name alone is no difference; the hint of the directory's own model only where its weights are that
model). The refusals as a run meets them: test_pretrain.py, test_pretrain_data.py."""
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
