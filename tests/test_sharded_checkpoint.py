"""fabric_lin/sharded_checkpoint.py: a sharded checkpoint's metadata is unpickled with DCP's own classes only; a foreign
pickle there (os.system, builtins.exec, torch.save, torch's and DCP's other globals) or in an entry is refused without
running it, metadata of another kind is named, a shard file named outside the checkpoint is not read, model entries
that are not tensors are named, not dropped, and a DCP directory without the entries read is named; a one-file
checkpoint's optimizer state is resumed in a sharded run only into parameter groups of the sizes it was saved with,
each parameter getting its own state, and only into a model of its parameters; a sharded checkpoint resumed in a run
that does not shard gives each parameter the state saved under its name (whatever order its model registered them in),
the counters and the data loader's position, and is refused where its model or its groups hold other parameters (groups
of the same sizes too); both take a resuming model wrapped for activation checkpointing. A sharded run resuming its own
checkpoint keeps its data loader, at the saved position. A shard, .metadata or meta.pt missing, cut short (by one byte
too) or garbled is named in one line by every reader, in one process or in a sharded run (and by evaluate and convert
where a shard goes after the manifest verified, or during the read); a Ctrl-C during a read stays a Ctrl-C.
(Sharded checkpoints written by pretrain, converted and resumed on other meshes in one process or several:
test_pretrain_sharded.py.)"""
import collections
import re
import types

import pytest
import torch

from fabric_lin.sharded_checkpoint import load_one_file_train_state, load_sharded_model_state
from fabric_lin.weights import canonical_name
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
    with pytest.raises(ValueError) as info:
        load_sharded_model_state(weights)
    assert str(info.value) == (f"{weights / '.metadata'} refers to {named}, which is not part of a torch.distributed."
                               f"checkpoint metadata file; refusing to unpickle it")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("module, name", [
    ("torch", "set_default_dtype"),  # a function of torch's own namespace, which changes this process's state
    ("torch.distributed.checkpoint.metadata", "os"),  # a module that DCP's metadata module imports
])
def test_sharded_metadata_naming_other_globals_of_torch_or_dcp_is_refused(tmp_path, module, name):
    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(f"c{module}\n{name}\n.".encode())  # pickle's GLOBAL opcode, and stop
    with pytest.raises(ValueError, match=rf"refers to {module}.{name}, which is not part of a torch.distributed.checkpoint"):
        load_sharded_model_state(weights)


def test_sharded_metadata_of_another_kind_is_named(tmp_path):
    import pickle

    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(collections.OrderedDict(model={})))
    with pytest.raises(ValueError, match=r"\.metadata: expected a torch.distributed.checkpoint Metadata, got OrderedDict"):
        load_sharded_model_state(weights)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_entry_holding_objects_other_than_plain_values_is_refused_without_running_them(tmp_path):
    import torch.distributed.checkpoint as dcp

    from fabric_lin.sharded_checkpoint import read_sharded_entry

    weights = tmp_path / "lit_model.pth"
    dcp.save({"model": {"w": torch.ones(3)}, "optimizer": {"param_groups": [{"lr": TouchOnUnpickle(tmp_path / "pwned")}]}},
             checkpoint_id=weights, no_dist=True)
    with pytest.raises(ValueError, match=rf"{weights}: its entry 'optimizer.param_groups.0.lr' holds objects other than "
                       r"tensors and plain containers, so it is not loaded \(files are never unpickled beyond tensors\)\. "
                       r"Details: .*GLOBAL (posix|os)\.system"):
        read_sharded_entry(weights, "optimizer")
    assert not (tmp_path / "pwned").exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_without_the_entries_read_is_named(tmp_path):
    """A torch.distributed.checkpoint directory of another trainer (e.g. keyed by parameter names at the top level)."""
    import torch.distributed.checkpoint as dcp

    from fabric_lin.sharded_checkpoint import read_sharded_entry

    dcp.save({"layers.0.weight": torch.ones(3), "step": 5}, checkpoint_id=tmp_path / "lit_model.pth", no_dist=True)
    with pytest.raises(ValueError, match=r"no tensors under 'model'; the checkpoint's top-level entries are "
                       r"\['layers.0.weight', 'step'\]"):
        load_sharded_model_state(tmp_path / "lit_model.pth")
    with pytest.raises(ValueError, match=r"lit_model.pth: no entry 'optimizer' in the checkpoint"):
        read_sharded_entry(tmp_path / "lit_model.pth", "optimizer")


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
    """A projection and a norm, registered norm first (the parameters' order is not the optimizer groups'), or, with
    `projection_first`, the same parameters registered in the other order."""

    def __init__(self, projection_first: bool = False):
        super().__init__()
        modules = [("proj", torch.nn.Linear(4, 3)), ("norm", torch.nn.LayerNorm(3))]
        for name, module in modules if projection_first else modules[::-1]:
            self.add_module(name, module)

    def forward(self, x):
        return self.norm(self.proj(x))


