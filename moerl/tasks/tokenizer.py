"""Tokenizers: any ``tokenizer.json`` through the ``tokenizers`` library, and a built-in character one.

One loading path serves every model: a Hugging Face model folder's ``tokenizer.json`` and the
built-in character-level tokenizer (``moerl/assets/tokenizer.json``, one token per printable ASCII
character plus newline, and the special tokens ``<pad>``, ``<eos>``, ``<unk>``) are read the same way.
The special token ids come from ``tokenizer_config.json`` beside the file when present (its
``eos_token`` / ``pad_token``), else from well-known token names; pad falls back to eos.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from moerl.atomic import atomic_write_text

if TYPE_CHECKING:
    from moerl.config import RunConfig

ASSETS = Path(__file__).resolve().parent.parent / "assets"
BUILTIN_TOKENIZER = ASSETS / "tokenizer.json"
"""The built-in character tokenizer, written by ``build_char_tokenizer`` (regenerate with
``python -m moerl.tasks.tokenizer``)."""

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
"""The built-in vocabulary after the specials: newline and the 95 printable ASCII characters."""

_EOS_NAMES = ("<|endoftext|>", "<|im_end|>", "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class Tokenizer:
    """Text <-> token ids over a ``tokenizers.Tokenizer``.

    Attributes:
        eos_id: id of the end-of-sequence token (generation stops on it; SFT appends it).
        pad_id: id used to pad batches (never attended to, never in a loss).
        vocab_size: number of ids, including added special tokens (the model's embedding rows).
    """

    def __init__(
        self, backend: HFTokenizer, *, eos_id: int, pad_id: int, source: str, config: dict | None = None
    ) -> None:
        self.backend = backend
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.source = source
        self.config = dict(config or {})
        """``tokenizer_config.json`` as read (``chat_template``, ``unk_token``, ...); kept on ``save``."""
        self.folder = Path(source).parent if Path(source).is_file() else None
        """The folder the tokenizer was loaded from (None: built in memory)."""
        self.chat_template: str | None = _chat_template(self.config, self.folder)
        """The Jinja chat template (``tokenizer_config.json``'s or ``chat_template.jinja``'s), or None."""

    @property
    def special_tokens(self) -> dict[str, str]:
        """The special tokens a chat template may use (``bos_token``, ``eos_token``, ``unk_token``,
        ``pad_token``, ...), as strings: the config's, with eos and pad the ones this tokenizer uses."""
        out = {}
        for key, value in self.config.items():
            if key.endswith("_token") and key != "chat_template":
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    out[key] = value
        out["eos_token"] = self.backend.id_to_token(self.eos_id)
        out["pad_token"] = self.backend.id_to_token(self.pad_id)
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, without any special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, with special tokens (pad, eos, ...) left out."""
        return self.backend.decode(list(ids), skip_special_tokens=True)

    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (atomically each), the
        config the one it was loaded with (``chat_template``, ``unk_token``, added tokens, ...) with eos and
        pad set, and copy the tokenizer's other files beside it (``COMPANION_FILES``)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "tokenizer.json", self.backend.to_str(pretty=True))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **self.config,
            "eos_token": self.backend.id_to_token(self.eos_id),
            "pad_token": self.backend.id_to_token(self.pad_id),
        }
        atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False))
        copy_companions(self.folder, folder, TOKENIZER_COMPANIONS)

    def __repr__(self) -> str:
        return f"Tokenizer({self.source}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id})"


TOKENIZER_COMPANIONS = ("special_tokens_map.json", "chat_template.jinja", "chat_template.json")
"""Tokenizer files besides ``tokenizer.json`` and ``tokenizer_config.json`` that ``Tokenizer.save`` copies."""
MODEL_COMPANIONS = ("generation_config.json",)
"""Files of a model folder that are neither weights nor config and that exports keep (``copy_companions``)."""


def copy_companions(src: Path | None, dst: Path, names: tuple[str, ...]) -> None:
    """Copy the files ``names`` that exist in ``src`` into ``dst`` (atomically each; same folder: nothing)."""
    if src is None or not src.is_dir() or src.resolve() == Path(dst).resolve():
        return
    for name in names:
        if (src / name).is_file():
            atomic_write_text(Path(dst) / name, (src / name).read_text(encoding="utf-8"))


def _chat_template(config: dict, folder: Path | None) -> str | None:
    """``chat_template`` of a tokenizer config (a string, or transformers' list of ``{name, template}``:
    the ``default`` one), else a ``chat_template.jinja`` file in ``folder``."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    jinja = folder / "chat_template.jinja" if folder is not None else None
    return jinja.read_text(encoding="utf-8") if jinja is not None and jinja.is_file() else None


def build_char_tokenizer() -> HFTokenizer:
    """The built-in character-level tokenizer: ids 0-2 are ``<pad> <eos> <unk>``, then ``CHARS``.

    A BPE model without merges maps each character to its own id (unknown ones to ``<unk>``), and
    the ``Fuse`` decoder joins tokens without separators, so ``decode(encode(s)) == s`` for ASCII.
    """
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARS:
        vocab[ch] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([PAD, EOS, UNK])
    return backend


def _special_id(backend: HFTokenizer, configured: object, names: tuple[str, ...]) -> int | None:
    if isinstance(configured, dict):  # tokenizer_config.json may hold {"content": "<eos>", ...}
        configured = configured.get("content")
    if isinstance(configured, str) and backend.token_to_id(configured) is not None:
        return backend.token_to_id(configured)
    for name in names:
        if backend.token_to_id(name) is not None:
            return backend.token_to_id(name)
    return None


def load_tokenizer(path: str | os.PathLike[str] | None = None) -> Tokenizer:
    """Load a tokenizer.

    Args:
        path: a ``tokenizer.json`` file or a folder holding one (e.g. a Hugging Face model folder);
            ``None``: the built-in character tokenizer.

    Raises:
        FileNotFoundError: no ``tokenizer.json`` at ``path``.
        ValueError: the file is not a valid tokenizer, or it has no recognizable end-of-sequence token.
    """
    file = BUILTIN_TOKENIZER if path is None else Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path} (looked for {file})")
    try:
        backend = HFTokenizer.from_file(str(file))
    except Exception as e:  # the Rust library raises a bare Exception on malformed files
        raise ValueError(f"{file}: not a valid tokenizer.json ({e})") from e
    config_file = file.parent / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    eos_id = _special_id(backend, config.get("eos_token"), _EOS_NAMES)
    if eos_id is None:
        raise ValueError(f"{file}: no end-of-sequence token found; set eos_token in {config_file}")
    pad_id = _special_id(backend, config.get("pad_token"), _PAD_NAMES)
    return Tokenizer(
        backend, eos_id=eos_id, pad_id=eos_id if pad_id is None else pad_id, source=str(file), config=config
    )


