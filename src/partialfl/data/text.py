"""Word-level text for next-word prediction: tokenisation, vocabulary, fixed-length sequences.

The preprocessing follows TFF's StackOverflow word-prediction task (used by the paper's
transformer experiment, via Pillutla et al. 2022): a sentence of words w_1..w_n becomes

    [BOS, id(w_1), ..., id(w_n), EOS, PAD, ..., PAD]        (length seq_len + 1)

where the words are first truncated to ``seq_len`` and EOS is appended only when there is room
(n < seq_len). The next-word pairs are ``x = s[:-1]`` and ``y = s[1:]`` (both ``[seq_len]``),
so position t of the model sees tokens ≤ t and predicts token t+1.

Special ids are fixed and do not depend on the vocabulary size: ``PAD = 0``, ``OOV = 1``,
``BOS = 2``, ``EOS = 3``; the regular words get ids ``4, 5, ...`` in decreasing order of frequency.
(TFF puts OOV/BOS/EOS after the words, ``V+1, V+2, V+3``; this is a relabelling and changes
nothing in the model or the metric, which masks the same four tokens.)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

PAD, OOV, BOS, EOS = 0, 1, 2, 3
SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<oov>", "<bos>", "<eos>")
NUM_SPECIAL = len(SPECIAL_TOKENS)
#: ids the next-word metric ignores (pad, out-of-vocabulary, beginning, end)
SPECIAL_IDS: tuple[int, ...] = (PAD, OOV, BOS, EOS)

# A word: letters/digits, with inner apostrophes or hyphens ("we'll", "serving-man");
# any other non-space character is a token of its own (punctuation), as in TFF's
# StackOverflow preprocessing ("separate punctuation as individual tokens, except apostrophes
# and hyphens" inside words).
_TOKEN_RE = re.compile(r"[a-z0-9]+(?:['\-][a-z0-9]+)*|[^\sa-z0-9]")


def tokenize(text: str) -> list[str]:
    """Lower-case ``text`` and split it into words and single punctuation characters.

    >>> tokenize("What, Marcius! we'll go--now.")
    ['what', ',', 'marcius', '!', "we'll", 'go', '-', '-', 'now', '.']
    """
    return _TOKEN_RE.findall(text.lower())


@dataclass(frozen=True)
class Vocabulary:
    """The special tokens plus a list of regular words; ``len(vocab)`` is the model's output size.

    Attributes:
        words: the regular words, most frequent first; word ``words[i]`` has id
            ``NUM_SPECIAL + i``.
    """

    words: tuple[str, ...]
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        words = tuple(self.words)
        object.__setattr__(self, "words", words)
        bad = [w for w in words if not isinstance(w, str) or not w or w in SPECIAL_TOKENS]
        if bad:
            raise ValueError(f"vocabulary words must be non-empty strings other than the special "
                             f"tokens {SPECIAL_TOKENS}; got {bad[:5]}")
        index = {w: NUM_SPECIAL + i for i, w in enumerate(words)}
        if len(index) != len(words):
            dup = sorted({w for w in words if words.count(w) > 1})
            raise ValueError(f"vocabulary words must be unique; duplicated: {dup[:5]}")
        object.__setattr__(self, "_index", index)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_counts(
        cls, counts: Mapping[str, int], size: int | None = None, min_count: int = 1
    ) -> Vocabulary:
        """The ``size`` most frequent words with count ≥ ``min_count`` (all of them if size is
        None). Ties are broken alphabetically, so the result does not depend on input order."""
        if size is not None and (not isinstance(size, int | np.integer) or size < 1):
            raise ValueError(f"vocabulary size must be a positive integer or None, got {size!r}")
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        ranked = sorted(((w, int(c)) for w, c in counts.items() if int(c) >= min_count
                         and w not in SPECIAL_TOKENS), key=lambda wc: (-wc[1], wc[0]))
        if size is not None:
            ranked = ranked[: int(size)]
        return cls(tuple(w for w, _ in ranked))

    @classmethod
    def build(
        cls, sentences: Iterable[Sequence[str]], size: int | None = None, min_count: int = 1
    ) -> Vocabulary:
        """Count the words of tokenised ``sentences`` and keep the most frequent (see
        :meth:`from_counts`)."""
        counts: Counter[str] = Counter()
        for s in sentences:
            counts.update(s)
        return cls.from_counts(counts, size=size, min_count=min_count)

    # ------------------------------------------------------------------ lookup
    def __len__(self) -> int:
        """Total number of ids (special tokens + words): the model's vocabulary size."""
        return NUM_SPECIAL + len(self.words)

    @property
    def num_words(self) -> int:
        """Number of regular (non-special) words."""
        return len(self.words)

    def id_of(self, word: str) -> int:
        """The id of ``word`` (``OOV`` if it is not in the vocabulary)."""
        return self._index.get(word, OOV)

    def word_of(self, i: int) -> str:
        """The word (or special token) with id ``i``."""
        i = int(i)
        if not 0 <= i < len(self):
            raise IndexError(f"token id {i} outside 0..{len(self) - 1}")
        return SPECIAL_TOKENS[i] if i < NUM_SPECIAL else self.words[i - NUM_SPECIAL]

    def encode(self, words: Sequence[str]) -> list[int]:
        """Word ids (OOV for unknown words), no special tokens added."""
        return [self._index.get(w, OOV) for w in words]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """The words / special tokens of ``ids``."""
        return [self.word_of(i) for i in ids]

    def coverage(self, counts: Mapping[str, int]) -> float:
        """Fraction of the word occurrences in ``counts`` that are in the vocabulary."""
        total = sum(counts.values())
        return sum(c for w, c in counts.items() if w in self._index) / total if total else 0.0


def encode_sequence(words: Sequence[str], vocab: Vocabulary, seq_len: int = 20) -> np.ndarray:
    """One sentence → int64 ``[seq_len + 1]``: BOS, the first ``seq_len`` word ids, EOS if it
    fits, then PAD (TFF's ``to_ids`` followed by padding)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    ids = vocab.encode(words[:seq_len])
    if len(ids) < seq_len:
        ids.append(EOS)
    out = np.full(seq_len + 1, PAD, dtype=np.int64)
    out[0] = BOS
    out[1: 1 + len(ids)] = ids
    return out


def encode_sequences(
    sentences: Sequence[Sequence[str]], vocab: Vocabulary, seq_len: int = 20
) -> np.ndarray:
    """Many sentences → int64 ``[n, seq_len + 1]`` (see :func:`encode_sequence`)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out = np.empty((len(sentences), seq_len + 1), dtype=np.int64)
    for i, s in enumerate(sentences):
        out[i] = encode_sequence(s, vocab, seq_len)
    return out


def next_word_pairs(sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y) = (s[:, :-1], s[:, 1:])``: inputs and next-word targets, each ``[n, seq_len]``."""
    s = np.asarray(sequences)
    if s.ndim != 2 or s.shape[1] < 2:
        raise ValueError(f"sequences must have shape [n, seq_len + 1] with seq_len >= 1, "
                         f"got {s.shape}")
    return np.ascontiguousarray(s[:, :-1]), np.ascontiguousarray(s[:, 1:])
