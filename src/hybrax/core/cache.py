"""Config caches: in memory, and on disk shared by every process of a machine.

The persistent cache is one JSON file per op under `$HYBRAX_CACHE_DIR` (default
`~/.cache/hybrax`). A write takes an exclusive lock, re-reads the file, merges its entry and
replaces the file atomically, so concurrent writers never lose each other's entries and readers
never see a half-written file. Nothing touches the disk until the first write.

A cache only ever saves time, so what cannot be used is ignored, with a warning once: a file that cannot
be read (not UTF-8, not JSON, not a JSON object, a directory, the cache directory being a file) reads as
empty, and the next write replaces it. Whether an entry is well formed and its config can run a call is the
executor's to check (`Executor._load`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import tempfile
import warnings
from typing import Any, Iterator

_WARNED: set[str] = set()


def warn_once(message: str) -> None:
    """A RuntimeWarning, the first time this process meets `message`."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


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
        """The file's entries; {} when it does not exist or cannot be used (warned once)."""
        try:
            entries = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            # ValueError: not JSON; RecursionError: JSON nested too deep for the parser.
            warn_once(f"hybrax: ignoring the config cache {path}: {type(exc).__name__}: {exc}")
            return {}
        if not isinstance(entries, dict):
            warn_once(f"hybrax: ignoring the config cache {path}: it holds a JSON {type(entries).__name__}, "
                      f"not an object")
            return {}
        return entries

    def entries(self, op_id: str) -> dict[str, Any]:
        return self._read(self.path(op_id))

    def get(self, op_id: str, key: str) -> Any:
        """The entry stored under `key` as the file holds it (whatever JSON value that is), or None."""
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
        """Store `entry` under `key`, keeping the file's other entries (a file that cannot be read is replaced).
        Raises OSError when the cache directory or file cannot be written."""
        with self._locked(op_id):
            path = self.path(op_id)
            entries = self._read(path)
            entries[key] = entry
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{op_id}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(entries, out, indent=1, sort_keys=True)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
