"""What every reproduction's ``summary.md`` must satisfy to stand alone."""

from __future__ import annotations

import re

SPHINX_ROLE = re.compile(r":(mod|data|func|class|meth|attr|obj|exc):`")


def check_standalone_summary(text: str, quick: bool) -> None:
    """No Sphinx roles shown as raw text, no reference to files outside the repository, and a
    quick run says that it cannot support a verdict (and gives none)."""
    assert not SPHINX_ROLE.search(text), SPHINX_ROLE.search(text).group(0)
    assert "TARGETS.md" not in text and "``" not in text
    if quick:
        assert "**Quick run**" in text and "too small to support a verdict" in text
        assert "does NOT hold" not in text and " holds here" not in text
    else:
        assert "**Quick run**" not in text
