"""fabric_lin/data/prepared.py on files written by hand: an index without the token counts named, the raw input two
prepared directories came from (the same only where the files and the field read are), and the tokenizer a set of
directories carries (none where a prepared.json cannot be read). Checks of whole prepared directories as a run meets
them: test_pretrain_data.py."""
import json

import pytest

from fabric_lin.data.prepared import carried_tokenizer_dir, chunk_tokens, prepared_from


def test_an_index_without_the_token_count_of_a_chunk_is_named(tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"chunks": [{"filename": "chunk-0-0.bin", "dim": 1000},
                                                                {"filename": "chunk-0-1.bin"}]}))
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'index.json'}: expected litdata's index with a token count \(dim\) "
                                         r"for every chunk"):
        chunk_tokens(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"chunks": [{"dim": 1000}, {"dim": 7}]}))
    assert chunk_tokens(tmp_path).tolist() == [1000, 7]


def test_two_preparations_are_of_one_input_only_where_they_read_the_same_field_of_the_same_files():
    info = {"recipe": "text", "input_dir": "/raw", "pattern": "*.jsonl", "text_key": "text", "split": "train"}
    assert prepared_from(info) == prepared_from({**info, "split": "val", "val_fraction": 0.01})
    assert prepared_from(info) != prepared_from({**info, "text_key": "content"})
    assert prepared_from(info) != prepared_from({**info, "pattern": "*.parquet"})
    assert prepared_from({"recipe": "slimpajama"}) is None  # no input recorded: nothing to compare


def test_no_tokenizer_is_carried_by_directories_whose_prepared_json_cannot_be_read(tmp_path):
    record = {"complete": True, "tokenizer": {"vocab_size": 300, "sha256": "ab" * 32}}
    for name, text in (("a", json.dumps(record)), ("b", '{"complete": tr')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "prepared.json").write_text(text)
        (tmp_path / name / "tokenizer.model").write_bytes(b"sentencepiece")
    assert carried_tokenizer_dir([tmp_path / "a"]) == tmp_path / "a"
    assert carried_tokenizer_dir([tmp_path / "a", tmp_path / "b"]) is None
