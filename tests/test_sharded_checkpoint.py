"""fabric_lin/sharded_checkpoint.py: a sharded checkpoint's metadata is unpickled with DCP's own classes only; a foreign
pickle there (os.system, builtins.exec, torch.save) is refused without running it, a shard file named outside the
checkpoint is not read, and model entries that are not tensors are named, not dropped; a one-file checkpoint's
optimizer state is resumed in a sharded run only into parameter groups of the sizes it was saved with, each parameter
getting its own state, and only into a model of its parameters. (Sharded checkpoints written by pretrain, converted
and resumed on other meshes in one process or several: test_pretrain_sharded.py.)"""
import types

import pytest
import torch

from fabric_lin.sharded_checkpoint import load_one_file_train_state, load_sharded_model_state
from helpers import TouchOnUnpickle


def test_sharded_metadata_with_foreign_pickle_is_refused(tmp_path):
    import pickle

    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(TouchOnUnpickle(tmp_path / "pwned")))
    with pytest.raises(ValueError, match="refers to posix.system|refers to os.system"):
        load_sharded_model_state(weights)
    assert not (tmp_path / "pwned").exists()


class CallOnUnpickle:
    """Unpickled, it calls `function(*args)`: a global of Python or torch that is no part of DCP's metadata."""

    def __init__(self, function, *args):
        self.function, self.args = function, args

    def __reduce__(self):
        return (self.function, self.args)


@pytest.mark.parametrize("call, named", [
    (lambda pwned: CallOnUnpickle(exec, f"open({str(pwned)!r}, 'w').close()"), "builtins.exec"),
    (lambda pwned: CallOnUnpickle(torch.save, {}, str(pwned)), "torch.serialization.save"),
], ids=["builtins", "torch"])
def test_sharded_metadata_calling_python_or_torch_is_refused(tmp_path, call, named):
    import pickle

    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(call(tmp_path / "pwned")))
    with pytest.raises(ValueError, match=rf"refers to {named}, which is not part of a torch.distributed.checkpoint"):
        load_sharded_model_state(weights)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_shard_file_named_outside_the_checkpoint_is_refused(tmp_path):
    import dataclasses
    import pickle

    import torch.distributed.checkpoint as dcp

    weights = tmp_path / "run" / "lit_model.pth"
    dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=weights, no_dist=True)
    (weights / "__0_0.distcp").rename(tmp_path / "elsewhere.distcp")
    metadata = pickle.loads((weights / ".metadata").read_bytes())  # written by this test: trusted
    metadata.storage_data = {index: dataclasses.replace(info, relative_path="../../elsewhere.distcp")
                             for index, info in metadata.storage_data.items()}
    (weights / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(ValueError, match=r"file name '\.\./\.\./elsewhere\.distcp' points outside"):
        load_sharded_model_state(weights)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_model_entries_that_are_not_tensors_are_named(tmp_path):
    import torch.distributed.checkpoint as dcp

    weights = tmp_path / "lit_model.pth"
    dcp.save({"model": {"w": torch.ones(3), "note": "a pickled value"}}, checkpoint_id=weights, no_dist=True)
    with pytest.raises(ValueError, match=r"model entries \['note'\] are pickled objects, not tensors"):
        load_sharded_model_state(weights)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(self.proj(x))


GROUPINGS = {  # an optimizer's parameter groups
    "pretrain's": lambda m: [{"params": [m.proj.weight], "weight_decay": 0.1},  # none on biases and norms
                             {"params": [m.proj.bias, m.norm.weight, m.norm.bias], "weight_decay": 0.0}],
    "one group": lambda m: [{"params": list(m.parameters()), "weight_decay": 0.1}],
    "without norm.bias": lambda m: [{"params": [m.proj.weight], "weight_decay": 0.1},
                                    {"params": [m.proj.bias, m.norm.weight], "weight_decay": 0.0}],
}


def save_one_file_checkpoint(path, grouping: str) -> dict:
    """A one-file lit_model.pth after one AdamW step of a Tiny with `grouping`; each parameter's exp_avg by name."""
    model = Tiny()
    optimizer = torch.optim.AdamW(GROUPINGS[grouping](model))
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step_count": 1}, path)
    return {name: optimizer.state[p]["exp_avg"] for name, p in model.named_parameters() if p in optimizer.state}


def resuming_state() -> dict:
    """What load_one_file_train_state restores in place: a fresh Tiny and pretrain's groups, in Fabric's wrappers."""
    model = Tiny()
    optimizer = torch.optim.AdamW(GROUPINGS["pretrain's"](model))
    return {"model": types.SimpleNamespace(module=model), "optimizer": types.SimpleNamespace(optimizer=optimizer),
            "step_count": 0}


@pytest.mark.parametrize("saved_grouping, saved_sizes", [("one group", "[4]"), ("without norm.bias", "[1, 2]")])
def test_a_one_file_optimizer_state_of_other_parameter_groups_is_refused(tmp_path, saved_grouping, saved_sizes):
    """The optimizer state of a one-file checkpoint is keyed by each parameter's position in its groups: loaded into
    groups of other sizes (one group of all 4 parameters where this run has 1 + 3, the same count; or 3 parameters), a
    position would name another parameter (a norm's moments on the projection). It is refused naming both; groups of
    the sizes saved load, every parameter getting the moments saved for it."""
    torch.manual_seed(0)
    save_one_file_checkpoint(tmp_path / "other.pth", saved_grouping)
    with pytest.raises(ValueError) as info:
        load_one_file_train_state(tmp_path / "other.pth", resuming_state())
    assert str(info.value).startswith(f"{tmp_path / 'other.pth'}: the checkpoint's optimizer holds parameter groups of "
                                      f"{saved_sizes} parameters, this run's of [1, 3]"), str(info.value)

    expected = save_one_file_checkpoint(tmp_path / "same.pth", "pretrain's")
    state = resuming_state()
    load_one_file_train_state(tmp_path / "same.pth", state)
    for name, p in state["model"].module.named_parameters():
        torch.testing.assert_close(state["optimizer"].optimizer.state[p]["exp_avg"], expected[name], rtol=0, atol=0)
    assert state["step_count"] == 1


def test_a_one_file_checkpoint_of_another_model_is_refused_naming_the_parameters(tmp_path):
    save_one_file_checkpoint(tmp_path / "other.pth", "pretrain's")
    saved = torch.load(tmp_path / "other.pth", weights_only=True)
    saved["model"]["ln.weight"] = saved["model"].pop("norm.weight")
    torch.save(saved, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"other.pth: the checkpoint's model does not fit this run's: missing "
                       r"\['norm.weight'\], unexpected \['ln.weight'\]"):
        load_one_file_train_state(tmp_path / "other.pth", resuming_state())
