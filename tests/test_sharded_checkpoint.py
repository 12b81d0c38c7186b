"""fabric_lin/sharded_checkpoint.py: a sharded checkpoint's metadata is unpickled with DCP's own classes only; a foreign
pickle there is refused without running it. (Sharded checkpoints written by pretrain, converted and resumed on other
meshes in one process or several: test_pretrain_sharded.py.)"""
import pytest

from helpers import TouchOnUnpickle


def test_sharded_metadata_with_foreign_pickle_is_refused(tmp_path):
    import pickle

    from fabric_lin.sharded_checkpoint import load_sharded_model_state

    weights = tmp_path / "lit_model.pth"
    weights.mkdir()
    (weights / ".metadata").write_bytes(pickle.dumps(TouchOnUnpickle(tmp_path / "pwned")))
    with pytest.raises(ValueError, match="refers to posix.system|refers to os.system"):
        load_sharded_model_state(weights)
    assert not (tmp_path / "pwned").exists()
