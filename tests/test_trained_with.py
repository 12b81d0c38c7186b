"""A directory of weights records the tokenizer they were trained with (trained_with.json: the vocabulary size and the
sha256 of its tokenizer.model). Every command that reads one with its tokenizer (generate, evaluate, convert_to_hf,
convert_from_hf) refuses another tokenizer.model put there, of the same vocabulary size too, in one line naming the
directory, the file and both hashes; with its own tokenizer back, each runs. A model directory written before the
record was kept reads as before. (The record pretrain writes, and --initial_checkpoint_dir: test_pretrain_data.py.)"""
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fabric_lin.cli import main as cli_main
from fabric_lin.convert.model_dir import save_model_dir
from helpers import cli_error, make_model_dir, small_config, train_sentencepiece, write_prepared


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def dirs(tmp_path):
    """`old`: a model directory written without the record (make_model_dir, its 64-piece tokenizer); `model`: the
    same weights written by save_model_dir, as the converters write them; `other`: another 64-piece tokenizer."""
    state = make_model_dir(tmp_path / "old", small_config())
    (tmp_path / "model").mkdir()
    save_model_dir(state, small_config(), tmp_path / "model", tokenizer_dir=tmp_path / "old")
    train_sentencepiece(tmp_path / "other", sentence="a tokenizer of its own learns {} other pieces from this line")
    assert sha256(tmp_path / "other" / "tokenizer.model") != sha256(tmp_path / "old" / "tokenizer.model")
    return tmp_path


def assert_refused(err: str, command: str, directory: Path, trained: Path, swapped: Path) -> None:
    """`err` is the one line that refuses `directory`, whose weights were trained with the tokenizer.model `trained`
    and which holds `swapped` instead: the argument that named it, both hashes, the file and the fix."""
    argument = "model_dir" if command == "convert_to_hf" else "checkpoint_dir"
    assert err.startswith(f"fabric-lin {command}: error: {argument}: {directory}: {directory / 'tokenizer.model'} "
                          f"(vocab_size=64, "
                          f"sha256={sha256(swapped)[:12]}...) is not the tokenizer its weights were trained with "
                          f"(vocab_size=64, sha256={sha256(trained)[:12]}..."), err
    assert err.endswith("put back the tokenizer.model the model was trained with\n"), err


def test_a_model_directory_records_the_tokenizer_it_copies(dirs):
    recorded = json.loads((dirs / "model" / "trained_with.json").read_text())["tokenizer"]
    assert (recorded["vocab_size"], recorded["sha256"]) == (64, sha256(dirs / "old" / "tokenizer.model"))
    assert recorded["source"] == str(dirs / "old")


def test_generate_evaluate_and_convert_to_hf_refuse_a_swapped_tokenizer(dirs, capsys, harness_with_hellaswag):
    """The tokenizer.model of `other` in place of the model's: refused by each command before it writes anything;
    the model's own put back, each runs."""
    from fabric_lin.data import Tokenizer

    model, trained, swapped = dirs / "model", dirs / "old" / "tokenizer.model", dirs / "other" / "tokenizer.model"
    shutil.copy(swapped, model / "tokenizer.model")
    for argv in (["generate", str(model), "--prompt", "the model", "--max_new_tokens", "2"],
                 ["evaluate", str(model), "--tasks", "hellaswag"],
                 ["evaluate", str(model), "--data", "TextFiles", "--data.val_dir", str(dirs / "val")],
                 ["convert_to_hf", str(model), "--output_dir", str(dirs / "hf")]):
        assert_refused(cli_error(argv, capsys), argv[0], model, trained, swapped)
    assert not (dirs / "hf").exists()

    shutil.copy(trained, model / "tokenizer.model")
    write_prepared(dirs / "val", np.arange(200, dtype=np.uint16) % 64, Tokenizer(dirs / "old"), item=100, chunk_size=100)
    cli_main(["generate", str(model), "--prompt", "the model", "--max_new_tokens", "2", "--temperature", "0"])
    cli_main(["evaluate", str(model), "--data", "TextFiles", "--data.val_dir", str(dirs / "val"),
              "--data.num_workers", "0", "--seq_len", "16", "--max_batches", "1", "--out_dir", str(dirs / "eval")])
    cli_main(["convert_to_hf", str(model), "--output_dir", str(dirs / "hf")])
    assert json.loads((dirs / "eval" / "evaluate.json").read_text())["lengths"][0]["tokens"] == 16
    assert (dirs / "hf" / "model.safetensors").is_file()


