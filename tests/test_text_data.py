"""Tokenisation, vocabulary, sequences and the Shakespeare-by-role loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from partialfl.data.federated import DataFormatError
from partialfl.data.paths import DataNotFoundError, default_data_dir
from partialfl.data.shakespeare import (
    FILE_NAME,
    ShakespeareFormatError,
    load_shakespeare,
    parse_roles,
)
from partialfl.data.text import (
    BOS,
    EOS,
    NUM_SPECIAL,
    OOV,
    PAD,
    SPECIAL_TOKENS,
    Vocabulary,
    encode_sequence,
    encode_sequences,
    next_word_pairs,
    tokenize,
)


# ---------------------------------------------------------------------------- tokenisation
def test_tokenize_words_punctuation_apostrophes_hyphens():
    assert tokenize("What, Marcius! We'll go--now.") == [
        "what", ",", "marcius", "!", "we'll", "go", "-", "-", "now", "."]
    assert tokenize("  The serving-man's O' day?\t") == [
        "the", "serving-man's", "o", "'", "day", "?"]
    assert tokenize("") == [] and tokenize("   \n ") == []


# ---------------------------------------------------------------------------- vocabulary
def test_special_ids_are_fixed():
    assert (PAD, OOV, BOS, EOS) == (0, 1, 2, 3) and NUM_SPECIAL == 4
    for v in (Vocabulary(()), Vocabulary(("a",)), Vocabulary(tuple(f"w{i}" for i in range(50)))):
        assert v.decode([0, 1, 2, 3]) == list(SPECIAL_TOKENS)
        assert len(v) == NUM_SPECIAL + v.num_words


def test_vocabulary_most_frequent_ties_and_cap():
    counts = {"the": 5, "a": 3, "b": 3, "zz": 1, "c": 2}
    v = Vocabulary.from_counts(counts)
    assert v.words == ("the", "a", "b", "c", "zz")           # by count, ties alphabetical
    assert v.id_of("the") == 4 and v.id_of("zz") == 8 and v.id_of("nope") == OOV
    assert Vocabulary.from_counts(counts, size=2).words == ("the", "a")
    assert Vocabulary.from_counts(counts, min_count=2).words == ("the", "a", "b", "c")
    # insertion order does not matter
    assert Vocabulary.from_counts(dict(reversed(list(counts.items())))).words == v.words
    # a brute-force reference: sort all words by (-count, word)
    rng = np.random.default_rng(0)
    rand = {f"w{i}": int(c) for i, c in enumerate(rng.integers(1, 6, size=40))}
    ref = sorted(rand, key=lambda w: (-rand[w], w))[:17]
    assert list(Vocabulary.from_counts(rand, size=17).words) == ref


def test_vocabulary_build_encode_decode_coverage():
    v = Vocabulary.build([["a", "b", "a"], ["c", "a"]], size=2)
    assert v.words == ("a", "b")
    assert v.encode(["a", "c", "b"]) == [4, OOV, 5]
    assert v.decode([4, 1, 5, 2]) == ["a", "<oov>", "b", "<bos>"]
    assert v.coverage({"a": 3, "b": 1, "c": 1}) == pytest.approx(0.8)
    with pytest.raises(IndexError, match="outside"):
        v.word_of(6)


def test_vocabulary_errors():
    with pytest.raises(ValueError, match="unique"):
        Vocabulary(("a", "a"))
    with pytest.raises(ValueError, match="special"):
        Vocabulary(("<pad>",))
    with pytest.raises(ValueError, match="positive integer"):
        Vocabulary.from_counts({"a": 1}, size=0)


# ---------------------------------------------------------------------------- sequences
def test_encode_sequence_padding_truncation_specials():
    v = Vocabulary(("a", "b", "c"))
    s = encode_sequence(["a", "x", "c"], v, seq_len=6)
    assert s.tolist() == [BOS, 4, OOV, 6, EOS, PAD, PAD]
    # exactly seq_len words: no room for EOS (TFF's rule)
    assert encode_sequence(["a", "b", "c"], v, seq_len=3).tolist() == [BOS, 4, 5, 6]
    # longer: truncated to seq_len words, no EOS
    assert encode_sequence(["a", "b", "c", "a", "b"], v, seq_len=3).tolist() == [BOS, 4, 5, 6]
    # empty sentence: BOS EOS pad...
    assert encode_sequence([], v, seq_len=3).tolist() == [BOS, EOS, PAD, PAD]
    arr = encode_sequences([["a"], ["b", "c"]], v, seq_len=20)
    assert arr.shape == (2, 21) and arr.dtype == np.int64
    with pytest.raises(ValueError, match="seq_len"):
        encode_sequence(["a"], v, seq_len=0)


def test_next_word_pairs_shift_by_one():
    v = Vocabulary(("a", "b", "c"))
    s = encode_sequences([["a", "b"], ["c"]], v, seq_len=4)
    x, y = next_word_pairs(s)
    assert x.shape == y.shape == (2, 4)
    assert x.tolist() == [[BOS, 4, 5, EOS], [BOS, 6, EOS, PAD]]
    assert y.tolist() == [[4, 5, EOS, PAD], [6, EOS, PAD, PAD]]
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="shape"):
        next_word_pairs(np.zeros(5, np.int64))


# ---------------------------------------------------------------------------- parser
_SAMPLE = """ALICE:
Hello there, Bob.
How are you?