def checkpointed(model: Tiny) -> Tiny:
    """`model` with its projection wrapped for activation checkpointing, as pretrain wraps the Blocks: its parameters'
    names gain the wrapper's prefix (proj._checkpoint_wrapped_module.weight), which no checkpoint holds."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, torch.nn.Linear))
    assert "proj._checkpoint_wrapped_module.weight" in dict(model.named_parameters())
    return model


GROUPINGS = {  # an optimizer's parameter groups
    # pretrain's: weight decay on the projection's weight, none on biases and norms, each group in the model's order
    "pretrain's": lambda m: [{"params": [m.proj.weight], "weight_decay": 0.1},
                             {"params": [p for p in m.parameters() if p is not m.proj.weight], "weight_decay": 0.0}],
    "one group": lambda m: [{"params": list(m.parameters()), "weight_decay": 0.1}],
    "without norm.bias": lambda m: [{"params": [m.proj.weight], "weight_decay": 0.1},
                                    {"params": [m.proj.bias, m.norm.weight], "weight_decay": 0.0}],
}


def moments(model, optimizer) -> dict:
    """Each parameter's AdamW exp_avg, by name (the bare model's)."""
    return {canonical_name(name): optimizer.state[p]["exp_avg"] for name, p in model.named_parameters()
            if p in optimizer.state}


def save_one_file_checkpoint(path, grouping: str) -> dict:
    """A one-file lit_model.pth after one AdamW step of a Tiny with `grouping`; each parameter's exp_avg by name."""
    model = Tiny()
    optimizer = torch.optim.AdamW(GROUPINGS[grouping](model))
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step_count": 1}, path)
    return moments(model, optimizer)


def resuming_state(wrap=lambda model: model) -> dict:
    """What load_one_file_train_state restores in place: a fresh Tiny (`wrap`ped) and pretrain's groups, in Fabric's
    wrappers."""
    model = wrap(Tiny())
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
    torch.testing.assert_close(moments(state["model"].module, state["optimizer"].optimizer), expected, rtol=0, atol=0)
    assert state["step_count"] == 1


def test_a_one_file_checkpoint_resumes_into_a_model_wrapped_for_activation_checkpointing(tmp_path):
    """The resuming run's parameters are named with the wrapper's prefix, the checkpoint's without: each gets its own
    weights and moments all the same."""
    torch.manual_seed(0)
    expected = save_one_file_checkpoint(tmp_path / "one.pth", "pretrain's")
    state = resuming_state(checkpointed)
    load_one_file_train_state(tmp_path / "one.pth", state)
    model = state["model"].module
    torch.testing.assert_close({canonical_name(n): p.detach() for n, p in model.named_parameters()},
                               torch.load(tmp_path / "one.pth", weights_only=True)["model"], rtol=0, atol=0)
    torch.testing.assert_close(moments(model, state["optimizer"].optimizer), expected, rtol=0, atol=0)


