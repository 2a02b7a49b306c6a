"""A SuperNode's text on the ServerApp's side: whatever a node sends (its error reason, the
names in a malformed reply) reaches the operator's log and report on one printable line of
bounded length, so that one node can neither forge log lines, rewrite the terminal, nor
flood the log."""

from __future__ import annotations

#: the most characters of one node's text kept in a log line or a report's failure
MAX_REASON = 600


def printable(text: str) -> str:
    """``text`` on one line: every character that is not printable (line breaks, terminal
    escapes, other control or format characters) written as its Python escape."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in str(text))


def bounded(text: str, n: int = MAX_REASON) -> str:
    """:func:`printable` ``text``, at most ``n`` characters: a long one keeps its head and
    its tail (for a remote traceback, the error)."""
    text = printable(text)
    if len(text) <= n:
        return text
    head = min(200, n // 3)
    return f"{text[:head]} ... {text[-(n - head - 5):]}"


def one_line(text: str, n: int = 300) -> str:
    """``text`` with its whitespace runs made one space, cut to ``n`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."
