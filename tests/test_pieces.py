"""Documents in pieces: the pieces' ids equal the whole document's for the byte-level BPE and a pretrained-style
tokenizer from a local folder; where pieces are cut; .txt files read in chunks into documents by data.sample_by."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.data import pieces as pieces_module
from trainer.data.corpus import StdlibCorpus
from trainer.data.pieces import (
    CUT,
    MAX_PIECE_CHARS,
    PIECE_CHARS,
    cut_positions,
    mark_ends,
    separator_of,
    split_text,
    text_file_items,
)
from trainer.data.tokenizer import EOS_TOKEN, load_fast, locate_pretrained, train_bpe, write_tokenizer_config

# A Llama-3/tiktoken-style pattern: a newline glued to the punctuation before it, letters taking one leading
# non-letter, digits in threes; the kind of pre-tokenizer most pretrained tokenizers of today carry.
TIKTOKEN_STYLE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def text() -> str:
    """About 100 K characters of real, varied text (code, prose in docstrings, digits, indentation, blank lines, some
    non-ASCII) with a few seams made to tempt a careless cut: punctuation before a newline, runs of spaces and tabs."""
    documents = list(StdlibCorpus().documents())[:25]
    return "\n\n".join(documents)[:100_000] + ".\n  x\t\ty ÿ 12345 ,\n\nend"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory, text: str) -> dict[str, object]:
    """The project's byte-level BPE, and a tiktoken-style one saved as a pretrained folder and loaded by path."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = tmp_path_factory.mktemp("bpe")
    train_bpe([text], 400, bpe)
    folder = tmp_path_factory.mktemp("pretrained")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(TIKTOKEN_STYLE), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS_TOKEN], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(folder, EOS_TOKEN)
    return {"byte-level BPE": load_fast(bpe), "pretrained folder": load_fast(locate_pretrained(str(folder)))}


@pytest.mark.parametrize("name", ["byte-level BPE", "pretrained folder"])
def test_the_pieces_ids_equal_the_whole_documents(tokenizers: dict[str, object], text: str, name: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pieces: more cuts, more chances to differ; where a piece ends does not depend on its size."""
    monkeypatch.setattr(pieces_module, "PIECE_CHARS", 1024)
    monkeypatch.setattr(pieces_module, "MAX_PIECE_CHARS", 4096)
    tokenizer = tokenizers[name]
    parts = list(split_text(text))
    assert len(parts) > 50 and "".join(parts) == text
    whole = tokenizer.encode(text, add_special_tokens=False).ids
    joined = [i for e in tokenizer.encode_batch_fast(parts, add_special_tokens=False) for i in e.ids]
    assert joined == whole


def test_pieces_end_at_safe_places_or_at_the_limit() -> None:
    text = ("word " * 10_000) + "x" * (3 * MAX_PIECE_CHARS) + "\nlast"
    ends = list(cut_positions(text))
    assert ends[-1] == len(text)
    starts = [0, *ends[:-1]]
    for start, end in zip(starts, ends[:-1]):
        assert PIECE_CHARS <= end - start <= MAX_PIECE_CHARS
        safe = any(m.end() == end for m in CUT.finditer(text, end - 1, end + 2))
        assert safe or end - start == MAX_PIECE_CHARS
    assert text[ends[0] - 4:ends[0] + 1] == "word "  # a cut before " word": "... word" | " word ..."
    assert sum(end - start == MAX_PIECE_CHARS for start, end in zip(starts, ends)) >= 2  # the run without spaces
    assert list(split_text("short")) == ["short"]


def test_pieces_are_marked_with_their_documents_end() -> None:
    assert list(mark_ends(["a", "b", None, None, "c", None, "d"])) == [("a", False), ("b", True), ("c", True),
                                                                      ("d", True)]


def reference_documents(text: str, sample_by: str) -> list[str]:
    if sample_by == "document":
        return [text] if text.strip() else []
    if sample_by == "paragraph":
        parts = re.split(r"\n(?:[^\S\n]*\n)+", text)
    else:
        parts = text.split("\n" if sample_by == "line" else sample_by)
    return [p for p in parts if p.strip()]


@pytest.mark.parametrize("sample_by", ["document", "paragraph", "line", "<|endoftext|>"])
def test_a_txt_file_read_in_chunks_becomes_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     sample_by: str) -> None:
    """Tiny chunks and pieces, so documents, separators and blank-line runs straddle every kind of boundary."""
    monkeypatch.setattr(pieces_module, "READ_CHARS", 37)
    monkeypatch.setattr(pieces_module, "PIECE_CHARS", 8)
    monkeypatch.setattr(pieces_module, "MAX_PIECE_CHARS", 16)
    stories = [f"Story {i} begins here.\nIt goes on  for a while, line after line.\n\n  \nAnd ends {i}." * (1 + i % 5)
               for i in range(30)]
    text = "<|endoftext|>".join(stories) + "<|endoftext|>\n\n\n"
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    found, current = [], []
    for piece, ends in mark_ends(text_file_items(path, separator_of(sample_by))):
        assert len(piece) <= 16
        current.append(piece)
        if ends:
            found.append("".join(current))
            current = []
    assert found == reference_documents(text, sample_by)


def test_a_txt_file_that_is_not_utf8_is_one_clear_error(tmp_path: Path) -> None:
    from trainer.config import DataConfig
    from trainer.data.corpus import open_corpus
    from trainer.errors import UserError

    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(UserError, match="not UTF-8 text"):
        list(open_corpus(DataConfig(source=str(tmp_path / "latin1.txt"))).pieces())
