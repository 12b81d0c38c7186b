"""Prepared (tokenized) data directories: litdata chunks + index.json + the tokenizer's files + `prepared.json`.

`prepared.json` is written last by the preprocessors, just before the directory gets its final
name; it records which tokenizer made the tokens (the sha256 of its tokenizer.model), so that training or
evaluating with another one, or mixing directories of two tokenizers, is refused. The tokenizer's own files
travel with the tokens, so that a run on the directory can put them into its checkpoints."""
import json
from pathlib import Path
from typing import List, Optional, Sequence, Union

import numpy as np

from fabric_lin.args import SHORTEST_SEQ_LENGTH
from fabric_lin.config import OTHER_VOCAB_SIZE
from fabric_lin.data.raw_files import TEXT_SUFFIXES
from fabric_lin.data.tokenizer import (
    Tokenizer,
    copy_tokenizer_files,
    describe_tokenizer,
    recorded_tokenizer,
    tokenizer_identity,
)
from fabric_lin.errors import InvalidValue, MissingFile
from fabric_lin.files import INDEX_FILE, read_json

PREPARED_INFO_FILE = "prepared.json"
PREPARE_RAW_TEXT = "e.g. fabric-lin prepare_text --input_dir {} --output_dir DIR --tokenizer_path TOKENIZER_DIR"


def sample_tokens(max_seq_length: int) -> int:
    """The tokens of one sample, which litdata's TokensLoader cuts from within one chunk file: max_seq_length inputs
    and the target of the last of them."""
    return max_seq_length + 1


SMALLEST_CHUNK = sample_tokens(SHORTEST_SEQ_LENGTH)  # fewer tokens per chunk file hold no sample at any length


def write_prepared_info(out_dir: Union[str, Path], tokenizer: Tokenizer, tokenizer_shown_as: Optional[Path] = None,
                        **fields) -> Path:
    """The tokenizer's files, then prepared.json (last: it marks the directory complete). It names the tokenizer
    `tokenizer_shown_as` where given (where a caller moves it afterwards)."""
    copy_tokenizer_files(tokenizer.checkpoint_dir, out_dir)
    info = {"complete": True, "tokenizer": tokenizer.record(tokenizer_shown_as), **fields}
    path = Path(out_dir) / PREPARED_INFO_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def chunk_tokens(path: Union[str, Path]) -> np.ndarray:
    """The token count of each chunk file of a prepared directory, in its index's order (litdata's
    TokensLoader cuts each into blocks, numbered in this order by `StreamingDataset[i]`)."""
    index_path = Path(path) / INDEX_FILE
    try:
        chunks = json.loads(index_path.read_text(encoding="utf-8"))["chunks"]
        return np.array([int(chunk["dim"]) for chunk in chunks], dtype=np.int64)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidValue(f"{index_path}: expected litdata's index with a token count (dim) for every chunk ({err!r})") from None


class BlockTooLong(InvalidValue):
    """A sequence length whose samples a prepared directory cannot give: a sample is a block of length + 1
    tokens that litdata's TokensLoader cuts inside one chunk file. `setting` is the option that set the length
    (train.max_seq_length in pretrain, --seq_len in evaluate), named in the fix."""

    def __init__(self, path: Union[str, Path], block_size: int, setting: str = "train.max_seq_length") -> None:
        self.path, self.block_size, self.setting = Path(path), block_size, setting
        super().__init__(self.describe())

    def for_setting(self, setting: str) -> "BlockTooLong":
        return BlockTooLong(self.path, self.block_size, setting)

    def describe(self) -> str:
        dims = chunk_tokens(self.path)
        if dims.sum() == 0:  # no length would do
            return (f"{self.path} holds no tokens ({len(dims)} chunk files in its {INDEX_FILE}): prepare it again from "
                    f"its raw text, or leave it out of the data")
        length = f"{self.setting}={self.block_size - 1}"
        if dims.sum() >= self.block_size:  # enough tokens, cut into chunk files that are too small
            why = f"its largest chunk file holds {dims.max(initial=0)} tokens"
            fix = f"lower {self.setting} or prepare the data with a larger chunk_size"
        else:
            why = f"it holds {dims.sum()} tokens in all"
            val_fraction = held_out_share(self.path)
            fix = (f"prepare it again with a larger --val_fraction (this split held out {val_fraction} of the documents), "
                   f"or lower {self.setting}" if val_fraction is not None else f"lower {self.setting} or give it more data")
        return (f"{length} is too long for {self.path}: a sample is a block of {self.setting} + 1 = {self.block_size}"
                f" tokens from one chunk file, and {why}; {fix}")