def test_a_one_file_checkpoint_of_another_model_is_refused_naming_the_parameters(tmp_path):
    save_one_file_checkpoint(tmp_path / "other.pth", "pretrain's")
    saved = torch.load(tmp_path / "other.pth", weights_only=True)
    saved["model"]["ln.weight"] = saved["model"].pop("norm.weight")
    torch.save(saved, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"other.pth: the checkpoint's model does not fit this run's: missing "
                       r"\['norm.weight'\], unexpected \['ln.weight'\]"):
        load_one_file_train_state(tmp_path / "other.pth", resuming_state())
    saved["model"]["norm.weight"] = saved["model"].pop("ln.weight")
    saved["model"]["extra.weight"] = torch.zeros(3)  # a parameter this run's model does not have, and none missing
    torch.save(saved, tmp_path / "other.pth")
    with pytest.raises(ValueError, match=r"missing \[\], unexpected \['extra.weight'\]"):
        load_one_file_train_state(tmp_path / "other.pth", resuming_state())


# ---------------------------------------------------------------- a sharded checkpoint, in a run that does not shard


class ResumableLoader(torch.utils.data.DataLoader):
    """A data loader whose position a checkpoint holds, as litdata's does."""

    def __init__(self):
        super().__init__(range(4))
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def save_sharded_checkpoint(path, model: Tiny, optimizer_state=None) -> dict:
    """A sharded lit_model.pth of `model` after one AdamW step with pretrain's groups, as Fabric writes one
    (torch.distributed.checkpoint's files of the model's and the optimizer's state dicts, keyed by parameter names, and
    meta.pt with the rest), in this process alone: each tensor in one piece. Returns each parameter's exp_avg by name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    optimizer = torch.optim.AdamW(GROUPINGS["pretrain's"](model))
    model(torch.randn(2, 4)).square().sum().backward()
    optimizer.step()
    saved_optimizer = get_optimizer_state_dict(model, optimizer) if optimizer_state is None else optimizer_state
    dcp.save({"model": get_model_state_dict(model), "optimizer": saved_optimizer}, checkpoint_id=path, no_dist=True)
    torch.save({"step_count": 1, "train_dataloader": {"position": 3}}, path / "meta.pt")
    return moments(model, optimizer)


def resuming_unsharded_state(wrap=lambda model: model) -> dict:
    """What load_sharded_train_state restores in place: a fresh Tiny (registered norm first, `wrap`ped), pretrain's
    groups and a data loader in Fabric's wrapper."""
    from lightning_fabric.wrappers import _FabricDataLoader

    model = wrap(Tiny())
    return {"model": model, "optimizer": torch.optim.AdamW(GROUPINGS["pretrain's"](model)), "step_count": 0,
            "train_dataloader": _FabricDataLoader(ResumableLoader())}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("projection_first, wrap", [(False, None), (True, None), (False, checkpointed)],
                         ids=["same-order", "registered-in-another-order", "resumed-with-activation-checkpointing"])
