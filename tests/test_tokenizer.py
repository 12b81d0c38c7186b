import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard

from fabric_lin.data import Tokenizer
from fabric_lin.data.tokenizer import copy_tokenizer_files, token_dtype, tokenizer_model_hash
from fabric_lin.data.train_tokenizer import main as train_tokenizer
from helpers import cli_error

# one word that only occurs in each input format: if the trainer read the format, BPE learns the word
WORDS = {"txt": "qvtxtword", "jsonl": "qvjsonlword", "parquet": "qvparquetword"}
CODE = 'def f(x):\n\treturn x  *  2  # naïve 2024 → ∑ 🙂\n\n    print("done")\n'


def make_raw_inputs(root):
    root.mkdir(parents=True, exist_ok=True)
    prose = "the quick brown fox jumps over the lazy dog while the cat sleeps near the door"
    (root / "a.txt").write_text("\n".join(f"{prose} {WORDS['txt']} {i}" for i in range(300)), encoding="utf-8")
    rows = "".join(json.dumps({"text": f"{WORDS['jsonl']} {prose} {i}", "meta": {}}) + "\n" for i in range(300))
    (root / "nested").mkdir(exist_ok=True)
    (root / "nested" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    pq.write_table(pa.table({"text": [f"{WORDS['parquet']} = {i}\n{CODE}" for i in range(300)]}), root / "c.parquet")
    (root / "broken.jsonl.zst").write_bytes(b"this is not zstd")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    make_raw_inputs(root / "raw")
    train_tokenizer(root / "raw", root / "tokenizer", vocab_size=500, num_threads=1)
    return root / "tokenizer"


def test_train_tokenizer_reads_every_format(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    assert tokenizer.vocab_size == 500
    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    for word in WORDS.values():
        assert tokenizer.processor.PieceToId("▁" + word) != tokenizer.processor.unk_id(), word
    assert json.loads((tokenizer_dir / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


def test_train_tokenizer_counts_only_the_files_it_read(tmp_path, capsys):
    make_raw_inputs(tmp_path / "raw")  # four files, one of them not zstd
    train_tokenizer(tmp_path / "raw", tmp_path / "tokenizer", vocab_size=400, num_threads=1, max_sentences=200)
    captured = capsys.readouterr()
    assert f"SKIPPED {tmp_path / 'raw' / 'broken.jsonl.zst'}:" in captured.err
    assert "lines from 3 file(s); 1 unreadable file(s) skipped\n" in captured.out
    assert sorted(p.name for p in (tmp_path / "tokenizer").iterdir()) == ["tokenizer.model", "tokenizer_config.json"]


def test_a_corpus_without_text_is_refused_saying_what_its_files_held(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("")
    (tmp_path / "raw" / "b.jsonl").write_text('{"text": "  "}\n{"body": "x"}\n')
    with pytest.raises(ValueError) as refused:
        train_tokenizer(tmp_path / "raw", tmp_path / "tok", vocab_size=300, num_threads=1)
    assert str(refused.value) == (
        f"No text found in the 2 input file(s) under {tmp_path / 'raw'}: 1 skipped (each named above, with why); "
        "1 bad row(s) left out (named above); 1 empty or whitespace-only document(s) left out; a tokenizer "
        "is trained on the text of its input")
    assert not (tmp_path / "tok").exists()


def test_encode_decode_round_trip(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    ids = tokenizer.encode(CODE)
    assert ids.dtype == torch.int32 and ids.ndim == 1
    # identity normalization + byte fallback: code (tabs, runs of spaces, newlines, emoji) survives
    assert tokenizer.decode(ids) == CODE
    assert tokenizer.decode(ids.tolist()) == CODE
    with_special = tokenizer.encode(CODE, bos=True, eos=True)
    assert with_special[0].item() == 1 and with_special[-1].item() == 2
    assert torch.equal(with_special[1:-1], ids)
    # byte fallback: a character never seen in training becomes its UTF-8 bytes
    assert tokenizer.decode(tokenizer.encode("ẞ")) == "ẞ"


def test_encode_batch_matches_one_at_a_time(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    texts = [CODE * (i % 3 + 1) + str(i) for i in range(50)] + [""]
    batch = tokenizer.encode_batch(texts, num_threads=2)
    assert batch == [tokenizer.encode(t, eos=True).tolist() for t in texts]
    assert batch[-1] == [tokenizer.eos_id]
    assert tokenizer.encode_batch(texts[:3], bos=True, eos=False) == [tokenizer.encode(t, bos=True).tolist() for t in texts[:3]]


def test_tokenizer_config_overrides_special_tokens(tokenizer_dir, tmp_path):
    copied = copy_tokenizer_files(tokenizer_dir, tmp_path / "copy")
    assert sorted(p.name for p in copied) == ["tokenizer.model", "tokenizer_config.json"]
    assert tokenizer_model_hash(tmp_path / "copy" / "tokenizer.model") == Tokenizer(tokenizer_dir).model_hash
    (tmp_path / "copy" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    assert Tokenizer(tmp_path / "copy").eos_id == 1
    (tmp_path / "copy" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<not-a-piece>"}))
    with pytest.raises(ValueError, match="bos_token='<not-a-piece>'.*tokenizer_config.json|tokenizer_config.json.*<not-a-piece>"):
        Tokenizer(tmp_path / "copy")


def test_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        Tokenizer(tmp_path / "does-not-exist")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/tokenizer.model .*\(found: nothing\)"):
        Tokenizer(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"empty/tokenizer.model"):
        copy_tokenizer_files(tmp_path / "empty", tmp_path / "dst")
    for i in range(12):  # a directory full of other files: the first ten are named, in one line
        (tmp_path / "empty" / f"file-{i:02d}.txt").write_text("")
    with pytest.raises(FileNotFoundError, match=r"\(found: file-00.txt, .*, file-09.txt, \.\.\. \(2 more\)\)$"):
        Tokenizer(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match=r"bad/tokenizer.model"):
        Tokenizer(tmp_path / "bad")


def test_a_tokenizer_file_given_for_its_directory_and_a_special_token_that_is_no_string_are_named(tokenizer_dir, tmp_path):
    """--tokenizer_path DIR/tokenizer.model was said not to exist (another file is not sent to its directory, which holds
    no tokenizer); an eos_token of 5 (an id, not a piece) in
    tokenizer_config.json was SentencePiece's TypeError traceback."""
    from fabric_lin.errors import UserError

    with pytest.raises(UserError, match=rf"^{tokenizer_dir / 'tokenizer.model'} is a file: expected the directory that "
                                        rf"holds tokenizer.model \(and tokenizer_config.json\), here {tokenizer_dir}$"):
        Tokenizer(tokenizer_dir / "tokenizer.model")
    (tmp_path / "notes.txt").write_text("a file where no tokenizer is\n")  # its directory is no tokenizer's either
    with pytest.raises(UserError, match=rf"^{tmp_path / 'notes.txt'} is a file: expected the directory that holds "
                                        rf"tokenizer.model \(and tokenizer_config.json\), and {tmp_path} holds no "
                                        r"tokenizer.model$"):
        Tokenizer(tmp_path / "notes.txt")
    copy_tokenizer_files(tokenizer_dir, tmp_path / "copy")
    for value in (5, {"content": 2, "lstrip": False}, ["</s>"]):
        (tmp_path / "copy" / "tokenizer_config.json").write_text(json.dumps({"eos_token": value}))
        with pytest.raises(UserError, match=rf"^{tmp_path / 'copy' / 'tokenizer_config.json'}: eos_token="):
            Tokenizer(tmp_path / "copy")


def test_train_tokenizer_without_inputs(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "notes.md").write_text("not an input format")
    with pytest.raises(FileNotFoundError, match="raw"):
        train_tokenizer(tmp_path / "raw", tmp_path / "out", vocab_size=300)


def test_train_tokenizer_reads_what_prepare_text_reads(tmp_path, capsys):
    """The formats, --text_key and --pattern of prepare_text, by its reader: a word found only in each file is learnt
    from the files the pattern matches and nowhere else; what it does not read is named in the first line."""
    import gzip

    raw = tmp_path / "raw"
    prose = "the quick brown fox jumps over the lazy dog while the cat sleeps near the door"
    words = {"a.jsonl": "qvplainword", "b.jsonl.gz": "qvgzipword", "c.json.gz": "qvjsongzword",
             "d.parquet": "qvparquetword", "sub/e.txt": "qvtextword", "sub/f.jsonl.zst": "qvzstdword"}
    for name, word in words.items():
        path = raw / name
        path.parent.mkdir(parents=True, exist_ok=True)
        texts = [f"{word} {prose} {i}" for i in range(150)]
        lines = "".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()
        if name.endswith(".parquet"):
            pq.write_table(pa.table({"body": texts, "text": ["qvwrongcolumn"] * len(texts)}), path)
        elif name.endswith(".txt"):
            path.write_text("\n".join(texts))
        else:
            path.write_bytes(gzip.compress(lines) if name.endswith(".gz") else
                             zstandard.ZstdCompressor().compress(lines) if name.endswith(".zst") else lines)
    (raw / "notes.md").write_text("qvmarkdownword " * 50)
    (raw / "sub" / "skip.jsonl").write_text(json.dumps({"body": "qvunmatchedword " * 50}) + "\n")
    train_tokenizer(raw, tmp_path / "tok", text_key="body", pattern="*", vocab_size=400, num_threads=1)  # not sub/
    first_line = capsys.readouterr().out.splitlines()[0]
    assert first_line == "Not read: 1 file(s) matching --pattern '*' with other suffixes (notes.md)"
    pieces = Tokenizer(tmp_path / "tok").processor
    learnt = {word for word in [*words.values(), "qvwrongcolumn", "qvmarkdownword", "qvunmatchedword"]
              if pieces.PieceToId("▁" + word) != pieces.unk_id()}
    assert learnt == {"qvplainword", "qvgzipword", "qvjsongzword", "qvparquetword"}


def test_a_vocab_size_the_input_cannot_fill_is_one_line(tmp_path, capsys):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("\n".join(f"the cat sat on the mat number {i}" for i in range(200)))
    argv = ["train_tokenizer", "--input_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "tok"), "--num_threads", "1"]
    err = cli_error([*argv, "--vocab_size", "32000"], capsys)
    largest = int(re.search(r"at most (\d+) pieces", err).group(1))
    assert f"--vocab_size 32000: the 200 lines read from {tmp_path / 'raw'} make at most {largest} pieces; give " \
           f"--vocab_size {largest} or less, or more text" in err, err
    train_tokenizer(tmp_path / "raw", tmp_path / "tok", vocab_size=largest, num_threads=1)  # the largest that works
    assert Tokenizer(tmp_path / "tok").vocab_size == largest
    argv[argv.index("--output_dir") + 1] = str(tmp_path / "tok-small")
    err = cli_error([*argv, "--vocab_size", "260"], capsys)
    smallest = int(re.search(r"give --vocab_size (\d+) or more", err).group(1))
    assert f"--vocab_size 260: this input needs at least {smallest} pieces" in err, err
    assert 259 < smallest < largest  # the byte pieces, <unk>, <s>, </s> and the input's characters
    assert not (tmp_path / "tok-small").exists()  # the failed run wrote nothing


@pytest.mark.parametrize("flags,message", [
    (["--vocab_size", "0"], "--vocab_size must be at least 259 (the 256 byte-fallback pieces, <unk>, <s> and </s>), got 0"),
    # SentencePiece's trainer failed on these with a traceback (an assertion, an int it cannot parse)
    (["--vocab_size", "2"], "--vocab_size must be at least 259 (the 256 byte-fallback pieces, <unk>, <s> and </s>), got 2"),
    (["--vocab_size", str(2**31)], f"--vocab_size must be at most {2**31 - 1} (SentencePiece's limit), got {2**31}"),
    (["--max_sentence_length", str(10**9)], f"--max_sentence_length must be at most {(2**31 - 1) // 4} (SentencePiece's "
                                            f"limit of 2**31 - 1 bytes, 4 per character), got {10**9}"),
    (["--max_files", "0"], "--max_files must be at least 1, got 0"),  # was a division by zero
    (["--max_sentences", "0"], "--max_sentences must be at least 1, got 0"),  # was "no text found"
    (["--max_sentence_length", "5"], "--max_sentence_length must be at least 10, got 5"),
    (["--character_coverage", "1.5"], "--character_coverage must be in [0.98, 1]"),
    # SentencePiece's own check ended in a C++ assertion's traceback
    (["--num_threads", "-2"], "--num_threads must be 0 (every core) or at most 1024 (SentencePiece's limit), got -2"),
    (["--num_threads", "1025"], "--num_threads must be 0 (every core) or at most 1024 (SentencePiece's limit), got 1025"),
])
def test_train_tokenizer_settings_are_checked_before_reading(tmp_path, capsys, flags, message):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("some text\n")
    err = cli_error(["train_tokenizer", "--input_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "tok"), *flags],
                    capsys)
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "tok").exists()


def test_a_tokenizer_that_cannot_be_written_leaves_no_directory(tmp_path, capsys, monkeypatch):
    """A full disk at tokenizer.model: one line naming it, and the directories made for the output go again (an empty
    one was left)."""
    import errno

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("\n".join(f"the cat sat on the mat number {i}" for i in range(200)))
    real_write_bytes = Path.write_bytes

    def full_disk(path, data):
        if path.name.endswith("tokenizer.model"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write_bytes(path, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    out = tmp_path / "new" / "tok"
    err = cli_error(["train_tokenizer", "--input_dir", str(tmp_path / "raw"), "--output_dir", str(out), "--vocab_size",
                     "300", "--num_threads", "1"], capsys)
    assert err == f"fabric-lin train_tokenizer: error: [Errno 28] No space left on device: '{out / 'tokenizer.model'}'\n"
    assert not (tmp_path / "new").exists()


def test_train_tokenizer_refuses_an_output_dir_that_holds_a_tokenizer_or_cannot_be_one(tokenizer_dir, tmp_path, capsys):
    """A tokenizer directory, or a model directory, holds the tokenizer its data and models were made with: writing
    another one there would make them read other pieces for their ids. Refused before any input is read, naming the
    tokenizer there, which stays as it was; an output path through a file is one line too."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("\n".join(f"the cat sat on the mat number {i}" for i in range(200)))
    before = {p.name: p.read_bytes() for p in tokenizer_dir.iterdir()}
    argv = ["train_tokenizer", "--input_dir", str(tmp_path / "raw"), "--vocab_size", "300", "--num_threads", "1"]
    err = cli_error([*argv, "--output_dir", str(tokenizer_dir)], capsys)
    assert err.startswith(f"fabric-lin train_tokenizer: error: --output_dir {tokenizer_dir} holds a tokenizer already: "
                          f"{tokenizer_dir / 'tokenizer.model'} (vocab_size=500, sha256="), err
    assert "delete its tokenizer.model and tokenizer_config.json first" in err
    assert {p.name: p.read_bytes() for p in tokenizer_dir.iterdir()} == before
    (tmp_path / "a_file").write_text("")
    for output_dir in (tmp_path / "a_file", tmp_path / "a_file" / "tok"):
        err = cli_error([*argv, "--output_dir", str(output_dir)], capsys)
        assert err == f"fabric-lin train_tokenizer: error: --output_dir {output_dir}: {tmp_path / 'a_file'} is a file, " \
                      f"expected a directory or nothing there\n", err


def test_train_tokenizer_names_what_an_interrupted_run_left(tmp_path, capsys):
    """An --output_dir holding a tokenizer_config.json without tokenizer.model (what train_tokenizer leaves when killed
    between its two files, or another library's tokenizer): said so, where the refusal said that data and models were
    made with a tokenizer that is not there."""
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("some text\n")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    err = cli_error(["train_tokenizer", "--input_dir", str(tmp_path / "raw"), "--output_dir", str(tmp_path / "tok")], capsys)
    assert err == (f"fabric-lin train_tokenizer: error: --output_dir {tmp_path / 'tok'} holds a tokenizer_config.json "
                   "without a tokenizer.model (what an interrupted train_tokenizer leaves, or another library's "
                   "tokenizer): write the new one to another --output_dir, or delete that tokenizer_config.json first\n")


def test_train_tokenizer_stopped_between_its_two_files_leaves_neither(tmp_path, monkeypatch):
    """Ctrl-C after tokenizer_config.json was written and before tokenizer.model: the config was left alone, and the
    same command run again was refused for it (as the test above refuses one). Neither is left, and it runs again."""
    import fabric_lin.data.train_tokenizer as train_tokenizer_module

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("\n".join(f"the quick brown fox {i} jumps" for i in range(200)))
    written = train_tokenizer_module.atomic_write

    def interrupted_at_the_model(path, write):
        if path.name == "tokenizer.model":
            raise KeyboardInterrupt
        written(path, write)

    monkeypatch.setattr(train_tokenizer_module, "atomic_write", interrupted_at_the_model)
    with pytest.raises(KeyboardInterrupt):
        train_tokenizer(tmp_path / "raw", tmp_path / "tok", vocab_size=300, num_threads=1)
    assert not (tmp_path / "tok").exists()  # nor the directory made for them
    monkeypatch.setattr(train_tokenizer_module, "atomic_write", written)
    train_tokenizer(tmp_path / "raw", tmp_path / "tok", vocab_size=300, num_threads=1)
    assert Tokenizer(tmp_path / "tok").vocab_size == 300


def test_a_tokenizer_or_weights_file_that_is_a_git_lfs_pointer_is_named_as_one(tmp_path):
    """Llama-2's tokenizer.model and a model's weights cloned from the hub without Git LFS are pointer files: they were
    said to be 'truncated or damaged (an interrupted copy or download)'."""
    from fabric_lin.errors import UserError
    from fabric_lin.weights import load_safetensors, torch_load_tensors

    pointer = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize 499723\n")
    for name in ("tokenizer.model", "model.safetensors", "lit_model.pth"):
        (tmp_path / name).write_text(pointer)
    fix = r"is a Git LFS pointer, not the file's content: fetch it with `git lfs pull` in its clone \(after `git lfs install`\)$"
    for read, given, named in ((Tokenizer, tmp_path, "tokenizer.model"), (load_safetensors, tmp_path / "model.safetensors",
                                                                          "model.safetensors"),
                               (torch_load_tensors, tmp_path / "lit_model.pth", "lit_model.pth")):
        with pytest.raises(UserError, match=rf"^{tmp_path / named} {fix}"):
            read(given)


def test_token_ids_are_kept_in_the_smallest_dtype_that_holds_every_id():
    """uint16 holds ids 0 ... 65535: a vocabulary of 65536 pieces, not one more (id 65536 would be stored as 0)."""
    import numpy as np

    from fabric_lin.data.tokenizer import token_dtype

    for vocab_size, dtype in ((500, np.uint16), (65536, np.uint16), (65537, np.int32), (128256, np.int32)):
        assert token_dtype(vocab_size) == dtype
        assert np.array([vocab_size - 1]).astype(token_dtype(vocab_size))[0] == vocab_size - 1


def test_the_tokenizer_hash_is_the_sha256_of_the_whole_file(tmp_path):
    """The hash tells tokenizers apart wherever their files differ, past the first block read too (a tokenizer.model of
    a large vocabulary holds megabytes)."""
    import hashlib

    data = bytes(range(256)) * (1 << 12) + b"the end of a larger tokenizer.model"  # 1 MiB and more
    (tmp_path / "tokenizer.model").write_bytes(data)
    assert tokenizer_model_hash(tmp_path / "tokenizer.model") == hashlib.sha256(data).hexdigest()


def test_a_tokenizer_without_bos_or_eos_says_so_when_asked_for_them(tmp_path):
    import sentencepiece as spm

    (tmp_path / "corpus.txt").write_text("\n".join(f"line {i} of some text" for i in range(200)))
    spm.SentencePieceTrainer.Train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "tokenizer"),
                                   vocab_size=40, model_type="bpe", bos_id=-1, eos_id=-1, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.bos_id is None and tokenizer.eos_id is None
    assert tokenizer.encode("line 7").tolist() == tokenizer.processor.EncodeAsIds("line 7")
    with pytest.raises(ValueError, match=r"tokenizer.model defines no EOS token; call encode with eos=False$"):
        tokenizer.encode_batch(["line 7"])
    with pytest.raises(ValueError, match=r"tokenizer.model defines no BOS token; call encode with bos=False$"):
        tokenizer.encode("line 7", bos=True)


def test_a_tokenizer_not_found_is_named_with_the_option_that_gave_it(tmp_path):
    """A missing tokenizer is named by the option or key that gave its path, not by the path alone."""
    from fabric_lin.errors import MissingFile
    from fabric_lin.run_start import load_tokenizer

    with pytest.raises(MissingFile, match=rf"^--tokenizer_dir: Tokenizer directory '{tmp_path / 'none'}' does not exist"):
        load_tokenizer(tmp_path / "none")
    with pytest.raises(MissingFile, match=rf"^the data's recorded tokenizer: {tmp_path / 'tokenizer.model'} does not exist"):
        load_tokenizer(tmp_path, "the data's recorded tokenizer")


def not_a_tokenizer(directory):
    """`directory` with a tokenizer.model that SentencePiece cannot read."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(b"not a SentencePiece model")
    return directory


def a_model_dir_with_a_damaged_tokenizer(tmp_path):
    from helpers import make_model_dir, small_config

    make_model_dir(tmp_path / "model", small_config())
    return not_a_tokenizer(tmp_path / "model")


def an_export_with_a_damaged_tokenizer(tmp_path):
    from fabric_lin.convert.hf import convert_to_hf
    from helpers import make_model_dir, small_config

    make_model_dir(tmp_path / "good", small_config())
    convert_to_hf(tmp_path / "good", tmp_path / "export")
    return not_a_tokenizer(tmp_path / "export")


def a_corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "one document"}\n')
    return tmp_path / "corpus"


@pytest.mark.parametrize("command", [
    "prepare_text", "prepare_slimpajama", "prepare_starcoder", "generate", "evaluate", "convert_to_hf", "convert_from_hf",
])
def test_a_tokenizer_that_is_not_one_is_named_by_the_argument_that_gave_it(tmp_path, capsys, command):
    """Every command that reads a tokenizer names the option or argument that gave its directory before the path, as
    the user typed it, where the tokenizer.model there cannot be read."""
    out = str(tmp_path / "out")
    if command.startswith("prepare_"):
        given = not_a_tokenizer(tmp_path / "tok")
        argv = [command, "--input_dir", str(a_corpus(tmp_path)), "--output_dir", out, "--tokenizer_path", str(given),
                "--num_workers", "1"]
        option = "--tokenizer_path"
    elif command == "convert_from_hf":
        given = an_export_with_a_damaged_tokenizer(tmp_path)
        argv, option = [command, str(given), "--output_dir", out], "checkpoint_dir"
    else:
        given = a_model_dir_with_a_damaged_tokenizer(tmp_path)
        extra = {"generate": ["--device", "cpu"], "evaluate": ["--out_dir", out], "convert_to_hf": ["--output_dir", out]}
        argv = [command, str(given), *extra[command]]
        option = "model_dir" if command == "convert_to_hf" else "checkpoint_dir"
    err = cli_error(argv, capsys)
    assert err.startswith(f"fabric-lin {command}: error: {option}: {given / 'tokenizer.model'} cannot be read as a "
                          "SentencePiece model"), err


def test_train_tokenizer_stopped_by_sigterm_ends_in_one_line_with_143_and_leaves_nothing(tmp_path):
    """SIGTERM (a scheduler's stop) mid-write takes Ctrl-C's clean-up, not its default action, which ends the process at
    once and leaves the output directory with a hidden .tmp- file, refused by the same command run again. The command
    is held with tokenizer.model written whole under its temporary name, before its rename (fabric_lin_process's
    held_before)."""
    import os
    import signal

    import fabric_lin_process
    from helpers import wait_for

    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.txt").write_text("\n".join(f"the quick brown fox {i} jumps" for i in range(200)))
    out, log, stderr = tmp_path / "tok", tmp_path / "stdout", tmp_path / "stderr"
    env = {key: value for key, value in os.environ.items() if key != "FABRIC_LIN_DEBUG"}
    command = [*fabric_lin_process.FABRIC_LIN, "train_tokenizer", "--input_dir", str(tmp_path / "raw"), "--output_dir",
               str(out), "--vocab_size", "300", "--num_threads", "1"]
    proc = fabric_lin_process.start(command, log, env, err_log=stderr, held_before="tokenizer.model")
    try:
        held = fabric_lin_process.HELD.format("tokenizer.model")
        assert wait_for(lambda: held in log.read_text(), proc, timeout=60), stderr.read_text()[-3000:]
        assert (out / ".tmp-tokenizer.model").is_file()
        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(30)
    finally:
        fabric_lin_process.stop(proc)
    err = stderr.read_text()
    assert returncode == 128 + signal.SIGTERM, err[-3000:]
    assert err.splitlines()[-1:] == [
        "fabric-lin train_tokenizer: stopped by SIGTERM: nothing half-written is left; run the same command again"]
    assert not out.exists()
