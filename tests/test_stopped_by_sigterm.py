"""SIGTERM (what a scheduler, `kill` or `timeout` sends) to the commands that write a model or results, caught mid-write
at a point the test knows: the command about to rename the last file it writes from its finished temporary onto its
name (fabric_lin_process's held_before). Each ends as Ctrl-C ends it, with exit code 143 and one line naming the command,
and leaves nothing that could be taken for a complete output (no output directory, no temporary file, no evaluate/ in
the model it read) and its input as it was. (train_tokenizer's: test_tokenizer.py; the preprocessors': test_data_prep.py
and test_prepare_text.py.)"""
import signal
from pathlib import Path

import numpy as np
import pytest

import fabric_lin_process
from fabric_lin.convert.model_dir import STAGING_DIR
from helpers import make_model_dir, small_config, wait_for, write_prepared

pytestmark = pytest.mark.slow

STOPPED = "fabric-lin {}: stopped by SIGTERM: nothing half-written is left; run the same command again"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A one-device training checkpoint, a model directory, its fla export and validation data tokenized with its
    tokenizer."""
    from fabric_lin.config import Config
    from fabric_lin.convert.hf import convert_to_hf
    from fabric_lin.data import Tokenizer
    from test_convert_pretrained_checkpoint import fabric_single_device_checkpoint

    root = tmp_path_factory.mktemp("inputs")
    fabric_single_device_checkpoint(root, Config.from_name("gla-debug"))
    make_model_dir(root / "model", small_config())
    convert_to_hf(root / "model", root / "export")
    tokenizer = Tokenizer(root / "model")
    ids = tokenizer.encode_batch([f"the gated linear attention model number {i} reads tokens" for i in range(40)],
                                 eos=True, num_threads=1)
    write_prepared(root / "val", np.concatenate(ids).astype(np.uint16), tokenizer)
    return root


# command -> (its arguments: the input, then the rest, for the inputs' root and an output directory; the last file it
# writes, where it is held)
COMMANDS = {
    "convert_pretrained_checkpoint": (lambda root, out: [root / "out" / "step-00000002", "--output_dir", out],
                                      "lit_model.pth"),
    "convert_to_hf": (lambda root, out: [root / "model", "--output_dir", out], "config.json"),
    "convert_from_hf": (lambda root, out: [root / "export", "--output_dir", out], "lit_model.pth"),
    # into the model directory's own evaluate/ (its default out_dir), which must not be left there
    "evaluate": (lambda root, out: [root / "model", "--data", "TokenChunks", "--data.val_path", root / "val",
                                    "--data.num_workers", "0", "--seq_len", "16", "--max_batches", "1", "--device", "cpu"],
                 "evaluate.json"),
}


def files_of(directory: Path) -> dict:
    return {path.relative_to(directory): path.read_bytes() for path in sorted(directory.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("command", COMMANDS)
def test_sigterm_mid_write_ends_in_one_line_with_143_and_leaves_no_output(inputs, tmp_path, command):
    arguments, last_file = COMMANDS[command]
    out = tmp_path / "new" / "output"
    argv = [str(a) for a in arguments(inputs, out)]
    before = files_of(inputs)
    log, err = tmp_path / "stdout", tmp_path / "stderr"
    job = fabric_lin_process.start([*fabric_lin_process.FABRIC_LIN, command, *argv], log, err_log=err,
                                   held_before=last_file)
    try:
        held = fabric_lin_process.HELD.format(last_file)
        assert wait_for(lambda: held in log.read_text(), job, timeout=120), err.read_text()[-3000:]
        # a converter writes its files into a staging directory inside the output directory
        temporary = {"evaluate": inputs / "model" / "evaluate"}.get(command, out / STAGING_DIR) / f".tmp-{last_file}"
        assert temporary.is_file()  # written whole, its rename to come
        job.send_signal(signal.SIGTERM)
        returncode = job.wait(60)
    finally:
        fabric_lin_process.stop(job)
    assert returncode == 128 + signal.SIGTERM, err.read_text()[-3000:]
    said = err.read_text()  # evaluate's progress bar before it
    assert said.splitlines()[-1] == STOPPED.format(command) and "Traceback" not in said, said[-3000:]
    assert not (tmp_path / "new").exists() and not (inputs / "model" / "evaluate").exists()
    assert files_of(inputs) == before