def test_a_sharded_checkpoint_resumes_in_a_run_that_does_not_shard(tmp_path, projection_first, wrap):
    """The weights, each parameter's moments (saved under its name: whatever order the saving run's model registered its
    parameters in, and so its groups listed them, and whatever wrapper the resuming run's model puts around a module),
    the counters and the data loader's position."""
    from fabric_lin.sharded_checkpoint import load_sharded_train_state

    torch.manual_seed(0)
    saved_model = Tiny(projection_first)
    expected = save_sharded_checkpoint(tmp_path / "lit_model.pth", saved_model)
    state = resuming_unsharded_state(wrap) if wrap else resuming_unsharded_state()
    load_sharded_train_state(tmp_path / "lit_model.pth", state)
    model, optimizer = state["model"], state["optimizer"]
    torch.testing.assert_close({canonical_name(n): p for n, p in model.named_parameters()},
                               dict(saved_model.named_parameters()), rtol=0, atol=0)
    torch.testing.assert_close(moments(model, optimizer), expected, rtol=0, atol=0)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert state["step_count"] == 1 and state["train_dataloader"]._dataloader.position == 3


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_of_other_parameters_or_groups_is_refused_naming_them(tmp_path):
    from fabric_lin.sharded_checkpoint import load_sharded_train_state

    class Renamed(Tiny):
        def __init__(self):
            super().__init__()
            self.ln = self.norm
            del self.norm

        def forward(self, x):
            return self.ln(self.proj(x))

    save_sharded_checkpoint(tmp_path / "renamed", Renamed())
    with pytest.raises(ValueError, match=r"renamed: the checkpoint's model does not fit this run's: missing \['norm.bias', "
                       r"'norm.weight'\], unexpected \['ln.bias', 'ln.weight'\]"):
        load_sharded_train_state(tmp_path / "renamed", resuming_unsharded_state())
    # the same parameters, grouped otherwise (norm.bias with weight decay)
    model = Tiny()
    optimizer = torch.optim.AdamW([{"params": [model.proj.weight, model.norm.bias], "weight_decay": 0.1},
                                   {"params": [model.norm.weight, model.proj.bias], "weight_decay": 0.0}])
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    save_sharded_checkpoint(tmp_path / "regrouped", model, get_optimizer_state_dict(model, optimizer))
    with pytest.raises(ValueError, match=r"regrouped: the checkpoint's optimizer groups the parameters otherwise than "
                       r"this run's: its group 0 holds \['norm.bias', 'proj.weight'\], this run's \['proj.weight'\]"):
        load_sharded_train_state(tmp_path / "regrouped", resuming_unsharded_state())
    # groups of this run's sizes (1 + 3) holding other parameters: weight decay on the norm's bias, none on the projection
    optimizer = torch.optim.AdamW([{"params": [model.norm.bias], "weight_decay": 0.1},
                                   {"params": [model.norm.weight, model.proj.weight, model.proj.bias], "weight_decay": 0.0}])
    save_sharded_checkpoint(tmp_path / "swapped", model, get_optimizer_state_dict(model, optimizer))
    with pytest.raises(ValueError, match=r"swapped: the checkpoint's optimizer groups the parameters otherwise than "
                       r"this run's: its group 0 holds \['norm.bias'\], this run's \['proj.weight'\]"):
        load_sharded_train_state(tmp_path / "swapped", resuming_unsharded_state())
    # the state of a parameter that no group holds
    saved_optimizer = get_optimizer_state_dict(model, torch.optim.AdamW(GROUPINGS["pretrain's"](model)))
    saved_optimizer["state"]["ghost.weight"] = {"step": torch.tensor(1.0)}
    save_sharded_checkpoint(tmp_path / "ghost", model, saved_optimizer)
    with pytest.raises(ValueError, match=r"ghost: the optimizer state names parameter 'ghost.weight', which this run's "
                       r"model does not have"):
        load_sharded_train_state(tmp_path / "ghost", resuming_unsharded_state())


# ---------------------------------------------------------------- a damaged or incomplete sharded checkpoint


def _shard_missing(weights):
    (weights / "__0_0.distcp").unlink()


def _shard_truncated(weights):
    with open(weights / "__0_0.distcp", "r+b") as f:
        f.truncate(100)


def _shard_short_by_a_byte(weights):  # what the furthest byte the .metadata places there needs
    shard = weights / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1)


def _shard_garbled(weights):  # its size kept: what only the manifest's CRC-32 would tell
    shard = weights / "__0_0.distcp"
    shard.write_bytes(bytes(shard.stat().st_size))


def _metadata_missing(weights):
    (weights / ".metadata").unlink()


