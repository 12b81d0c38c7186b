"""load_model_dir_weights and check_state_dict: what generate and --initial_checkpoint_dir rely on; a shard that lacks
what its index places there or is not there, the order in which a model directory is written and that it replaces every
file of an earlier model (a file system error meanwhile named where the user looks), the input directory refused as
output_dir however named, a cast that keeps integer tensors, the models below a directory that holds none, each
directory asked once what it holds."""
import pytest
import torch
from safetensors.torch import save_file

from fabric_lin.config import Config
from fabric_lin.convert import model_dir
from fabric_lin.convert.model_dir import cast_floating, check_state_dict, load_model_dir_weights, load_safetensors_dir
from fabric_lin.model import GPT


@pytest.fixture
def config():
    return Config.from_name("gla-debug", num_layers=1, vocab_size=64)


def test_reads_lit_model_pth_and_safetensors_alike(tmp_path, config):
    torch.manual_seed(0)
    state = GPT(config).state_dict()
    (tmp_path / "pth").mkdir()
    torch.save({f"_orig_mod.{k}": v for k, v in state.items()}, tmp_path / "pth" / "lit_model.pth")
    (tmp_path / "st").mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "st" / "model.safetensors")
    for directory in ("pth", "st"):
        got = load_model_dir_weights(tmp_path / directory, config)
        assert sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'st' / 'model.safetensors'} holds a GLA model \(1 layer, "):
        load_model_dir_weights(tmp_path / "st", Config.from_name("gla-debug", num_layers=2, vocab_size=64))


def test_training_checkpoints_and_empty_directories_are_refused(tmp_path, config):
    state = GPT(config).state_dict()
    (tmp_path / "train").mkdir()
    torch.save({"model": state, "iter_num": 3}, tmp_path / "train" / "lit_model.pth")
    with pytest.raises(ValueError, match="is a training checkpoint .*convert_pretrained_checkpoint"):
        load_model_dir_weights(tmp_path / "train")
    (tmp_path / "sharded" / "lit_model.pth").mkdir(parents=True)
    with pytest.raises(ValueError, match="sharded training checkpoint"):
        load_model_dir_weights(tmp_path / "sharded")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no lit_model.pth"):
        load_model_dir_weights(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_model_dir_weights(tmp_path / "missing")
    (tmp_path / "odd").mkdir()
    torch.save({"w": torch.zeros(2), "step": 3}, tmp_path / "odd" / "lit_model.pth")
    with pytest.raises(ValueError, match="these entries are not: 'step'"):
        load_model_dir_weights(tmp_path / "odd")


def test_check_state_dict_lists_every_mismatch(config):
    model = GPT(config)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    check_state_dict(state, model)  # identical: no error
    check_state_dict({k: v.bfloat16() for k, v in state.items()}, model)  # another float precision loads
    with pytest.raises(ValueError, match="norm.weight: dtype torch.bfloat16, expected torch.float32"):
        check_state_dict({k: v.bfloat16() for k, v in state.items()}, model, exact_dtype=True)

    state["layers.0.mlp.up_proj.weight"] = state["layers.0.mlp.up_proj.weight"].t()
    state["norm.weight"] = state["norm.weight"].long()
    del state["lm_head.weight"]
    state["layers.0.attn.rotary.inv_freq"] = torch.zeros(4)
    with pytest.raises(ValueError) as info:
        check_state_dict(state, config, source="some/file.pth")
    lines = str(info.value).splitlines()
    assert lines[0] == "some/file.pth does not match the model:"
    assert "  missing (1): lm_head.weight" in lines
    assert "  unexpected (1): layers.0.attn.rotary.inv_freq" in lines
    assert "  layers.0.mlp.up_proj.weight: shape (128, 512), expected (512, 128)" in lines
    assert "  norm.weight: dtype torch.int64, expected torch.float32" in lines


@pytest.mark.parametrize("shard_of_b,error,message", [
    ("model-00001-of-00002.safetensors", ValueError,
     r"model.safetensors.index.json places b in model-00001-of-00002.safetensors, which lacks them$"),
    ("model-00002-of-00002.safetensors", FileNotFoundError,
     r"model.safetensors.index.json lists 'model-00002-of-00002.safetensors', which does not exist in "),
], ids=["lacks-a-tensor", "not-there"])
def test_a_shard_that_lacks_a_tensor_its_index_places_there_or_is_not_there_is_named(tmp_path, shard_of_b, error, message):
    import json

    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": shard_of_b}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(error, match=message):
        load_safetensors_dir(tmp_path)


def test_a_model_written_over_another_leaves_none_of_its_files(tmp_path, config):
    """--overwrite true: the earlier model's record of its tokenizer (trained_with.json) goes with its weights; left
    there, it would be taken for the record of the new weights, which come without one."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("trained_with.json", "tokenizer.model", "config.json", "notes.txt"):
        (out / name).write_text("of the earlier model")
    model_dir.save_model_dir(GPT(config).state_dict(), config, out)
    assert sorted(p.name for p in out.iterdir()) == ["lit_model.pth", "model_config.yaml", "notes.txt"]


def test_the_input_directory_named_another_way_is_no_output_dir(tmp_path, monkeypatch):
    """The model directory given as a relative output_dir and an absolute input (or through a link): writing there with
    --overwrite true would first delete the input's weights."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "lit_model.pth").write_bytes(b"x")
    (tmp_path / "link").symlink_to(tmp_path / "model", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for output_dir in (model_dir.Path("model"), tmp_path / "link"):
        with pytest.raises(ValueError, match=rf"^output_dir {output_dir} is the input directory"):
            model_dir.prepare_output_dir(output_dir, overwrite=True, sources=[tmp_path / "model"])


def test_a_model_directory_gets_its_weights_last(tmp_path, config, monkeypatch):
    """A directory left by a kill during the write holds no lit_model.pth, so no command takes it for a model."""
    written = []
    atomic_write = model_dir.atomic_write
    monkeypatch.setattr(model_dir, "atomic_write",
                        lambda path, write: written.append(path.name) or atomic_write(path, write))
    (tmp_path / "out").mkdir()
    model_dir.save_model_dir(GPT(config).state_dict(), config, tmp_path / "out")
    assert written[-1] == "lit_model.pth" and "model_config.yaml" in written


def test_a_cast_to_another_precision_keeps_integer_tensors():
    state = {"w": torch.ones(2), "step": torch.tensor([7], dtype=torch.int64)}
    cast = cast_floating(state, torch.bfloat16)
    assert cast["w"].dtype == torch.bfloat16 and cast["step"].dtype == torch.int64 and cast["step"].item() == 7


def test_a_cast_past_the_range_of_float16_names_the_tensor(tmp_path, config):
    """A weight above float16's largest value (65504) became inf in the export or model directory, without a word."""
    state = {"norm.weight": torch.tensor([1.0, 7e4]), "w": torch.tensor([float("inf")])}  # an inf already there stays
    with pytest.raises(ValueError, match=r"^--dtype float16: norm.weight holds 70000, past float16's largest value "
                                         r"\(65504\), which would be inf: give --dtype bfloat16 or float32$"):
        cast_floating(dict(state), torch.float16)
    assert cast_floating(dict(state), torch.bfloat16)["norm.weight"][1] == 70144  # bfloat16 has float32's range
    assert cast_floating({"w": torch.tensor([-65504.0])}, torch.float16)["w"].item() == -65504


def test_models_below_asks_what_each_directory_holds_once(tmp_path, monkeypatch):
    """The directories below one that holds no model, each asked once what it holds: the list names the kind it found,
    without asking the models it found a second time (a training checkpoint's is a look into its files)."""
    from collections import Counter

    for name in ("a", "b", "c", "d", "e"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "model_config.yaml").write_text("name: gla-debug\n")
    (tmp_path / "runs" / "notes").mkdir()
    asked = Counter()
    what_it_holds = model_dir.what_it_holds

    def counted(directory):
        asked[directory] += 1
        return what_it_holds(directory)

    monkeypatch.setattr(model_dir, "what_it_holds", counted)
    runs = tmp_path / "runs"
    assert model_dir.models_below(tmp_path) == (
        f"below it: {runs / 'a'} (a model directory), {runs / 'b'} (a model directory), {runs / 'c'} (a model directory), "
        f"{runs / 'd'} (a model directory), ... (1 more)")
    # the six directories below tmp_path/runs and runs itself, each once
    assert sorted(asked.values()) == [1] * 7 and set(asked) == {runs, *runs.iterdir()}


def test_a_conversion_killed_before_its_weights_is_no_model_and_overwrite_takes_its_part_written_file(tmp_path, config):
    """A conversion killed while it wrote lit_model.pth (no time to take its files back) leaves model_config.yaml, the
    tokenizer and a part-written .tmp-lit_model.pth, up to the model's size: the refusal of that directory said it held
    "a model directory already" that --overwrite true would replace, and --overwrite true left the part-written file
    there for good."""
    from fabric_lin.errors import AlreadyExists

    out = tmp_path / "out"
    out.mkdir()
    config.save(out / "model_config.yaml")
    for name in ("tokenizer.model", "trained_with.json"):
        (out / name).write_text("written before the kill")
    (out / ".tmp-lit_model.pth").write_bytes(b"the first part of the weights")
    (out / "notes.txt").write_text("the user's own file stays")
    with pytest.raises(AlreadyExists, match=rf"^output_dir {out} holds a model_config.yaml without weights "
                                            r"\(lit_model.pth\), and the part-written .tmp-lit_model.pth of a "
                                            r"conversion that was stopped: no whole model; pass --overwrite true"):
        model_dir.prepare_output_dir(out, overwrite=False)
    (out / "model_config.yaml").unlink()  # killed at its first file: the part-written file alone is named
    with pytest.raises(AlreadyExists, match=r"holds the part-written .tmp-lit_model.pth of a conversion that was stopped"):
        model_dir.prepare_output_dir(out, overwrite=False)
    model_dir.save_model_dir(GPT(config).state_dict(), config, model_dir.prepare_output_dir(out, overwrite=True))
    assert sorted(p.name for p in out.iterdir()) == ["lit_model.pth", "model_config.yaml", "notes.txt"]


def test_a_model_written_over_a_hugging_face_model_leaves_none_of_its_files(tmp_path, config):
    """save_pretrained writes a tokenizer.json, which transformers' AutoTokenizer reads before tokenizer.model, and a
    generation_config.json, whose ids generate takes before config.json's: left beside a model written over that one,
    they were the earlier model's tokenizer and end-of-text id for the new weights."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "special_tokens_map.json", "added_tokens.json",
                 "generation_config.json", "notes.txt"):
        (out / name).write_text("of the earlier model")
    model_dir.save_model_dir(GPT(config).state_dict(), config, out)
    assert sorted(p.name for p in out.iterdir()) == ["lit_model.pth", "model_config.yaml", "notes.txt"]


def test_the_replacement_takes_the_earlier_weights_first_and_brings_the_new_ones_last(tmp_path, config, monkeypatch):
    """--overwrite true, once the new model is written aside: a kill -9 within the replacement leaves no mix of two
    models and nothing taken for one, as the earlier export's weights and config.json go before its other files, and
    the new lit_model.pth comes after every other file of its model. A power cut loses neither: every new file is on
    the disk before the first earlier one goes, and the directory's renames once the last is made."""
    import os
    from pathlib import Path

    out = tmp_path / "out"
    out.mkdir()
    for name in ("added_tokens.json", "config.json", "model.safetensors", "tokenizer.model", "trained_with.json"):
        (out / name).write_text("of the earlier model")
    steps = []
    unlink, replace = Path.unlink, os.replace

    def removed(path, *args, **kwargs):
        if path.parent == out:
            steps.append(("removed", path.name))
        return unlink(path, *args, **kwargs)

    def moved(src, dst, *args, **kwargs):
        if Path(dst).parent == out:
            steps.append(("moved", Path(dst).name))
        return replace(src, dst, *args, **kwargs)

    def synced(path):
        steps.append(("synced", "the directory" if Path(path) == out else Path(path).name))
        return sync_to_disk(path)

    sync_to_disk = model_dir.sync_to_disk
    monkeypatch.setattr(Path, "unlink", removed)
    monkeypatch.setattr(os, "replace", moved)
    monkeypatch.setattr(model_dir, "sync_to_disk", synced)
    model_dir.save_model_dir(GPT(config).state_dict(), config, out)
    assert sorted(steps[:2]) == [("synced", "lit_model.pth"), ("synced", "model_config.yaml")]
    assert steps[2:] == [("removed", "config.json"), ("removed", "model.safetensors"), ("removed", "added_tokens.json"),
                         ("removed", "tokenizer.model"), ("removed", "trained_with.json"),
                         ("moved", "model_config.yaml"), ("moved", "lit_model.pth"), ("synced", "the directory")]


def test_a_file_system_error_in_the_staging_directory_names_the_file_where_it_would_have_been(tmp_path):
    """A full disk as the new model is written aside: the error names the file in output_dir (where the user looks,
    not the hidden staging directory), keeps its errno and message, and the earlier model stays; an error of another
    file (a source read) or of none is raised as it is. A staging directory left by a conversion killed outright
    brings none of its files into the new model."""
    import errno

    out = tmp_path / "out"
    out.mkdir()
    (out / "lit_model.pth").write_bytes(b"the earlier weights")
    errors = [OSError(errno.ENOSPC, "No space left on device", str(out / model_dir.STAGING_DIR / "lit_model.pth")),
              OSError(errno.EACCES, "Permission denied", str(tmp_path / "source" / "tokenizer.model")),
              OSError(errno.EIO, "Input/output error")]
    for error in errors:
        with pytest.raises(OSError) as raised:
            with model_dir.model_written_aside(out) as staging:
                (staging / "model_config.yaml").write_text("the new model's")
                raise error
        named = str(out / "lit_model.pth") if error.errno == errno.ENOSPC else error.filename
        got = raised.value
        assert (got.errno, got.strerror, got.filename) == (error.errno, error.strerror, named)
        assert sorted(p.name for p in out.iterdir()) == ["lit_model.pth"]
    (out / model_dir.STAGING_DIR).mkdir()
    (out / model_dir.STAGING_DIR / "tokenizer.model").write_text("of a conversion killed outright")
    with model_dir.model_written_aside(out) as staging:
        (staging / "lit_model.pth").write_bytes(b"the new weights")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {"lit_model.pth": b"the new weights"}
