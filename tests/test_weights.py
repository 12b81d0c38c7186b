"""fabric_lin/weights.py: parameter names without the wrappers' prefixes, a state dict made canonical (two tensors
of one name refused), tensors loaded without unpickling anything else, and file names kept inside their directory."""
import pytest
import torch

from fabric_lin.weights import canonical_name, canonical_state_dict, inside, tensor_dict, torch_load_tensors
from helpers import TouchOnUnpickle


def test_canonical_name_removes_the_wrappers_prefixes():
    assert canonical_name("_forward_module._orig_mod.layers.0._fsdp_wrapped_module.mlp_norm.weight") == "layers.0.mlp_norm.weight"


def test_canonical_state_dict_refuses_two_tensors_of_one_name():
    state = canonical_state_dict({"module.layers.0.attn.q_proj.weight": torch.zeros(2), "_forward_module.norm.weight": torch.ones(2)})
    assert list(state) == ["layers.0.attn.q_proj.weight", "norm.weight"]
    with pytest.raises(ValueError, match=r"two tensors map to 'norm.weight' once the wrappers' prefixes are removed \(one is "
                       r"'norm.weight'\)"):
        canonical_state_dict({"_orig_mod.norm.weight": torch.zeros(2), "norm.weight": torch.zeros(2)})


def test_tensors_are_loaded_and_nothing_else_is_unpickled(tmp_path):
    torch.save({"a": torch.arange(3), "b": {"c": torch.ones(2)}}, tmp_path / "tensors.pth")
    loaded = torch_load_tensors(tmp_path / "tensors.pth")
    assert torch.equal(loaded["a"], torch.arange(3)) and torch.equal(loaded["b"]["c"], torch.ones(2))
    torch.save({"a": torch.zeros(1), "hook": TouchOnUnpickle(tmp_path / "pwned")}, tmp_path / "code.pth")
    with pytest.raises(ValueError, match=rf"{tmp_path / 'code.pth'} holds objects other than tensors and plain containers, "
                       r"so it is not loaded \(files are never unpickled beyond tensors\)"):
        torch_load_tensors(tmp_path / "code.pth")
    assert not (tmp_path / "pwned").exists()


def test_tensor_dict_names_the_entries_that_are_not_tensors(tmp_path):
    with pytest.raises(ValueError, match=r"x.pth: expected a dict of tensors, got list"):
        tensor_dict([torch.zeros(1)], tmp_path / "x.pth")
    with pytest.raises(ValueError, match=r"x.pth: expected a dict of name -> tensor; these entries are not: 'a', 2$"):
        tensor_dict({"a": 1, 2: torch.zeros(1), "b": torch.zeros(1)}, tmp_path / "x.pth")
    state = {"b": torch.zeros(1)}
    assert tensor_dict(state, tmp_path / "x.pth") is state


@pytest.mark.parametrize("name,problem", [("../x", "points outside"), ("a/../../b", "points outside"), (".", "points outside"),
                                          ("/etc/passwd", "is not a relative path inside"), ("", "is not a relative path inside")])
def test_a_file_name_that_leaves_its_directory_is_refused(tmp_path, name, problem):
    with pytest.raises(ValueError, match=rf"index: file name {name!r} {problem} {tmp_path}"):
        inside(tmp_path, name, "index")
    assert inside(tmp_path, "shards/./model-1.safetensors", "index") == tmp_path / "shards" / "model-1.safetensors"
