"""The tokenizer files a run's checkpoints hold: those of its tokenizer as the run found them at its start, also where
their directory is deleted or written over while it trains. A save copied them from the directory then, and failed on a
directory gone (the steps since the checkpoint before lost with it) or took another tokenizer than the one its
trained_with.json records."""
import shutil

import lightning_fabric as L
import pytest
import torch

from fabric_lin.checkpoint import Checkpointer, train_state
from fabric_lin.config import Config
from fabric_lin.save_failures import CheckpointFileIO
from helpers import train_sentencepiece


@pytest.mark.parametrize("change", ["deleted", "written over"])
def test_checkpoints_hold_the_tokenizer_the_run_started_with(tmp_path, change):
    tokenizer_dir = tmp_path / "tok"
    train_sentencepiece(tokenizer_dir)
    (tokenizer_dir / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    started_with = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir()}  # the reference: the files at the start

    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[CheckpointFileIO()])
    model = torch.nn.Linear(4, 3)
    state = train_state(model, torch.optim.AdamW(model.parameters()), train_dataloader={"samples": 4})
    checkpointer = Checkpointer(tmp_path / "out", {}, Config.from_name("gla-debug"), tokenizer_dir=tokenizer_dir)
    state["step_count"] = 2
    checkpointer.save(fabric, state)
    shutil.rmtree(tokenizer_dir)
    if change == "written over":
        train_sentencepiece(tokenizer_dir, vocab_size=48)
        assert (tokenizer_dir / "tokenizer.model").read_bytes() != started_with["tokenizer.model"]
    state["step_count"] = 4
    saved = checkpointer.save(fabric, state, final=True)
    for checkpoint in (tmp_path / "out" / "step-00000002", saved):
        assert {name: (checkpoint / name).read_bytes() for name in started_with} == started_with