def tokenizer_path_for(tokenizer: str | None, model_path: str | None) -> str | None:
    """Where to load the tokenizer from: the explicit one, else the model folder's, else built-in (None)."""
    if tokenizer is not None:
        return tokenizer
    if model_path is not None and (Path(model_path) / "tokenizer.json").is_file():
        return model_path
    return None


def run_tokenizer_path(cfg: RunConfig, init_path: str | None = None) -> str | None:
    """The tokenizer a run uses: ``task.tokenizer``, else the one beside the model it starts from
    (``init_path``, else ``model.path``), else the built-in one (None)."""
    return tokenizer_path_for(cfg.task.tokenizer, init_path or cfg.model.path)


def load_run_tokenizer(cfg: RunConfig, init_path: str | None = None) -> Tokenizer:
    """``load_tokenizer(run_tokenizer_path(cfg, init_path))``: the same tokenizer in every process of a run."""
    return load_tokenizer(run_tokenizer_path(cfg, init_path))


if __name__ == "__main__":  # regenerate the asset
    ASSETS.mkdir(exist_ok=True)
    built = build_char_tokenizer()
    Tokenizer(built, eos_id=built.token_to_id(EOS), pad_id=built.token_to_id(PAD), source="built").save(
        ASSETS
    )
    print(f"wrote {BUILTIN_TOKENIZER}")