def _metadata_truncated(weights):
    metadata = (weights / ".metadata").read_bytes()
    (weights / ".metadata").write_bytes(metadata[:len(metadata) // 2])


def _fabric_meta_missing(weights):
    (weights / "meta.pt").unlink()


DAMAGES = {  # what is done to a sharded lit_model.pth -> the error that names it (its message as a pattern)
    "shard missing": (_shard_missing, FileNotFoundError,
                      r"{weights}: the sharded checkpoint is incomplete: its shard __0_0\.distcp is missing"),
    "shard truncated": (_shard_truncated, ValueError,
                        r"{weights}/__0_0\.distcp is truncated: 100 bytes, where the checkpoint's \.metadata places data "
                        r"up to byte [\d,]+$"),
    "shard short by a byte": (_shard_short_by_a_byte, ValueError,
                              r"{weights}/__0_0\.distcp is truncated: [\d,]+ bytes, where the checkpoint's \.metadata "
                              r"places data up to byte [\d,]+$"),
    "shard garbled": (_shard_garbled, ValueError,
                      r"{weights}: the sharded checkpoint cannot be read \(UnpicklingError: Weights only load failed\): "
                      r"it is damaged; load an older checkpoint of the run$"),
    ".metadata missing": (_metadata_missing, FileNotFoundError,
                          r"{weights}: the sharded checkpoint has no \.metadata \(.*\): it is incomplete$"),
    ".metadata truncated": (_metadata_truncated, ValueError,
                            r"{weights}/\.metadata is damaged: it does not read as torch\.distributed\.checkpoint's "
                            r"metadata \(UnpicklingError: pickle data was truncated\)$"),
}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("damage", [*DAMAGES, "meta.pt missing"])
def test_a_damaged_or_incomplete_sharded_checkpoint_is_named_in_one_line(tmp_path, damage):
    """Each reader of a sharded lit_model.pth in one process (a model's weights, an entry, the whole train state) names
    the file that is missing, cut short or garbled: torch.distributed.checkpoint raised its CheckpointException, a
    BaseException whose message is the traceback of each rank's failure (no --resume, evaluate or convert caught it),
    and the missing .metadata or meta.pt, or a .metadata cut short, came as Python's own error, a traceback too."""
    from fabric_lin.cli import expected_failure
    from fabric_lin.sharded_checkpoint import load_sharded_train_state, read_sharded_entry

    weights = tmp_path / "lit_model.pth"
    save_sharded_checkpoint(weights, Tiny())
    if damage == "meta.pt missing":  # read by a resume alone: the train state beside the model and the optimizer
        _fabric_meta_missing(weights)
        with pytest.raises(FileNotFoundError, match=rf"{weights}: the sharded checkpoint is incomplete: meta\.pt is "
                           r"missing \(Fabric's file of the train state"):
            load_sharded_train_state(weights, resuming_unsharded_state())
        return
    do, error, message = DAMAGES[damage]
    do(weights)
    readers = [load_sharded_model_state, lambda path: read_sharded_entry(path, "optimizer"),
               lambda path: load_sharded_train_state(path, resuming_unsharded_state())]
    for read in readers[:1] if damage == "shard garbled" else readers:  # zeros read as tensors, as pickles not
        with pytest.raises(error, match=message.format(weights=re.escape(str(weights)))) as info:
            read(weights)
        assert expected_failure(info.value)  # the CLI's one line


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_ctrl_c_while_a_sharded_checkpoint_is_read_stays_a_ctrl_c(tmp_path, monkeypatch):
    """torch.distributed.checkpoint catches every failure of a read, a KeyboardInterrupt too, into its
    CheckpointException: the CLI printed its traceback instead of `interrupted`."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    weights = tmp_path / "lit_model.pth"
    save_sharded_checkpoint(weights, Tiny())

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(DefaultLoadPlanner, "resolve_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_sharded_model_state(weights)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_shard_gone_while_the_checkpoint_is_read_is_named(tmp_path, monkeypatch):
    """The files are checked before the read, but the run that wrote the checkpoint may prune it in the meantime
    (keep_last_n): a shard gone by the time torch.distributed.checkpoint opens it is named as one gone before."""
    from fabric_lin.sharded_checkpoint import _SafeDCPReader

    weights = tmp_path / "lit_model.pth"
    save_sharded_checkpoint(weights, Tiny())
    read_data = _SafeDCPReader.read_data

    def pruned_first(self, *args, **kwargs):
        (weights / "__0_0.distcp").unlink()
        return read_data(self, *args, **kwargs)

    monkeypatch.setattr(_SafeDCPReader, "read_data", pruned_first)
    with pytest.raises(FileNotFoundError) as info:
        load_sharded_model_state(weights)
    assert str(info.value) == (f"{weights}: the sharded checkpoint is incomplete: its shard __0_0.distcp is missing (its "
                               f".metadata places tensors in it)")


def sharded_training_checkpoint(checkpoint):
    """A training checkpoint of a one-layer gla-debug at `checkpoint` whose lit_model.pth is sharded (one shard, written
    in this process) and whose manifest verifies; the model's entry alone, as evaluate and convert read it."""
    import torch.distributed.checkpoint as dcp

    from fabric_lin.checkpoint import write_manifest
    from fabric_lin.config import Config
    from fabric_lin.model import GPT
    from helpers import write_checkpoint_dir_files

    class OneProcess:
        global_rank, world_size = 0, 1

        def broadcast(self, obj, src=0):
            return obj

    config = Config.from_name("gla-debug", num_layers=1)
    write_checkpoint_dir_files(checkpoint, config)
    dcp.save({"model": GPT(config).state_dict()}, checkpoint_id=checkpoint / "lit_model.pth", no_dist=True)
    torch.save({"step_count": 2}, checkpoint / "lit_model.pth" / "meta.pt")
    (checkpoint / "step.json").write_text('{"step_count": 2}\n')
    write_manifest(OneProcess(), checkpoint)
    return checkpoint


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("command", ["evaluate", "convert_pretrained_checkpoint"])
def test_the_weights_of_a_sharded_checkpoint_given_for_it_are_named(tmp_path, capsys, command):
    """A sharded checkpoint's lit_model.pth/ (a directory, as a checkpoint is) given in place of the checkpoint: evaluate
    said it holds none of a model's files; both commands say which directory to give."""
    from helpers import cli_error

    checkpoint = sharded_training_checkpoint(tmp_path / "out" / "step-00000002")
    argv = [command, str(checkpoint / "lit_model.pth")] + (
        ["--output_dir", str(tmp_path / "model")] if command.startswith("convert") else [])
    assert cli_error(argv, capsys) == (f"fabric-lin {command}: error: {checkpoint / 'lit_model.pth'} is the weights of "
                                       f"the training checkpoint {checkpoint}: pass that directory\n")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("command", ["evaluate", "convert_pretrained_checkpoint"])
def test_a_shard_gone_after_the_checkpoint_verified_is_named_by_the_command(tmp_path, monkeypatch, capsys, command):
    """A training checkpoint verifies against its manifest, then loses a shard before it is read (the run still writing
    checkpoints prunes it, keep_last_n): the command says which file went, in one line, instead of a traceback."""
    import fabric_lin.checkpoint_kinds as checkpoint_kinds
    from fabric_lin.checkpoint import verify_checkpoint
    from helpers import cli_error

    checkpoint = sharded_training_checkpoint(tmp_path / "out" / "step-00000002")

    def verified_then_pruned(directory, fabric=None, model_only=False):
        check = verify_checkpoint(directory, fabric, model_only)
        (checkpoint / "lit_model.pth" / "__0_0.distcp").unlink()
        return check

    monkeypatch.setattr(checkpoint_kinds, "verify_checkpoint", verified_then_pruned)
    argv = [command, str(checkpoint)] + (["--output_dir", str(tmp_path / "model")] if command.startswith("convert") else [])
    line = cli_error(argv, capsys)
    assert line == (f"fabric-lin {command}: error: {checkpoint / 'lit_model.pth'}: the sharded checkpoint is incomplete: "
                    f"its shard __0_0.distcp is missing (its .metadata places tensors in it)\n")


def _sharded_run_resumes_its_checkpoint(rank: int, out_dir, port: int) -> None:
    """One of the 2 CPU processes of a sharded (FSDP2) run: it saves a checkpoint at step 5 with its data loader 3
    batches in, then resumes it into a fresh train state (the loader, Fabric-wrapped as pretrain's is, at 0); what it
    resumed is left in out_dir/../resumed-<rank>.pt."""
    from lightning_fabric.wrappers import _FabricDataLoader

    from fabric_lin.checkpoint import Checkpointer, load_train_state, train_state
    from helpers import sharded_gla_rank

    fabric, state, config = sharded_gla_rank(rank, port, "sharded-resume")
    state.update(step_count=5, iter_num=20, train_dataloader=_FabricDataLoader(ResumableLoader()))
    state["train_dataloader"]._dataloader.position = 3
    saved = Checkpointer(out_dir, {}, config).save(fabric, state)
    loader = _FabricDataLoader(ResumableLoader())
    resumed = train_state(state["model"], state["optimizer"], loader)
    load_train_state(fabric, saved, resumed)
    torch.save({"loader kept": resumed["train_dataloader"] is loader, "position": loader._dataloader.position,
                "counters": (resumed["step_count"], resumed["iter_num"])}, out_dir.parent / f"resumed-{rank}.pt")


@pytest.mark.slow
def test_a_sharded_run_resumes_its_data_loaders_position_and_counters(tmp_path):
    """Fabric's sharded load puts what a checkpoint saved of an object other than the model and the optimizer (the data
    loader's state dict) in the object's place; resumed, each rank's loader is the run's own, at the saved position."""
    from helpers import run_forked_ranks

    assert run_forked_ranks(lambda rank, port: _sharded_run_resumes_its_checkpoint(rank, tmp_path / "out", port)) == [0, 0]
    for rank in (0, 1):
        assert torch.load(tmp_path / f"resumed-{rank}.pt", weights_only=True) == {
            "loader kept": True, "position": 3, "counters": (5, 20)}, rank


def _sharded_run_resumes_damaged_copies(rank: int, out_dir, port: int) -> None:
    """One of the 2 CPU processes of a sharded (FSDP2) run, started as torchrun starts them: it saves a checkpoint,
    rank 0 makes a damaged copy of it for each of DAMAGES and one without meta.pt, and every rank resumes each copy
    (Fabric's own sharded load); what each raised is left in out_dir/../rank-<rank>.pt."""
    import shutil

    from fabric_lin.checkpoint import Checkpointer, load_train_state
    from helpers import sharded_gla_rank

    fabric, state, config = sharded_gla_rank(rank, port, "damaged-resume")
    saved = Checkpointer(out_dir, {}, config).save(fabric, state)
    damages = {**{name: do for name, (do, _, _) in DAMAGES.items()}, "meta.pt missing": _fabric_meta_missing}
    if rank == 0:
        for name, do in damages.items():
            shutil.copytree(saved, out_dir / name)
            do(out_dir / name / "lit_model.pth")
    fabric.barrier()
    raised = {}
    for name in damages:
        try:
            load_train_state(fabric, out_dir / name, state)
        except BaseException as error:  # what the load raised is the result
            raised[name] = (type(error).__name__, str(error))
    torch.save(raised, out_dir.parent / f"rank-{rank}.pt")


@pytest.mark.slow
def test_a_sharded_run_resuming_a_damaged_sharded_checkpoint_names_what_is_wrong(tmp_path):
    """Fabric's sharded load, on each rank of a run of 2 processes: a missing or truncated shard, a garbled one, a
    missing or truncated .metadata (torch's CheckpointException, or Python's EOFError, on every rank), and a missing
    meta.pt (Lightning's ValueError that the path is no checkpoint) are named as a run of one process names them."""
    from helpers import run_forked_ranks

    out_dir = tmp_path / "out"
    assert run_forked_ranks(lambda rank, port: _sharded_run_resumes_damaged_copies(rank, out_dir, port)) == [0, 0]
    for rank in (0, 1):
        raised = torch.load(tmp_path / f"rank-{rank}.pt", weights_only=True)
        for name, (_, error, message) in DAMAGES.items():
            expected = "MissingFile" if error is FileNotFoundError else "InvalidValue"
            weights = out_dir / name / "lit_model.pth"
            assert raised[name][0] == expected and re.match(message.format(weights=re.escape(str(weights))),
                                                            raised[name][1]), (rank, name, raised[name])
        assert raised["meta.pt missing"] == ("MissingFile", f"{out_dir / 'meta.pt missing' / 'lit_model.pth'}: the "
                                             f"sharded checkpoint is incomplete: meta.pt is missing (Fabric's file of the "
                                             f"train state that is neither the model nor the optimizer)")