def test_the_fla_export_keeps_the_record_and_refuses_a_swapped_tokenizer(dirs, capsys):
    """convert_to_hf copies the record; an export holding another tokenizer.model is refused by convert_from_hf and
    evaluate; with its own, convert_from_hf writes the record back into the model directory."""
    from fabric_lin.convert.hf import convert_to_hf

    convert_to_hf(dirs / "model", dirs / "hf")
    record = (dirs / "model" / "trained_with.json").read_text()
    assert (dirs / "hf" / "trained_with.json").read_text() == record
    trained, swapped = dirs / "old" / "tokenizer.model", dirs / "other" / "tokenizer.model"
    shutil.copy(swapped, dirs / "hf" / "tokenizer.model")
    for argv in (["convert_from_hf", str(dirs / "hf"), "--output_dir", str(dirs / "back")],
                 ["evaluate", str(dirs / "hf"), "--data", "TextFiles", "--data.val_dir", str(dirs / "val")]):
        assert_refused(cli_error(argv, capsys), argv[0], dirs / "hf", trained, swapped)
    assert not (dirs / "back").exists()
    shutil.copy(trained, dirs / "hf" / "tokenizer.model")
    cli_main(["convert_from_hf", str(dirs / "hf"), "--output_dir", str(dirs / "back")])
    assert (dirs / "back" / "trained_with.json").read_text() == record


def test_a_model_directory_without_the_record_reads_as_before(dirs, capsys):
    """Written before the record was kept, a model directory has nothing to check its tokenizer against: generate
    runs with it, and convert_to_hf records the tokenizer it copies."""
    from fabric_lin.generate import main as generate

    assert not (dirs / "old" / "trained_with.json").exists()
    generate(dirs / "old", prompt="the model", max_new_tokens=2, temperature=0, device="cpu")
    cli_main(["convert_to_hf", str(dirs / "old"), "--output_dir", str(dirs / "hf")])
    recorded = json.loads((dirs / "hf" / "trained_with.json").read_text())["tokenizer"]
    assert (recorded["vocab_size"], recorded["sha256"]) == (64, sha256(dirs / "old" / "tokenizer.model"))


@pytest.mark.parametrize("record", ['{"tokenizer": {"vocab_size": 64}}', '{"tokenizer": 5}', '{"tokenizer": "x"}'])
def test_a_record_that_names_no_tokenizer_is_one_line(dirs, capsys, record):
    (dirs / "model" / "trained_with.json").write_text(record + "\n")
    err = cli_error(["generate", str(dirs / "model"), "--prompt", "a"], capsys)
    assert err.startswith(f"fabric-lin generate: error: checkpoint_dir: {dirs / 'model' / 'trained_with.json'}: "
                          "expected "), err


