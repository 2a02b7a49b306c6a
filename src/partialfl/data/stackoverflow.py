"""TensorFlow Federated's StackOverflow h5 files as a next-word-prediction federation.

Format (TFF's ``HDF5ClientData``: the files of ``stackoverflow.tar.bz2`` behind
``tff.simulation.datasets.stackoverflow.load_data``, also redistributed by FedML):
``stackoverflow_train.h5``, ``stackoverflow_held_out.h5`` and ``stackoverflow_test.h5``, each
with a top-level group ``examples`` holding one group per client id (a user id string); a
client group holds six 1-D datasets of equal length n (one entry per sentence):

* ``tokens``: the sentence, lower-cased, punctuation split off, tokens joined by ``' '``;
* ``title``: the question's title; ``tags``: its tags joined by ``'|'``;
* ``creation_date``: UTC date-time string; ``type``: ``'question'`` or ``'answer'``;
* ``score``: int64.

Strings are variable-length byte strings (h5py returns ``bytes``). Train holds the examples
before 2018-01-01, test those after, for the same users; held-out holds all examples of other
users (user id % 10 == 0). The optional word-count file ``stackoverflow.word_count``
(``stackoverflow.word_count.tar.bz2``) has lines ``word count`` in decreasing order of count.

The paper's preprocessing (Mishchenko et al. 2023, following Pillutla et al. 2022): keep
clients with ≥ 100 train and ≥ 10 test sentences, draw a fixed subsample of 1000 of them
(seeded), keep at most the first 1000 train sentences of each client (``take(1000)`` in the
reference code), a vocabulary of the 10,000 most frequent words (from the word-count file;
without it, from the train sentences of the selected clients) and sequences of length 20
(:mod:`partialfl.data.text`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.hdf5 import h5py_module, member
from partialfl.data.paths import resolve_data_file
from partialfl.data.shakespeare import TextFederation
from partialfl.data.text import Vocabulary, encode_sequences, next_word_pairs
from partialfl.rng import generator

TRAIN_FILE = "stackoverflow_train.h5"
TEST_FILE = "stackoverflow_test.h5"
HELD_OUT_FILE = "stackoverflow_held_out.h5"
WORD_COUNT_FILE = "stackoverflow.word_count"
EXAMPLES_GROUP = "examples"
#: the datasets of a client group in TFF's files (``tokens`` is the only one this loader needs)
FEATURES = ("creation_date", "score", "tags", "title", "tokens", "type")
TOKENS = "tokens"

#: the paper's filters
PAPER_NUM_CLIENTS = 1000
PAPER_MIN_TRAIN = 100
PAPER_MIN_TEST = 10
PAPER_MAX_TRAIN = 1000
PAPER_VOCAB_SIZE = 10_000


class _H5:
    """An open TFF h5 file with schema checks and clear errors."""

    def __init__(self, path: Path) -> None:
        h5py = h5py_module("TFF StackOverflow")
        self.path = path
        if not path.is_file():
            raise FileNotFoundError(f"StackOverflow file {path} does not exist")
        try:
            self.file = h5py.File(path, "r")
        except OSError as e:
            raise DataFormatError(f"{path} is not a readable HDF5 file (corrupt?): {e}") from e
        if EXAMPLES_GROUP not in self.file or not isinstance(self.file[EXAMPLES_GROUP],
                                                             h5py.Group):
            keys = sorted(self.file.keys())
            self.file.close()
            raise DataFormatError(
                f"{path} has no top-level group {EXAMPLES_GROUP!r} (found {keys}); TFF's "
                f"StackOverflow h5 stores examples/<client_id>/{{{', '.join(FEATURES)}}}"
            )
        try:
            self.group = member(self.file, EXAMPLES_GROUP, path, EXAMPLES_GROUP)
        except DataFormatError:
            self.file.close()
            raise
        self._h5py = h5py

    def __enter__(self) -> _H5:
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    def client_ids(self) -> list[str]:
        return sorted(self.group.keys())

    def _tokens_ds(self, cid: str):
        if cid not in self.group:
            raise KeyError(f"client {cid!r} is not in {self.path}")
        g = member(self.group, cid, self.path, f"{EXAMPLES_GROUP}/{cid}")
        if not isinstance(g, self._h5py.Group):
            raise DataFormatError(f"{self.path}: {EXAMPLES_GROUP}/{cid} must be a group")
        if TOKENS not in g:
            raise DataFormatError(
                f"{self.path}: client {cid!r} has no {TOKENS!r} dataset (found "
                f"{sorted(g.keys())}; expected {list(FEATURES)})"
            )
        ds = member(g, TOKENS, self.path, f"{EXAMPLES_GROUP}/{cid}/{TOKENS}")
        if not isinstance(ds, self._h5py.Dataset) or ds.ndim != 1:
            raise DataFormatError(f"{self.path}: {EXAMPLES_GROUP}/{cid}/{TOKENS} must be a 1-D "
                                  f"dataset of strings")
        if ds.dtype.kind not in ("O", "S", "U"):
            raise DataFormatError(f"{self.path}: {EXAMPLES_GROUP}/{cid}/{TOKENS} must hold "
                                  f"strings, got dtype {ds.dtype}")
        return ds

    def size(self, cid: str) -> int:
        """Number of sentences of client ``cid`` (metadata only)."""
        return int(self._tokens_ds(cid).shape[0])

    def sentences(self, cid: str, limit: int | None = None) -> list[list[str]]:
        """The first ``limit`` sentences of ``cid``, each split into tokens on spaces."""
        ds = self._tokens_ds(cid)
        n = ds.shape[0] if limit is None else min(limit, ds.shape[0])
        try:
            raw = ds[:n]
        except OSError as e:
            raise DataFormatError(f"{self.path}: cannot read client {cid!r} (corrupt?): {e}"
                                  ) from e
        out = []
        for s in raw:
            if isinstance(s, bytes | np.bytes_):
                try:
                    s = s.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataFormatError(f"{self.path}: client {cid!r} has tokens that are "
                                          f"not UTF-8: {e}") from e
            elif not isinstance(s, str):
                raise DataFormatError(f"{self.path}: client {cid!r} tokens must be strings, "
                                      f"got {type(s).__name__}")
            out.append(s.split())
        return out


def load_word_counts(path: str | Path) -> dict[str, int]:
    """TFF's ``stackoverflow.word_count``: lines ``word count``, kept in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"word-count file {path} does not exist")
    counts: dict[str, int] = {}
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2 or not (parts[1].isascii() and parts[1].isdigit()):
                raise DataFormatError(f"{path}:{i}: expected 'word count', got {line.strip()!r}")
            counts[parts[0]] = int(parts[1])
    if not counts:
        raise DataFormatError(f"{path} holds no word counts")
    return counts


