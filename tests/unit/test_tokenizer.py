"""Tokenizers: the built-in character tokenizer and any tokenizer.json through one loading path."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from moerl.tasks.tokenizer import (
    BUILTIN_TOKENIZER,
    CHARS,
    build_char_tokenizer,
    load_tokenizer,
    tokenizer_path_for,
)


def test_builtin_ids_and_roundtrip():
    tok = load_tokenizer(None)
    assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 1, 3 + 96)
    # ids: 0 <pad>, 1 <eos>, 2 <unk>, 3 "\n", then printable ASCII from " " (id 4): "0" is chr(48) -> 4 + 16
    assert tok.encode("0") == [20]
    assert tok.encode("12+34=") == [21, 22, 4 + ord("+") - 32, 23, 24, 4 + ord("=") - 32]
    text = "Question: 12+34=?\nAnswer: 46 ({x} #$%)"
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("46") + [tok.eos_id, tok.pad_id, tok.pad_id]) == "46"


def test_builtin_unknown_chars_map_to_unk():
    tok = load_tokenizer(None)
    assert tok.encode("é") == [2]
    assert tok.decode(tok.encode("aé")) == "a"  # <unk> is special: dropped on decode


def test_special_tokens_in_text_are_not_split():
    tok = load_tokenizer(None)
    assert tok.encode("7<eos>") == [4 + ord("7") - 32, 1]


def test_asset_matches_builder():
    assert json.loads(BUILTIN_TOKENIZER.read_text()) == json.loads(build_char_tokenizer().to_str())
    assert len(CHARS) == 96


def test_save_and_reload_folder(tmp_path):
    tok = load_tokenizer(None)
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert (again.eos_id, again.pad_id, again.vocab_size) == (tok.eos_id, tok.pad_id, tok.vocab_size)
    assert again.encode("99-1=98") == tok.encode("99-1=98")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == "<eos>"


def test_saved_folder_loads_in_transformers(tmp_path):
    import transformers

    load_tokenizer(None).save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    assert hf.encode("12+34=", add_special_tokens=False) == tok.encode("12+34=")
    assert (hf.eos_token_id, hf.pad_token_id) == (tok.eos_id, tok.pad_id)


def _word_level(tmp_path, specials, config=None):
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "world", *specials])}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(specials)
    backend.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return vocab


def test_foreign_tokenizer_eos_from_config(tmp_path):
    vocab = _word_level(tmp_path, ["<|im_end|>", "<|endoftext|>"], {"eos_token": {"content": "<|im_end|>"}})
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.encode("hello world") == [1, 2]
    assert tok.eos_id == vocab["<|im_end|>"]
    assert tok.pad_id == tok.eos_id  # no pad token: pad falls back to eos
    assert tok.vocab_size == 5


def test_foreign_tokenizer_eos_by_name(tmp_path):
    vocab = _word_level(tmp_path, ["</s>", "<pad>"])
    tok = load_tokenizer(tmp_path)
    assert (tok.eos_id, tok.pad_id) == (vocab["</s>"], vocab["<pad>"])


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    sub = tmp_path / "noeos"
    sub.mkdir()
    _word_level(sub, [])
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        load_tokenizer(sub)


def test_tokenizer_path_for(tmp_path):
    assert tokenizer_path_for("explicit", str(tmp_path)) == "explicit"
    assert tokenizer_path_for(None, str(tmp_path)) is None  # model folder without tokenizer.json
    load_tokenizer(None).save(tmp_path)
    assert tokenizer_path_for(None, str(tmp_path)) == str(tmp_path)
    assert tokenizer_path_for(None, None) is None
