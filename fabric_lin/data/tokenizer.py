"""SentencePiece tokenizer of a checkpoint or tokenizer directory.

The directory holds `tokenizer.model` (SentencePiece, e.g. Llama-2's) and optionally
`tokenizer_config.json`, whose `bos_token` / `eos_token` override the model's own ids. A directory of
weights (a training checkpoint, a model directory, an fla export) also holds `trained_with.json`, the
record of the tokenizer its weights were trained with, which its `tokenizer.model` must be: another one,
of the same vocabulary size too, reads every id as another piece.
"""
import hashlib
import json
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

from fabric_lin.errors import InvalidValue, MissingFile, UserError
from fabric_lin.files import atomic_write, directories_below, read_json, reading, short_list

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json")
# {"tokenizer": Tokenizer.record()} of the tokenizer the weights were trained with, and "data": the data they were trained
# on (`DataModule.training_data_record`; pretrain writes it, a converter carries it over)
TRAINED_WITH_FILE = "trained_with.json"


def tokenizer_model_hash(model_path: Union[str, Path]) -> str:
    """sha256 of a tokenizer.model file: identifies the tokenizer that produced a prepared dataset."""
    digest = hashlib.sha256()
    with open(model_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def copy_tokenizer_files(src_dir: Union[str, Path], dst_dir: Union[str, Path]) -> List[Path]:
    """Copy the tokenizer files present in `src_dir` into `dst_dir`, as new files of the usual mode;
    `tokenizer.model` is required."""
    return write_tokenizer_files(read_tokenizer_files(src_dir), dst_dir)


def read_tokenizer_files(src_dir: Union[str, Path]) -> Dict[str, bytes]:
    """The contents of the tokenizer files present in `src_dir`, by name; `tokenizer.model` is required."""
    src_dir = Path(src_dir)
    if not (src_dir / "tokenizer.model").is_file():
        raise MissingFile(f"{src_dir / 'tokenizer.model'} does not exist: expected a SentencePiece tokenizer.model")
    return {name: (src_dir / name).read_bytes() for name in TOKENIZER_FILES if (src_dir / name).is_file()}


def write_tokenizer_files(files: Dict[str, bytes], dst_dir: Union[str, Path]) -> List[Path]:
    """Write the tokenizer files `read_tokenizer_files` read into `dst_dir`, each atomically, of the usual mode."""
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        atomic_write(dst_dir / name, lambda tmp, content=content: Path(tmp).write_bytes(content))
    return [dst_dir / name for name in files]


def recorded_tokenizer(info: dict) -> dict:
    """The "tokenizer" mapping of a prepared.json or a trained_with.json; {} where it has none, or a value of another
    kind (a file edited by hand), which its reader then refuses by name."""
    made_by = info.get("tokenizer")
    return made_by if isinstance(made_by, dict) else {}


def tokenizer_identity(info: dict) -> tuple:
    """(vocab_size, sha256) of the tokenizer that a prepared.json or a trained_with.json records."""
    made_by = recorded_tokenizer(info)
    return made_by.get("vocab_size"), made_by.get("sha256")


def describe_tokenizer(info: dict) -> str:
    """The tokenizer a prepared.json or a trained_with.json records: "vocab_size=..., sha256=...", and the directory
    it came from."""
    made_by = recorded_tokenizer(info)
    source = f", from {made_by['source']}" if made_by.get("source") else ""
    return f"vocab_size={made_by.get('vocab_size')}, sha256={str(made_by.get('sha256'))[:12]}...{source}"


def read_trained_with(directory: Union[str, Path]) -> Optional[dict]:
    """The trained_with.json of a directory of weights, or None where it has none (written before the record was
    kept, or by a run that knew no tokenizer): then nothing tells which tokenizer its weights were trained with."""
    path = Path(directory) / TRAINED_WITH_FILE
    if not path.is_file():
        return None
    info = read_json(path)
    vocab_size, sha256 = tokenizer_identity(info)
    if not isinstance(vocab_size, int) or not isinstance(sha256, str):
        raise InvalidValue(
            f"{path}: expected {{\"tokenizer\": {{\"vocab_size\": N, \"sha256\": \"...\"}}}}, the tokenizer the weights "
            f"beside it were trained with; got {info!r:.200}"
        )
    return info


def weights_trained_with(directory: Union[str, Path], given_by: str = "") -> Optional[dict]:
    """The tokenizer a directory of weights was trained with, as a record ({"tokenizer": {...}}): its
    trained_with.json (its tokenizer.model, where it has one, checked against it), else its tokenizer.model's; None
    where it tells neither. `given_by`: the option that named `directory`, as `Tokenizer` takes it."""
    has_model = (Path(directory) / "tokenizer.model").is_file()
    tokenizer = Tokenizer(directory, given_by) if has_model else None  # refuses a tokenizer.model that is not the recorded one
    trained_with = read_trained_with(directory)
    if trained_with is not None:
        return trained_with
    return {"tokenizer": tokenizer.record()} if tokenizer is not None else None


def the_recorded_tokenizer(directory: Union[str, Path]) -> str:
    """For a directory of weights without its tokenizer.model: which one to put there, as its trained_with.json records
    it ("; ..."), or "" where it has no readable record."""
    try:
        trained_with = read_trained_with(directory)
    except InvalidValue:
        return ""
    if trained_with is None:
        return ""
    return (f"; its weights were trained with the tokenizer its {TRAINED_WITH_FILE} records ({describe_tokenizer(trained_with)}):"
            f" copy that tokenizer.model (and its tokenizer_config.json) into {directory}")


def tokenizers_below(directory: Union[str, Path]) -> str:
    """For a directory without a tokenizer.model: "; DIR holds one: give that directory" where one lies a level or two
    below it (in a LoRA fine-tune's merged/, a run's final/), else ""."""
    found = list(directories_below(directory, lambda d: (d / "tokenizer.model").is_file()))
    if not found:
        return ""
    named = short_list(found, 3)
    return f"; {named} holds one: give that directory" if len(found) == 1 else f"; {named} hold one each: give one of them"


def write_trained_with(directory: Union[str, Path], info: dict) -> None:
    """Write `info` ({"tokenizer": Tokenizer.record()}) as the directory's trained_with.json."""
    text = json.dumps(info, indent=2) + "\n"
    atomic_write(Path(directory) / TRAINED_WITH_FILE, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _token_content(value) -> Optional[str]:
    # Hugging Face writes special tokens either as a string or as {"content": "<s>", ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, checkpoint_dir: Union[str, Path], given_by: str = "") -> None:
        """`given_by`: the option or key that named `checkpoint_dir` (--tokenizer_path, checkpoint_dir), which an error
        about the tokenizer (not there, not a tokenizer, not the one its weights were trained with) names first."""
        try:
            self._load(Path(checkpoint_dir))
        except UserError as error:
            if not given_by:
                raise
            raise type(error)(f"{given_by}: {error}") from None

    def _load(self, checkpoint_dir: Path) -> None:
        from sentencepiece import SentencePieceProcessor

        if checkpoint_dir.is_file():
            beside = checkpoint_dir.parent
            # the directory of a tokenizer.model given for it; another file (a prompt, the weights) names none
            where = (f"here {beside}" if (beside / "tokenizer.model").is_file()
                     else f"and {beside} holds no tokenizer.model")
            raise InvalidValue(f"{checkpoint_dir} is a file: expected the directory that holds tokenizer.model (and "
                               f"tokenizer_config.json), {where}")
        if not checkpoint_dir.is_dir():
            raise MissingFile(
                f"Tokenizer directory {str(checkpoint_dir)!r} does not exist: expected a directory holding tokenizer.model"
            )
        self.checkpoint_dir = checkpoint_dir
        self.model_path = checkpoint_dir / "tokenizer.model"
        if not self.model_path.is_file():
            present = sorted(p.name for p in checkpoint_dir.iterdir())
            shown = short_list(present, 10)
            raise MissingFile(
                f"{self.model_path} does not exist: expected a SentencePiece tokenizer.model in {checkpoint_dir}"
                f" (found: {shown or 'nothing'}){the_recorded_tokenizer(checkpoint_dir) or tokenizers_below(checkpoint_dir)}"
            )
        self.processor = SentencePieceProcessor()
        with reading(self.model_path, "a SentencePiece model", OSError, RuntimeError):
            self.processor.Load(str(self.model_path))

        self.vocab_size = self.processor.GetPieceSize()
        self.bos_id = self.processor.bos_id()
        self.eos_id = self.processor.eos_id()
        self.eos_named_by = "its tokenizer.model's own"
        config_path = checkpoint_dir / "tokenizer_config.json"
        if config_path.is_file():
            config = read_json(config_path)
            for key in ("bos_token", "eos_token"):
                token = _token_content(config.get(key))
                if token is None:
                    continue
                if not isinstance(token, str):
                    raise InvalidValue(f"{config_path}: {key}={token!r}: expected the token's piece, a string such as '</s>'")
                token_id = self.processor.PieceToId(token)
                if token_id == self.processor.unk_id() and token != self.processor.IdToPiece(token_id):
                    raise InvalidValue(f"{config_path}: {key}={token!r} is not a piece of {self.model_path}")
                setattr(self, key.replace("_token", "_id"), token_id)
                if key == "eos_token":
                    self.eos_named_by = f"the eos_token of its {config_path.name}"
        for name in ("bos_id", "eos_id"):
            if getattr(self, name) < 0:
                setattr(self, name, None)
        self._hash: Optional[str] = None
        # here, where every command reads a directory's tokenizer: none reads a model's weights through another one
        self.check_trained_with()

    def check_trained_with(self) -> None:
        """Refuse a tokenizer.model that is not the one its directory's trained_with.json records (where it has one):
        the weights beside it learnt the ids of that one, and this one makes other pieces of the same ids."""
        trained_with = read_trained_with(self.checkpoint_dir)
        if trained_with is not None and tokenizer_identity(trained_with) != self.identity:
            raise InvalidValue(
                f"{self.checkpoint_dir}: {self.describe()} is not the tokenizer its weights were trained with "
                f"({describe_tokenizer(trained_with)}, recorded in {TRAINED_WITH_FILE}): an id is another piece in each; "
                f"put back the tokenizer.model the model was trained with"
            )
        trained_eos = self.eos_id if trained_with is None else recorded_tokenizer(trained_with).get("eos_id", self.eos_id)
        if trained_eos != self.eos_id:  # the same tokenizer.model, with another tokenizer_config.json
            raise InvalidValue(
                f"{self.checkpoint_dir}: its end-of-text token is {self.describe_eos()}, and its weights were trained on "
                f"documents that end with {self.describe_id(trained_eos)} ({self.piece_of(trained_eos)}, recorded in "
                f"{TRAINED_WITH_FILE}): put back the tokenizer_config.json the model was trained with"
            )

    def piece_of(self, token_id: Optional[int]) -> str:
        known = isinstance(token_id, int) and 0 <= token_id < self.vocab_size
        return repr(self.processor.IdToPiece(token_id)) if known else "none"

    @staticmethod
    def describe_id(token_id: Optional[int]) -> str:
        return f"id {token_id}" if token_id is not None else "no id"

    def describe_eos(self) -> str:
        """"id 2 ('</s>', its tokenizer.model's own)": the end-of-text token and what names it."""
        return f"{self.describe_id(self.eos_id)} ({self.piece_of(self.eos_id)}, {self.eos_named_by})"

    @property
    def model_hash(self) -> str:
        if self._hash is None:
            self._hash = tokenizer_model_hash(self.model_path)
        return self._hash

    @property
    def identity(self) -> tuple:
        """(vocab_size, sha256): what tells it from another tokenizer, as `tokenizer_identity` reads it from a record."""
        return self.vocab_size, self.model_hash

    def record(self, shown_as: Optional[Path] = None) -> dict:
        """What a prepared directory (prepared.json) and a directory of weights (trained_with.json) record of the
        tokenizer that made their ids. `shown_as`: where it is named, where a caller moves it afterwards."""
        return {
            "vocab_size": self.vocab_size,
            "sha256": self.model_hash,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
            "source": str(Path(shown_as or self.checkpoint_dir).absolute()),  # where it was copied from, to name it
        }

    def _special(self, ids: List[int], bos: bool, eos: bool) -> List[int]:
        if bos:
            if self.bos_id is None:
                raise InvalidValue(f"{self.model_path} defines no BOS token; call encode with bos=False")
            ids.insert(0, self.bos_id)
        if eos:
            if self.eos_id is None:
                raise InvalidValue(f"{self.model_path} defines no EOS token; call encode with eos=False")
            ids.append(self.eos_id)
        return ids

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> torch.Tensor:
        ids = self._special(self.processor.EncodeAsIds(text), bos, eos)
        return torch.tensor(ids, dtype=torch.int32)

    def encode_batch(
        self, texts: Sequence[str], bos: bool = False, eos: bool = True, num_threads: int = -1
    ) -> List[List[int]]:
        """Encode many documents in one call: SentencePiece spreads the list over `num_threads` threads
        (-1: all cores)."""
        if not isinstance(texts, list):
            texts = list(texts)
        batch = self.processor.Encode(texts, out_type=int, num_threads=num_threads)
        if bos or eos:
            for ids in batch:
                self._special(ids, bos, eos)
        return batch

    def decode(self, ids: Union[torch.Tensor, Iterable[int]]) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.processor.DecodeIds(list(ids))

    def describe(self) -> str:
        """Its file and what tells it from another: "DIR/tokenizer.model (vocab_size=N, sha256=0123456789ab...)"."""
        return f"{self.model_path} (vocab_size={self.vocab_size}, sha256={self.model_hash[:12]}...)"

    def check_fits(self, embeddings: int, model_dir: Union[str, Path]) -> None:
        """Refuse a tokenizer with more pieces than the model has embeddings: it is not the model's tokenizer (an id
        past the last embedding would fail inside the model, or read another token's row)."""
        if self.vocab_size > embeddings:
            raise InvalidValue(
                f"{model_dir}: its tokenizer has {self.vocab_size:,} pieces and its model {embeddings:,} embeddings, so "
                f"the tokenizer is not the model's ({self.describe()}): put the tokenizer the model was trained with there"
            )

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.checkpoint_dir)!r}, vocab_size={self.vocab_size})"


def token_dtype(vocab_size: int):
    """Smallest numpy dtype that holds every token id: uint16 for vocabularies up to 65536 (half the disk)."""
    import numpy as np

    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)
