"""The server's state file (``--response-store``): one SQLite file, one process at a
time, holding what must outlive a restart: stored responses and conversations
(``server.response_store``), uploaded and result files and batches with the lines
they have answered (``server.batches``).

The file is written through (each caller's writes in one transaction, in WAL mode
without a sync per write: a power cut may lose the last writes, a process exit
loses nothing). A write that fails (a full disk) is logged and the server goes on
in memory. One process per file: a second one opening it is refused (an exclusive
lock beside it); replicas each keep their own (``server.build``). The folder and
file are the server user's only (0700 and 0600): they hold every API key's data.
A local file system only (SQLite's WAL needs shared memory, which network file
systems do not give). A file of version 1 (responses only) gains the other tables
when opened, and one of version 2 its files' ``expires_at``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
from pathlib import Path
from typing import Iterator

log = logging.getLogger("jaxserve.server")

SCHEMA_VERSION = 3   # ``PRAGMA user_version``; 1: the ``responses`` table alone; 2: files without ``expires_at``
TABLES = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, owner TEXT NOT NULL, used INTEGER NOT NULL, "
    "entry TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, "
    "purpose TEXT NOT NULL, created_at INTEGER NOT NULL, data BLOB NOT NULL, expires_at INTEGER)",
    "CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, job TEXT NOT NULL)",
    # a running batch's answered lines, in the order they ended (``bad``: for its error file)
    "CREATE TABLE IF NOT EXISTS batch_lines (batch_id TEXT NOT NULL, bad INTEGER NOT NULL, line BLOB NOT NULL)",
)


class StateFile:
    """The open, locked state file at ``path`` (created if missing); a ``ValueError``
    naming it when it is in use, not a state file of a known version, or unreadable."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self._db: sqlite3.Connection | None = None
        self._lock: int | None = None   # the descriptor holding the file's lock
        self._depth = 0                 # open ``transaction`` blocks
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        path = self.path
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ValueError(f"response store {path}: in use by another process") from None
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))   # (SQLite gives its WAL files the same mode)
            self._db = db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            version = db.execute("PRAGMA user_version").fetchone()[0]
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if tables and (version not in (1, 2, SCHEMA_VERSION) or "responses" not in tables):
                raise ValueError(f"response store {path}: not a jaxserve response store of version "
                                 f"{SCHEMA_VERSION}, 2 or 1 (user_version {version}, tables {sorted(tables)})")
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
            for table in TABLES:
                db.execute(table)
            if "expires_at" not in {row[1] for row in db.execute("PRAGMA table_info(files)")}:   # (version 2)
                db.execute("ALTER TABLE files ADD COLUMN expires_at INTEGER")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as e:
            raise ValueError(f"response store {path}: unreadable ({type(e).__name__}: {e})") from None

    @property
    def closed(self) -> bool:
        return self._db is None

    def rows(self, sql: str, *params) -> list[tuple]:
        """The rows ``sql`` reads (an unreadable file: a ``ValueError`` naming it)."""
        try:
            return self._db.execute(sql, params).fetchall()
        except sqlite3.Error as e:
            raise ValueError(f"response store {self.path}: unreadable ({type(e).__name__}: {e})") from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """One file transaction for the writes inside (nested blocks join the outer one; a
        closed file's writes are dropped)."""
        if self._depth or self._db is None:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._depth = 1
        try:
            begun = True
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:   # (the writes inside then commit one by one, or fail as logged)
                log.warning("response store: cannot write the file (%s); kept in memory", e)
                begun = False
            yield
        finally:
            self._depth = 0
            if begun:
                try:
                    self._db.execute("COMMIT")
                except sqlite3.Error as e:
                    log.warning("response store: a write to the file failed (%s); kept in memory", e)
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")

    def write(self, sql: str, *params) -> None:
        self.write_many(sql, [params])

    def write_many(self, sql: str, rows: list[tuple]) -> None:
        if not rows or self._db is None:   # (closed: the server is stopping; memory goes on alone)
            return
        try:
            self._db.executemany(sql, rows)
        except sqlite3.Error as e:   # (a full disk): the file falls behind, the server goes on in memory
            log.warning("response store: a write to the file failed (%s); kept in memory", e)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lock is not None:
            os.close(self._lock)   # (releases the lock)
            self._lock = None
