"""fabric_lin/weights.py: parameter names without the wrappers' prefixes (activation checkpointing's too), a model of
the right shapes that holds no memory, a state dict made canonical (two tensors of one name refused), tensors loaded
without unpickling anything else and mapped from their file (one in the legacy format read too), and file names kept
inside their directory; a truncated weights file or a malformed model_config.yaml given to a command is one line
naming it."""
import shutil
from pathlib import Path

import pytest
import torch

from fabric_lin.weights import canonical_name, canonical_state_dict, inside, tensor_dict, torch_load_tensors
from helpers import TouchOnUnpickle, cli_error, make_model_dir, small_config


def test_canonical_name_removes_the_wrappers_prefixes():
    assert canonical_name("_forward_module._orig_mod.layers.0._fsdp_wrapped_module.mlp_norm.weight") == "layers.0.mlp_norm.weight"


def test_the_parameters_of_an_activation_checkpointed_model_have_the_bare_model_s_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from fabric_lin.model import Block
    from fabric_lin.weights import meta_model

    bare, wrapped = meta_model(small_config()), meta_model(small_config())
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Block))  # as pretrain wraps the Blocks
    assert any("_checkpoint_wrapped_module." in name for name, _ in wrapped.named_parameters())
    assert [canonical_name(name) for name, _ in wrapped.named_parameters()] == [name for name, _ in bare.named_parameters()]


def test_the_model_of_the_right_shapes_holds_no_memory():
    from fabric_lin.weights import meta_model

    assert all(p.is_meta for p in meta_model(small_config()).parameters())  # a 7B model's would take 28 GB


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
                       r"so it is not loaded \(files are never unpickled beyond tensors\)\. "
                       r"Details: .*GLOBAL (posix|os)\.system"):
        torch_load_tensors(tmp_path / "code.pth")
    assert not (tmp_path / "pwned").exists()


def test_tensors_are_mapped_from_the_file_not_read_into_memory(tmp_path):
    """A large model is read page by page as the weights are copied (no second copy of the file in memory); a file in
    torch's legacy format, which cannot be mapped, is read all the same."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        pytest.skip("reads where the tensor's memory is from Linux's /proc/self/maps")

    def mapped_from(tensor: torch.Tensor) -> str:
        address = tensor.untyped_storage().data_ptr()
        for line in maps.read_text().splitlines():
            start, end = (int(bound, 16) for bound in line.split()[0].split("-"))
            if start <= address < end:
                return line.split(maxsplit=5)[-1]
        return ""

    torch.save({"w": torch.arange(4096.0)}, tmp_path / "weights.pth")
    assert mapped_from(torch_load_tensors(tmp_path / "weights.pth")["w"]) == str(tmp_path / "weights.pth")
    torch.save({"w": torch.arange(3)}, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    assert torch.equal(torch_load_tensors(tmp_path / "legacy.pth")["w"], torch.arange(3))


def test_numpy_arrays_are_loaded_only_where_asked_for(tmp_path):
    """A training checkpoint holds NumPy's RNG state (an array): its reader admits arrays; a reader of weights does not."""
    import numpy as np

    torch.save({"w": torch.zeros(1), "rng": np.arange(3, dtype=np.uint32)}, tmp_path / "state.pth")
    assert torch_load_tensors(tmp_path / "state.pth", allow_numpy=True)["rng"].tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match=r"state.pth holds objects other than tensors and plain containers"):
        torch_load_tensors(tmp_path / "state.pth")


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
    # the path as checked, `..` resolved by name (not through a link the directory holds); a name that merely begins
    # with two dots is inside
    assert inside(tmp_path, "shards/../model-1.safetensors", "index") == tmp_path / "model-1.safetensors"
    assert inside(tmp_path, "..model-1.safetensors", "index") == tmp_path / "..model-1.safetensors"


# ---- a damaged file given to a command: one line naming it, exit code 2, for every command that reads it

# where a copy or download broke off: torch.load fails differently at each (OSError, RuntimeError, an unpickling
# error, EOFError), safetensors with its own error
CUTS = {"near-the-end": lambda n: n - 10, "half": lambda n: n // 2, "at-100-bytes": lambda n: 100,
        "at-3-bytes": lambda n: 3, "empty": lambda n: 0}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """A model directory (lit_model.pth), the same with model.safetensors instead, and its fla export."""
    from safetensors.torch import save_file

    from fabric_lin.convert.hf import convert_to_hf

    root = tmp_path_factory.mktemp("model_files")
    state = make_model_dir(root / "model", small_config())
    shutil.copytree(root / "model", root / "safetensors")
    (root / "safetensors" / "lit_model.pth").unlink()
    save_file(state, root / "safetensors" / "model.safetensors")
    convert_to_hf(root / "model", root / "hf")
    return root


def cut_copy(source: Path, target: Path, name: str, keep) -> Path:
    """A copy of the directory `source` whose file `name` keeps its first keep(size) bytes; returns that file."""
    shutil.copytree(source, target)
    data = (target / name).read_bytes()
    (target / name).write_bytes(data[: keep(len(data))])
    return target / name


@pytest.mark.parametrize("cut", list(CUTS))
def test_a_truncated_lit_model_pth_is_one_line(model_files, tmp_path, capsys, cut):
    damaged = cut_copy(model_files / "model", tmp_path / "model", "lit_model.pth", CUTS[cut])
    for argv in (["generate", str(damaged.parent), "--max_new_tokens", "1"], ["evaluate", str(damaged.parent)]):
        err = cli_error(argv, capsys)
        assert f"error: {damaged} cannot be read as tensors written by torch.save: " in err, err
        assert err.endswith("it may be truncated or damaged (an interrupted copy or download): copy or write it again\n")


@pytest.mark.parametrize("cut", ["half", "at-100-bytes", "at-3-bytes", "empty"])
def test_a_truncated_model_safetensors_is_one_line(model_files, tmp_path, capsys, cut):
    for source, command in ((model_files / "safetensors", ["evaluate"]),
                            (model_files / "hf", ["convert_from_hf", "--output_dir", str(tmp_path / "back")])):
        damaged = cut_copy(source, tmp_path / source.name, "model.safetensors", CUTS[cut])
        err = cli_error([command[0], str(damaged.parent), *command[1:]], capsys)
        assert f"error: {damaged} cannot be read as safetensors: " in err, err
        assert "truncated or damaged" in err
    assert not (tmp_path / "back").exists()


def test_a_truncated_safetensors_file_opened_for_reading_one_tensor_at_a_time_is_named(model_files, tmp_path):
    from fabric_lin.weights import open_safetensors

    damaged = cut_copy(model_files / "safetensors", tmp_path / "safetensors", "model.safetensors", CUTS["half"])
    with pytest.raises(ValueError, match=rf"{damaged} cannot be read as safetensors: .*truncated or damaged"):
        open_safetensors(damaged)


def test_a_malformed_model_config_yaml_is_one_line(model_files, tmp_path, capsys):
    shutil.copytree(model_files / "model", tmp_path / "model")
    config = tmp_path / "model" / "model_config.yaml"
    text = config.read_text()
    config.write_text(text + "  num_layers: [2\n")  # an indented key after the last one: the YAML breaks there
    for argv in (["generate", str(config.parent), "--max_new_tokens", "1"], ["evaluate", str(config.parent)]):
        err = cli_error(argv, capsys)
        assert f"error: {config} cannot be read as YAML: " in err, err
        assert f" at line {len(text.splitlines()) + 1}, column " in err and err.endswith("correct the file, or write it again\n")
