"""Config caches: in memory, and on disk shared by every process of a machine.

The persistent cache is one JSON file per op under `$HYBRAX_CACHE_DIR` (default
`~/.cache/hybrax`). A write takes an exclusive lock, re-reads the file, merges its entry and
replaces the file atomically, so concurrent writers never lose each other's entries and readers
never see a half-written file. Nothing touches the disk until the first write.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import tempfile
from typing import Any, Iterator


def default_cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HYBRAX_CACHE_DIR") or pathlib.Path.home() / ".cache" / "hybrax")


class MemoryCache:
    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], dict[str, Any]] = {}

    def get(self, op_id: str, key: str) -> dict[str, Any] | None:
        return self._entries.get((op_id, key))

    def put(self, op_id: str, key: str, entry: dict[str, Any]) -> None:
        self._entries[(op_id, key)] = entry

    def clear(self) -> None:
        self._entries.clear()


class PersistentCache:
    """Entries are dicts: {"cfg": {...}, "signature": "...", "time_s": ...}."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self._directory = pathlib.Path(directory) if directory is not None else None

    @property
    def directory(self) -> pathlib.Path:
        # Resolved lazily so that HYBRAX_CACHE_DIR set after import is honoured.
        return self._directory if self._directory is not None else default_cache_dir()

    def path(self, op_id: str) -> pathlib.Path:
        return self.directory / f"{op_id}.json"

    def _read(self, path: pathlib.Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError:
            # A corrupt file (e.g. written by an older, non-atomic tool) is ignored, not fatal.
            return {}

    def entries(self, op_id: str) -> dict[str, Any]:
        return self._read(self.path(op_id))

    def get(self, op_id: str, key: str) -> dict[str, Any] | None:
        return self.entries(op_id).get(key)

    @contextlib.contextmanager
    def _locked(self, op_id: str) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / f".{op_id}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def put(self, op_id: str, key: str, entry: dict[str, Any]) -> None:
        with self._locked(op_id):
            path = self.path(op_id)
            entries = self._read(path)
            entries[key] = entry
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{op_id}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump(entries, out, indent=1, sort_keys=True)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
