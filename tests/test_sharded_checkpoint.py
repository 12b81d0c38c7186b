"""fabric_lin/sharded_checkpoint.py: a sharded checkpoint's metadata is unpickled with DCP's own classes only; a foreign
pickle there is refused without running it, a shard file named outside the checkpoint is not read, and model entries that
are not tensors are named, not dropped. (Sharded checkpoints written by pretrain, converted and resumed on other meshes
in one process or several: test_pretrain_sharded.py.)"""
import pytest
import torch

from fabric_lin.sharded_checkpoint import load_sharded_model_state
from helpers import TouchOnUnpickle


def test_sharded_metadata_with_foreign_pickle_is_refused(tmp_path):
    import pickle

    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(TouchOnUnpickle(tmp_path / "pwned")))
    with pytest.raises(ValueError, match="refers to posix.system|refers to os.system"):
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