def select_clients(
    train_sizes: dict[str, int], test_sizes: dict[str, int], *, min_train: int, min_test: int,
    num_clients: int | None, seed: int,
) -> list[str]:
    """Clients with ≥ ``min_train`` train and ≥ ``min_test`` test sentences, then (if there are
    more than ``num_clients``) a uniform subsample of ``num_clients`` of them drawn with
    ``generator(seed, "stackoverflow-clients")`` from the sorted eligible ids; sorted."""
    eligible = sorted(c for c, n in train_sizes.items()
                      if n >= min_train and test_sizes.get(c, 0) >= min_test)
    if not eligible:
        raise ValueError(f"no client has >= {min_train} train and >= {min_test} test sentences")
    if num_clients is not None and len(eligible) > num_clients:
        idx = generator(seed, "stackoverflow-clients").choice(len(eligible), num_clients,
                                                             replace=False)
        eligible = [eligible[i] for i in np.sort(idx)]
    return eligible


def load_stackoverflow(
    data_dir: str | Path | None = None,
    *,
    num_clients: int | None = PAPER_NUM_CLIENTS,
    min_train: int = PAPER_MIN_TRAIN,
    min_test: int = PAPER_MIN_TEST,
    max_train: int | None = PAPER_MAX_TRAIN,
    max_test: int | None = None,
    vocab_size: int | None = PAPER_VOCAB_SIZE,
    seq_len: int = 20,
    seed: int = 0,
    clients: Sequence[str] | None = None,
    word_counts: str | Path | None = None,
    train_path: str | Path | None = None,
    test_path: str | Path | None = None,
    vocab: Vocabulary | None = None,
) -> TextFederation:
    """Load StackOverflow next-word prediction with the paper's filters (module docstring).

    Args:
        data_dir: folder with ``stackoverflow_train.h5`` / ``stackoverflow_test.h5`` (and
            optionally ``stackoverflow.word_count``); resolved by
            :func:`partialfl.data.paths.resolve_data_file`.
        num_clients: size of the seeded client subsample (None: all eligible clients).
        min_train, min_test: eligibility thresholds (sentences in train / test).
        max_train, max_test: keep at most the first this-many sentences per client.
        vocab_size: number of most frequent words; ``seq_len``: sequence length T.
        seed: seed of the client subsample.
        clients: explicit client ids (skips the eligibility filter and the subsample).
        word_counts: path of the word-count file; default: ``stackoverflow.word_count`` next
            to the train file if present, else counts over the selected clients' train data.
        train_path, test_path: explicit file paths (override ``data_dir``).
        vocab: a ready vocabulary (e.g. of another federation) instead of building one.
    Raises:
        DataNotFoundError / FileNotFoundError for a missing file, DataFormatError for a
        corrupt file or a wrong schema, KeyError for an unknown explicit client id.
    """
    if num_clients is not None and num_clients < 1:
        raise ValueError(f"num_clients must be >= 1 or None, got {num_clients}")
    for name, cap in (("max_train", max_train), ("max_test", max_test)):
        if cap is not None and cap < 1:  # a negative cap would slice from the end
            raise ValueError(f"{name} must be >= 1 or None, got {cap}")
    tr_path = Path(train_path) if train_path else resolve_data_file(TRAIN_FILE, data_dir)
    te_path = Path(test_path) if test_path else resolve_data_file(TEST_FILE, data_dir)
    with _H5(tr_path) as tr, _H5(te_path) as te:
        if clients is not None:
            ids = [str(c) for c in clients]
            for c in ids:
                tr.size(c)  # KeyError / DataFormatError for unknown or malformed clients
        else:
            te_ids = set(te.group.keys())
            train_sizes = {c: tr.size(c) for c in tr.client_ids()}
            test_sizes = {c: te.size(c) for c in train_sizes
                          if c in te_ids and train_sizes[c] >= min_train}
            ids = select_clients(train_sizes, test_sizes, min_train=min_train,
                                 min_test=min_test, num_clients=num_clients, seed=seed)
        train = {c: tr.sentences(c, max_train) for c in ids}
        te_ids = set(te.group.keys())
        test = {c: te.sentences(c, max_test) if c in te_ids else [] for c in ids}

    source = "given"
    if vocab is None:
        if word_counts is not None:
            wc_path: Path | None = Path(word_counts)
        else:  # the word-count file sits next to the h5 files, if it was downloaded
            wc_path = tr_path.parent / WORD_COUNT_FILE
            wc_path = wc_path if wc_path.is_file() else None
        if wc_path is not None:
            counts = load_word_counts(wc_path)
            # TFF: the first vocab_size keys of the (count-ordered) file
            words = list(counts)[:vocab_size] if vocab_size is not None else list(counts)
            vocab = Vocabulary(tuple(words))
            source = str(wc_path)
        else:
            vocab = Vocabulary.build((s for c in ids for s in train[c]), size=vocab_size)
            source = "train sentences of the selected clients"
    return _to_federation(ids, train, test, vocab, seq_len, {
        "clients": len(ids), "min_train": min_train, "min_test": min_test,
        "max_train": max_train, "max_test": max_test, "num_clients": num_clients,
        "seed": seed, "vocab_source": source,
    }, f"StackOverflow (TFF h5) from {tr_path.parent}")