BOB:
Fine.


ALICE:

BOB:
Good-bye, Alice!
"""


def test_parse_roles_blocks_empty_speeches_and_triple_newlines():
    roles = parse_roles(_SAMPLE)
    assert list(roles) == ["ALICE", "BOB"]
    assert roles["ALICE"] == [["hello", "there", ",", "bob", "."], ["how", "are", "you", "?"]]
    assert roles["BOB"] == [["fine", "."], ["good-bye", ",", "alice", "!"]]


def test_parse_roles_errors():
    with pytest.raises(ShakespeareFormatError, match="ROLE:"):
        parse_roles("ALICE:\nhi\n\nthis block has no role\nline\n")
    with pytest.raises(DataFormatError, match="empty"):
        parse_roles("\n\n")


def _write_corpus(tmp_path, n_roles=6, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(30)]
    blocks, sizes = [], {}
    for r in range(n_roles):
        n = 10 * (r + 1)                  # role r has 10(r+1) lines
        sizes[f"ROLE{r}"] = n
        lines = [" ".join(rng.choice(words, size=rng.integers(1, 8))) for _ in range(n)]
        for i in range(0, n, 3):          # speeches of up to 3 lines
            blocks.append(f"ROLE{r}:\n" + "\n".join(lines[i:i + 3]))
    rng.shuffle(blocks)
    p = tmp_path / FILE_NAME
    p.write_text("\n\n".join(blocks) + "\n")
    return p, sizes


def test_load_shakespeare_split_filter_and_vocab(tmp_path):
    p, sizes = _write_corpus(tmp_path)
    tf = load_shakespeare(path=p, seq_len=8, min_train=20, min_test=6, test_fraction=0.25,
                          min_count=1, seed=3)
    ds = tf.dataset
    # role r: n = 10(r+1), test = round(n / 4): kept iff n - round(n/4) >= 20 and round(n/4) >= 6
    expect = sorted(r for r, n in sizes.items()
                    if n - int(round(n / 4)) >= 20 and int(round(n / 4)) >= 6)
    assert list(ds.client_ids) == expect == ["ROLE2", "ROLE3", "ROLE4", "ROLE5"]
    for m, r in enumerate(ds.client_ids):
        n = sizes[r]
        assert ds.test_sizes()[m] == int(round(n / 4))
        assert ds.train_sizes()[m] == n - int(round(n / 4))
    assert ds.train_x[0].shape[1] == 8 and ds.train_x[0].dtype == torch.int64
    assert ds.num_classes == len(tf.vocab)
    # train and test lines of a role are disjoint and together are all of its lines
    roles = parse_roles(p.read_text())
    v = tf.vocab
    for m, r in enumerate(ds.client_ids):
        got = [tuple(v.decode([t for t in row.tolist() if t >= NUM_SPECIAL]))
               for row in torch.cat([ds.train_x[m], ds.test_x[m]])]
        assert sorted(got) == sorted(tuple(s) for s in roles[r])
    # vocabulary built from train lines only: every train word is in it (min_count=1)
    train_words = {w for m in range(ds.num_clients) for row in ds.train_x[m].tolist()
                   for w in row if w >= NUM_SPECIAL}
    assert len(train_words) == v.num_words
    # seeds: same seed same split, other seed another split
    same = load_shakespeare(path=p, seq_len=8, min_train=20, min_test=6, test_fraction=0.25,
                            min_count=1, seed=3).dataset
    other = load_shakespeare(path=p, seq_len=8, min_train=20, min_test=6, test_fraction=0.25,
                             min_count=1, seed=4).dataset
    assert all(torch.equal(a, b) for a, b in zip(ds.test_x, same.test_x))
    assert not all(torch.equal(a, b) for a, b in zip(ds.test_y, other.test_y))


def test_load_shakespeare_caps_and_errors(tmp_path):
    p, _ = _write_corpus(tmp_path)
    tf = load_shakespeare(path=p, min_train=10, min_test=2, max_train=12, max_clients=3,
                          vocab_size=5)
    assert tf.dataset.num_clients == 3
    assert tf.dataset.client_ids == ("ROLE3", "ROLE4", "ROLE5")   # the 3 largest
    assert tf.dataset.train_sizes().max() == 12
    assert tf.vocab.num_words == 5 and tf.dataset.num_classes == 9
    assert int(torch.cat(tf.dataset.train_y).max()) < 9
    with pytest.raises(ValueError, match="no role"):
        load_shakespeare(path=p, min_train=1000)
    with pytest.raises(ValueError, match="test_fraction"):
        load_shakespeare(path=p, test_fraction=1.0)
    with pytest.raises(DataNotFoundError):
        load_shakespeare(data_dir=tmp_path / "nowhere")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ROLE:\n\xff\xfe\n")
    with pytest.raises(DataFormatError, match="UTF-8"):
        load_shakespeare(path=bad)


# ---------------------------------------------------------------------------- real file
def _real_dir():
    d = default_data_dir()
    if d is None or not (d / FILE_NAME).exists():
        pytest.skip(f"{FILE_NAME} not found (set PARTIALFL_DATA_DIR to ../shared/data)")
    return d


@pytest.mark.data
def test_real_shakespeare_documented_numbers():
    tf = load_shakespeare(_real_dir())
    s = tf.stats
    # the numbers documented in partialfl.data.shakespeare
    assert s["roles_in_file"] == 283 and s["lines_in_file"] == 21885
    assert s["clients"] == 64
    assert (s["train_sequences"], s["test_sequences"]) == (14234, 3558)
    assert s["words_supported"] == s["vocab_words"] == 4910 and len(tf.vocab) == 4914
    assert s["train_coverage"] == pytest.approx(0.963, abs=5e-4)
    assert s["test_coverage"] == pytest.approx(0.941, abs=5e-4)
    ds = tf.dataset
    assert ds.train_sizes().min() >= 64 and ds.test_sizes().min() >= 16
    assert ds.train_x[0].shape[1] == 20
    # targets are the inputs shifted by one
    for m in range(ds.num_clients):
        assert torch.equal(ds.train_x[m][:, 1:], ds.train_y[m][:, :-1])
        assert bool((ds.train_x[m][:, 0] == BOS).all())