def held_out_share(path: Union[str, Path]) -> Optional[float]:
    """The --val_fraction of a validation split written by prepare_text, else None."""
    try:
        info = json.loads((Path(path) / PREPARED_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return info.get("val_fraction") if isinstance(info, dict) and info.get("split") == "val" else None


def prepared_from(info: dict) -> Optional[str]:
    """The raw input of a prepared directory as its prepared.json `info` records it: the preprocessor, its input
    directory and, for prepare_text, the files and field it read. The same split of two directories of one input holds
    the same documents, whatever their chunk files, workers or --fast_dev_run (a share of the same files). None where
    prepared.json names no input directory."""
    if not isinstance(info.get("input_dir"), str):
        return None
    read = [f"--{key} {info[key]!r}" for key in ("pattern", "text_key") if key in info]
    return ", ".join([f"{info.get('recipe')} of {info['input_dir']}"] + read)


# what a prepared.json says of the input of the documents it holds, which `shares_documents` compares: kept in the
# trained_with.json of weights trained on it, for when the directory is gone
DOCUMENT_KEYS = ("recipe", "input_dir", "pattern", "text_key", "split", "val_fraction")


def shares_documents(val: dict, train: dict) -> Optional[str]:
    """How a validation directory and a training directory, by their prepared.json `val` and `train`, hold some of the
    same documents: prepared from one input (prepare_text's splits of it apart: a document's hash falls at or above
    --val_fraction for train/, below it for val/), or from an input inside the other's, or from one input with other
    --pattern globs, whose files both read. Which files both read is told by the inputs where they are on disk, else by
    the globs (the preprocessors find files recursively, prepare_text's default --pattern). None where their records
    tell of none."""
    source = prepared_from(val)
    if source is None or prepared_from(train) is None:
        return None
    (val_low, val_high), (train_low, train_high) = hashes_held(val), hashes_held(train)
    held_apart = max(val_low, train_low) >= min(val_high, train_high)
    shares = (f", with other shares held out (--val_fraction {val.get('val_fraction')} and "
              f"{train.get('val_fraction')})" if "split" in val and "split" in train else "")
    if source == prepared_from(train):
        return None if held_apart else f"both were prepared from {source}{shares}"
    if any(val.get(key) != train.get(key) for key in ("recipe", "text_key")):
        return None
    val_input, train_input = Path(val["input_dir"]), Path(train["input_dir"])
    if not (val_input.is_relative_to(train_input) or train_input.is_relative_to(val_input)):
        return None
    # a document's hash is of its file's path relative to the input directory: under one input, the same in both
    if val_input == train_input and held_apart:
        return None
    common = files_read_by_both(val, train)
    if common is not None:
        if not common:
            return None
        files = f"{len(common)} file(s) (e.g. {common[0]})"
        if val_input == train_input:
            return (f"both were prepared from {val_input}, with the --pattern {val.get('pattern', '**/*')!r} and "
                    f"{train.get('pattern', '**/*')!r}, which both read {files}{shares}")
        return (f"it was prepared from {val_input}, the training data from {train_input}, and both read {files}: "
                f"their splits hold out other documents of them (by their path relative to each input)")
    recursively = "(its files found recursively)"
    if val_input.is_relative_to(train_input) and train.get("pattern", "**/*") == "**/*":
        return (f"it was prepared from {val_input}, inside {train_input}, which the training data was prepared from "
                f"{recursively}")
    if train_input.is_relative_to(val_input) and val.get("pattern", "**/*") == "**/*":
        return (f"it was prepared from {val_input}, which holds {train_input}, which the training data was prepared "
                f"from {recursively}")
    return None


def files_read_by_both(val: dict, train: dict) -> Optional[List[Path]]:
    """The input files that two prepared directories were both made from (their prepared.json `val` and `train`),
    sorted: those of each input directory that its --pattern matches (prepare_text's files; another preprocessor's
    are its input's files found recursively). None where either input directory is not on this machine."""
    from fabric_lin.data.raw_files import listed_file

    read = []
    for info in (val, train):
        input_dir = Path(info["input_dir"])
        if not input_dir.is_dir():
            return None
        read.append({p.resolve() for p in input_dir.glob(info.get("pattern", "**/*"))
                     if p.name.endswith(TEXT_SUFFIXES) and listed_file(p)})
    return sorted(read[0] & read[1])


def hashes_held(info: dict) -> tuple:
    """The documents of its input that a prepared directory holds, as the range of their hash in [0, 1): prepare_text's
    train/ those at or above --val_fraction, its val/ those below it, a directory of another preprocessor all."""
    share = info.get("val_fraction") or 0
    return {"train": (share, 1), "val": (0, share)}.get(info.get("split"), (0, 1))


def check_prepared_dir(
    path: Union[str, Path], tokenizer: Optional[Tokenizer] = None, vocab_size: Optional[int] = None
) -> dict:
    """Check that `path` is a complete prepared directory (made with `tokenizer`, when given, and with
    a vocabulary of at most `vocab_size` tokens, the model's, when given).

    Returns the contents of its prepared.json. Raises FileNotFoundError for a missing directory or
    index, ValueError for an incomplete directory, a tokenizer mismatch or a too large vocabulary."""
    info = read_prepared_dir(path)
    check_made_for(path, info, tokenizer, vocab_size)
    return info


def check_prepared_dirs(
    paths: Sequence[Union[str, Path]], tokenizer: Optional[Tokenizer] = None, vocab_size: Optional[int] = None
) -> List[dict]:
    """`check_prepared_dir` for each of the directories one run reads (training and validation), which must
    also have been tokenized by one tokenizer: the same id is another piece in another tokenizer."""
    paths = [Path(p) for p in paths]
    infos = [read_prepared_dir(path) for path in paths]
    for path, info in zip(paths, infos):
        if tokenizer_identity(info) != tokenizer_identity(infos[0]):
            raise InvalidValue(
                f"{paths[0]} and {path} were tokenized with different tokenizers ({describe_tokenizer(infos[0])} and"
                f" {describe_tokenizer(info)}, from their {PREPARED_INFO_FILE}): a run reads the ids of one tokenizer;"
                " prepare them all with the same --tokenizer_path"
            )
    for path, info in zip(paths, infos):
        check_made_for(path, info, tokenizer, vocab_size)
    return infos


def carried_tokenizer_dir(paths: Sequence[Union[str, Path]]) -> Optional[Path]:
    """The first of `paths` that holds the tokenizer.model all of them were tokenized with (the preprocessors copy
    it beside the tokens), or None: directories that are missing, incomplete, without the files or of several
    tokenizers give none here (`check_prepared_dirs` names what is wrong with them)."""
    identities = set()
    for path in paths:
        try:
            identities.add(tokenizer_identity(json.loads((Path(path) / PREPARED_INFO_FILE).read_text(encoding="utf-8"))))
        except (OSError, ValueError, AttributeError):
            return None
    if len(identities) != 1:
        return None
    return next((Path(p) for p in paths if (Path(p) / "tokenizer.model").is_file()), None)


def read_prepared_dir(path: Union[str, Path]) -> dict:
    """The prepared.json of a complete prepared directory; the directory, its index, prepared.json and its chunk
    files checked first, each missing one named."""
    path = Path(path)
    if path.is_file():
        fix = (f"did you mean {path.parent}?" if (path.parent / INDEX_FILE).is_file()
               else "raw text is tokenized first, " + PREPARE_RAW_TEXT.format(path.parent))
        raise InvalidValue(f"{path} is a file, expected a prepared data directory ({INDEX_FILE}, {PREPARED_INFO_FILE} and "
                           f"token chunks): {fix}")
    if not path.is_dir():
        raise MissingFile(
            f"Prepared data directory {str(path)!r} does not exist: run `fabric-lin prepare_text`,"
            " `fabric-lin prepare_slimpajama` or `fabric-lin prepare_starcoder` to create it"
        )
    index_path = path / INDEX_FILE
    if not index_path.is_file():
        # prepare_text's --output_dir holds train/ and val/, each a prepared directory
        inside = sorted(p for p in path.iterdir() if (p / INDEX_FILE).is_file())
        raw_text = sorted(p.name for p in path.iterdir() if p.is_file() and p.name.endswith(TEXT_SUFFIXES))
        if inside:
            hint = f"; it holds prepared directories ({', '.join(p.name for p in inside)}): did you mean {inside[0]}?"
        elif raw_text:
            hint = (f": it holds raw text ({', '.join(raw_text[:3])}{', ...' if len(raw_text) > 3 else ''}), which is "
                    f"tokenized first, {PREPARE_RAW_TEXT.format(path)}")
        else:
            hint = ": it is not a prepared litdata directory, or its preprocessing run did not finish; prepare it again"
        raise MissingFile(f"{path} has no {INDEX_FILE}{hint}")
    info_path = path / PREPARED_INFO_FILE
    if not info_path.is_file():
        raise InvalidValue(
            f"{path} is incomplete: {PREPARED_INFO_FILE} is missing (written last by fabric-lin's preprocessors,"
            " so the run was interrupted or another tool wrote this directory); prepare it again"
        )
    info = read_json(info_path)
    if info.get("complete") is not True:
        raise InvalidValue(f"{info_path} does not mark the directory complete; prepare it again")
    chunks = read_json(index_path).get("chunks", [])
    if not isinstance(chunks, list) or not all(isinstance(c, dict) and isinstance(c.get("filename"), str) for c in chunks):
        raise InvalidValue(f"{index_path}: expected litdata's index: a list of chunks, each with its filename; prepare it again")
    missing = [c["filename"] for c in chunks if not (path / c["filename"]).is_file()]
    if missing:
        raise InvalidValue(f"{path} is incomplete: {len(missing)} chunk file(s) listed in {INDEX_FILE} are missing, e.g. {missing[0]}")
    check_chunk_sizes(path, chunks)
    return info


def check_not_prepare_text_output(val_dir: Path, key: str) -> None:
    """prepare_text's --output_dir given as a validation directory (`key`: data.val_dir, data.val_path) is refused
    naming its val/: the check of every prepared directory would suggest its train/, and validating on training data
    is what the split exists to avoid."""
    if not (val_dir / INDEX_FILE).is_file() and (val_dir / "val" / INDEX_FILE).is_file():
        inside = ", ".join(sorted(p.parent.name for p in val_dir.glob(f"*/{INDEX_FILE}")))
        raise MissingFile(f"{key} {val_dir} has no {INDEX_FILE}; it holds prepared directories ({inside}): "
                          f"did you mean {val_dir / 'val'}?")


def check_chunk_sizes(path: Path, chunks: List[dict]) -> None:
    """Refuse chunk files of another size than the index gives (an interrupted copy cuts them short). litdata takes
    a file shorter than that for a download in progress and waits for the rest: a run on it would wait for ever."""
    for chunk in chunks:
        expected = chunk.get("chunk_bytes")
        size = (path / chunk["filename"]).stat().st_size
        if isinstance(expected, int) and size != expected:
            how = "truncated" if size < expected else "grown"
            raise InvalidValue(f"{path} is damaged: {chunk['filename']} has {size:,} bytes, {expected:,} in {INDEX_FILE} "
                               f"({how}); copy the directory again, or prepare it again")


def check_made_for(path: Union[str, Path], info: dict, tokenizer: Optional[Tokenizer], vocab_size: Optional[int]) -> None:
    """Refuse a prepared directory (its prepared.json `info`) made with another tokenizer than `tokenizer`, or
    with a vocabulary larger than the model's `vocab_size` (either check skipped where None)."""
    if tokenizer is not None and tokenizer_identity(info) != tokenizer.identity:
        raise MadeWithAnotherTokenizer(path, info, tokenizer)
    data_eos = recorded_tokenizer(info).get("eos_id", tokenizer.eos_id) if tokenizer is not None else None
    if tokenizer is not None and data_eos != tokenizer.eos_id:  # the same tokenizer.model, another tokenizer_config.json
        raise InvalidValue(
            f"{path}: its documents end with {tokenizer.describe_id(data_eos)} ({tokenizer.piece_of(data_eos)}, the "
            f"end-of-text token of the tokenizer that prepared it, in its {PREPARED_INFO_FILE}), and the end-of-text token "
            f"of {tokenizer.checkpoint_dir} is {tokenizer.describe_eos()}: give the tokenizer_config.json that prepared "
            f"the data")
    data_vocab = recorded_tokenizer(info).get("vocab_size")
    if vocab_size is not None and isinstance(data_vocab, int) and data_vocab > vocab_size:
        raise VocabularyTooLarge(path, data_vocab, vocab_size)


class MadeWithAnotherTokenizer(InvalidValue):
    """A prepared directory (its prepared.json `info`) tokenized with another tokenizer than the run's. The fix it names
    is pretrain's (the run's tokenizer is its choice); evaluate, whose tokenizer is the model's, words its own."""

    def __init__(self, path: Union[str, Path], info: dict, tokenizer: Tokenizer) -> None:
        self.path, self.info, self.tokenizer = Path(path), info, tokenizer
        if beside_other_tokens(tokenizer):
            # the tokenizer carried beside the tokens, taken without --tokenizer_dir: its files were replaced since
            super().__init__(
                f"{path} was tokenized with {describe_tokenizer(info)}, and {tokenizer.describe()}, taken as the run's "
                f"tokenizer, is not the one its own {PREPARED_INFO_FILE} records: the tokenizer files beside those tokens "
                "were replaced; put back the files of the tokenizer that prepared them, or give that one as --tokenizer_dir"
            )
            return
        super().__init__(
            f"{path} was tokenized with a different tokenizer ({describe_tokenizer(info)}) than {tokenizer.describe()};"
            " prepare the data with this tokenizer, or use the one that made it"
        )


def beside_other_tokens(tokenizer: Tokenizer) -> bool:
    """Whether `tokenizer` lies in a prepared directory whose prepared.json records another tokenizer."""
    try:
        info = json.loads((Path(tokenizer.checkpoint_dir) / PREPARED_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and tokenizer_identity(info) != tokenizer.identity


class VocabularyTooLarge(InvalidValue):
    """A prepared directory tokenized with a vocabulary larger than the model's: its ids past the model's last embedding
    cannot be read. The fix it names is pretrain's (a model config of a larger vocab_size); evaluate, which reads a
    model as it is, words its own from `path`, `data_vocab` and `model_vocab`."""

    def __init__(self, path: Union[str, Path], data_vocab: int, model_vocab: int) -> None:
        self.path, self.data_vocab, self.model_vocab = Path(path), data_vocab, model_vocab
        super().__init__(
            f"{path} was tokenized with a vocabulary of {data_vocab} tokens ({PREPARED_INFO_FILE}: tokenizer.vocab_size),"
            f" more than the model's vocab_size={model_vocab}: token ids would fall outside the embedding; use a model"
            f" config with vocab_size >= {data_vocab} ({OTHER_VOCAB_SIZE}) or prepare the data with the model's tokenizer"
        )