def load_stackoverflow_held_out(
    vocab: Vocabulary,
    data_dir: str | Path | None = None,
    *,
    num_clients: int | None = 100,
    min_train: int = PAPER_MIN_TRAIN,
    min_test: int = PAPER_MIN_TEST,
    max_train: int | None = PAPER_MAX_TRAIN,
    seq_len: int = 20,
    seed: int = 0,
    split_date: str = "2018-01-01",
    path: str | Path | None = None,
) -> TextFederation:
    """Held-out users (never in train/test) as *new* clients, e.g. for ``evaluate``.

    Each user's sentences are split like the main files: ``creation_date < split_date`` →
    train, the rest → test; then the same filters as :func:`load_stackoverflow`, encoded with
    the given ``vocab`` (that of the training federation).
    """
    p = Path(path) if path else resolve_data_file(HELD_OUT_FILE, data_dir)
    with _H5(p) as h:
        cand = {}
        for c in h.client_ids():
            n = h.size(c)
            if n < min_train + min_test:
                continue
            g = member(h.group, c, p, f"{EXAMPLES_GROUP}/{c}")
            if "creation_date" not in g:
                raise DataFormatError(f"{p}: client {c!r} has no 'creation_date' dataset, "
                                      f"needed to split held-out users into train and test")
            raw = member(g, "creation_date", p, f"{EXAMPLES_GROUP}/{c}/creation_date")[()]
            dates = [d.decode() if isinstance(d, bytes | np.bytes_) else str(d) for d in raw]
            if len(dates) != n:
                raise DataFormatError(f"{p}: client {c!r} has {n} tokens but {len(dates)} "
                                      f"creation dates")
            is_train = np.array([d < split_date for d in dates])
            cand[c] = is_train
        ids = select_clients({c: int(v.sum()) for c, v in cand.items()},
                             {c: int((~v).sum()) for c, v in cand.items()},
                             min_train=min_train, min_test=min_test,
                             num_clients=num_clients, seed=seed)
        train, test = {}, {}
        for c in ids:
            sents = h.sentences(c)
            tr = [s for s, keep in zip(sents, cand[c]) if keep]
            train[c] = tr[:max_train] if max_train is not None else tr
            test[c] = [s for s, keep in zip(sents, cand[c]) if not keep]
    return _to_federation(ids, train, test, vocab, seq_len, {
        "clients": len(ids), "split_date": split_date, "min_train": min_train,
        "min_test": min_test, "max_train": max_train, "seed": seed, "vocab_source": "given",
    }, f"StackOverflow held-out users (TFF h5) from {p.parent}")


