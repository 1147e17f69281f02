"""A JSON-lines metrics log: one JSON object per line, appended and flushed as training runs."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog"]


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan
    return value


class MetricsLog:
    """Appends records ``{"event": ..., "time": ..., **fields}`` to ``path`` (no-op when None).

    A resumed run appends to the same file after a ``{"event": "resume"}`` record, so steps between
    the checkpoint and the interruption appear twice; the later record of a step is the one kept.
    """

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path is not None else None
        self._file = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, event: str, **fields: Any) -> None:
        """Append one record."""
        if self._file is None:
            return
        record = {"event": event, "time": round(time.time(), 3)}
        record.update({k: _plain(v) for k, v in fields.items()})
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