def test_a_model_directory_cut_short_while_its_tokenizer_is_copied_holds_no_weights(dirs, monkeypatch):
    """The weights are written last: a conversion stopped while it copies the tokenizer leaves no lit_model.pth,
    so no command takes the directory for a model without a tokenizer; the files it had added are taken back."""
    import fabric_lin.data.tokenizer as tokenizer_module
    from fabric_lin.convert.model_dir import load_model_dir_weights

    def stopped(src_dir, dst_dir):
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenizer_module, "copy_tokenizer_files", stopped)
    state = load_model_dir_weights(dirs / "model")
    (dirs / "cut").mkdir()
    with pytest.raises(KeyboardInterrupt):
        save_model_dir(state, small_config(), dirs / "cut", tokenizer_dir=dirs / "old")
    assert list((dirs / "cut").iterdir()) == []
    # written over an earlier model directory (--overwrite): that one stays as it was, with its own tokenizer
    before = {path.name: path.read_bytes() for path in (dirs / "model").iterdir()}
    with pytest.raises(KeyboardInterrupt):
        save_model_dir(state, small_config(), dirs / "model", tokenizer_dir=dirs / "old")
    assert {path.name: path.read_bytes() for path in (dirs / "model").iterdir()} == before


def test_a_model_directory_without_its_tokenizer_names_the_recorded_one(dirs, capsys, harness_with_hellaswag):
    """Its tokenizer.model gone, the record stays: generate and evaluate --tasks, which need the tokenizer, name the one
    the record holds (hash and where it came from) and where to copy it; without the record, only what is missing."""
    model = dirs / "model"
    (model / "tokenizer.model").unlink()
    recorded = (f"its weights were trained with the tokenizer its trained_with.json records (vocab_size=64, "
                f"sha256={sha256(dirs / 'old' / 'tokenizer.model')[:12]}..., from {dirs / 'old'}): copy that tokenizer.model "
                f"(and its tokenizer_config.json) into {model}\n")
    err = cli_error(["generate", str(model), "--prompt", "the model"], capsys)
    assert err == f"fabric-lin generate: error: {model} has no tokenizer.model, and generate reads and writes text; {recorded}"
    err = cli_error(["evaluate", str(model), "--tasks", "hellaswag"], capsys)
    assert err == (f"fabric-lin evaluate: error: --tasks: {model} has no tokenizer.model, and the harness's tasks are "
                   f"text; {recorded}")
    (model / "trained_with.json").unlink()
    assert cli_error(["generate", str(model)], capsys) == (
        f"fabric-lin generate: error: {model} has no tokenizer.model, and generate reads and writes text\n")


def test_another_end_of_text_token_in_tokenizer_config_json_is_refused(dirs, capsys):
    """The same tokenizer.model beside a tokenizer_config.json that names another eos_token: the weights were trained
    on documents that end with the recorded id, and the data holds that one; generate began the prompt with the other,
    and --reset_state_at_doc_boundaries found no document's end in the data (the run trained as without it), without
    a word."""
    from fabric_lin.data import Tokenizer
    from fabric_lin.data.prepared import check_prepared_dirs

    write_prepared(dirs / "val", np.arange(200, dtype=np.uint16) % 64, Tokenizer(dirs / "old"), item=100, chunk_size=100)
    (dirs / "model" / "tokenizer_config.json").write_text('{"eos_token": "<unk>"}\n')
    err = cli_error(["generate", str(dirs / "model"), "--prompt", "a"], capsys)
    assert err == (f"fabric-lin generate: error: checkpoint_dir: {dirs / 'model'}: its end-of-text token is id 0 ('<unk>', "
                   f"the eos_token of its tokenizer_config.json), and its weights were trained on documents that end "
                   f"with id 2 ('</s>', recorded in trained_with.json): put back the tokenizer_config.json the model was "
                   f"trained with\n")
    shutil.copytree(dirs / "model", dirs / "tokenizer", ignore=lambda *_: ["trained_with.json", "lit_model.pth"])
    with pytest.raises(ValueError, match=rf"^{dirs / 'val'}: its documents end with id 2 \('</s>', the end-of-text token "
                                         rf"of the tokenizer that prepared it, in its prepared.json\), and the end-of-text "
                                         rf"token of {dirs / 'tokenizer'} is id 0 \('<unk>', the eos_token of its "
                                         r"tokenizer_config.json\): give the tokenizer_config.json that prepared the data$"):
        check_prepared_dirs([dirs / "val"], Tokenizer(dirs / "tokenizer"))