def _to_federation(ids, train, test, vocab, seq_len, stats, desc) -> TextFederation:
    arrays = {"train": ([], []), "test": ([], [])}
    counts = {"train": Counter(), "test": Counter()}
    for split, data in (("train", train), ("test", test)):
        for c in ids:
            sents = data[c]
            for s in sents:
                counts[split].update(s[:seq_len])
            if sents:
                x, y = next_word_pairs(encode_sequences(sents, vocab, seq_len))
            else:
                x = y = np.zeros((0, seq_len), np.int64)
            arrays[split][0].append(torch.from_numpy(x))
            arrays[split][1].append(torch.from_numpy(y))
    stats = {**stats, "seq_len": seq_len, "vocab_words": vocab.num_words,
             "vocab_ids": len(vocab),
             "train_sequences": int(sum(len(x) for x in arrays["train"][0])),
             "test_sequences": int(sum(len(x) for x in arrays["test"][0])),
             "train_coverage": vocab.coverage(counts["train"]),
             "test_coverage": vocab.coverage(counts["test"])}
    ds = FederatedDataset(arrays["train"][0], arrays["train"][1], arrays["test"][0],
                          arrays["test"][1], tuple(ids), num_classes=len(vocab),
                          description=f"{desc}: {len(ids)} clients, {vocab.num_words} words")
    return TextFederation(ds, vocab, seq_len, stats)
