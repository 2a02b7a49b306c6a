"""Per-round metrics as JSON lines (one object per evaluated round)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlLogger:
    """Appends metric records to ``path`` (created with its parent folders); line-buffered so
    nothing is lost if a run is interrupted."""

    def __init__(self, path: str | Path, append: bool = False, **static: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", buffering=1)  # noqa: SIM115
        self.static = static

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (with the logger's static fields; values made JSON-safe) as a line."""
        rec = {**self.static, **{k: _clean(v) for k, v in record.items()}}
        self._f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def __enter__(self) -> JsonlLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read records back; string "nan"/"inf" become floats. A corrupt line (e.g. the last
    one of an interrupted run: the log is appended line by line) gives a named error."""
    from partialfl.io import FileFormatError

    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise FileFormatError(f"{path}, line {i}: not a JSON record (truncated?): "
                                          f"{e}") from None
                for k, v in rec.items():
                    if v in ("nan", "inf", "-inf"):
                        rec[k] = float(v)
                out.append(rec)
    return out
