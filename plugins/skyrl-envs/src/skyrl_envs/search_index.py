"""A local full-text index (SQLite FTS5, BM25 ranking) over a JSONL corpus of passages.

Corpus lines are ``{"id": ..., "title": ..., "text": ...}`` (or upstream's ``{"id", "contents"}``).
The index is built once per corpus content into ``index_dir`` (a file named after the corpus's
hash, written to a temporary name and renamed, so concurrent builders never see half an index)
and then opened read-only. ``shared_index`` hands every environment of a process the same open
index (environments are built afresh for each episode).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

SHIPPED_CORPUS = Path(__file__).with_name("data") / "search" / "corpus.jsonl"


def default_index_dir() -> Path:
    """``$SKYRL_CACHE_DIR/search`` or ``~/.cache/skyrl/search``."""
    root = os.environ.get("SKYRL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "skyrl")
    return Path(root) / "search"


def _passages(corpus_path: Path) -> list[tuple[str, str]]:
    passages = []
    with corpus_path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{corpus_path}: line {number} is not valid JSON: {error}") from None
            text = record.get("text", record.get("contents"))
            if not isinstance(text, str):
                raise ValueError(f"{corpus_path}: line {number} needs a 'text' (or 'contents') string")
            passages.append((str(record.get("title", "")), text))
    if not passages:
        raise ValueError(f"{corpus_path}: the corpus is empty")
    return passages


class SearchIndex:
    """BM25 search over a corpus; ``search(query, k)`` gives up to ``k`` ``(title, text)`` pairs."""

    def __init__(self, corpus_path: str | Path = SHIPPED_CORPUS, index_dir: str | Path | None = None):
        corpus_path = Path(corpus_path)
        if not corpus_path.is_file():
            raise FileNotFoundError(f"search corpus {str(corpus_path)!r} does not exist")
        digest = hashlib.sha256(corpus_path.read_bytes()).hexdigest()[:16]
        index_dir = Path(index_dir) if index_dir else default_index_dir()
        self.path = index_dir / f"{corpus_path.stem}-{digest}.fts5.sqlite"
        if not self.path.is_file():
            self._build(corpus_path, index_dir)
        self._connection = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False)
        self._connection.execute("PRAGMA query_only = ON")
        self._lock = threading.Lock()  # one connection, shared by the environments of all threads

    def _build(self, corpus_path: Path, index_dir: Path) -> None:
        passages = _passages(corpus_path)
        index_dir.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=index_dir, suffix=".partial")
        os.close(handle)
        try:
            connection = sqlite3.connect(partial)
            with connection:
                connection.execute("CREATE VIRTUAL TABLE passages USING fts5(title, text, tokenize='porter unicode61')")
                connection.executemany("INSERT INTO passages (title, text) VALUES (?, ?)", passages)
            connection.close()
            os.replace(partial, self.path)
        finally:
            if os.path.exists(partial):
                os.unlink(partial)

    def search(self, query: str, k: int) -> list[tuple[str, str]]:
        """The ``k`` best passages for the words of ``query`` (any word may match); [] for no words."""
        words = re.findall(r"\w+", query.lower())
        if not words:
            return []
        match = " OR ".join(f'"{word}"' for word in words)  # quoted: no FTS5 syntax from the model
        with self._lock:
            rows = self._connection.execute(
                "SELECT title, text FROM passages WHERE passages MATCH ? ORDER BY bm25(passages) LIMIT ?", (match, k)
            ).fetchall()
        return [(title, text) for title, text in rows]

    def close(self) -> None:
        self._connection.close()


def shared_index(corpus_path: str | Path, index_dir: str | Path | None = None) -> SearchIndex:
    """One ``SearchIndex`` per corpus file version and index directory, for the whole process."""
    corpus_path = Path(corpus_path).resolve()
    stat = corpus_path.stat() if corpus_path.is_file() else None
    return _cached_index(str(corpus_path), stat and (stat.st_mtime_ns, stat.st_size), str(index_dir or ""))


@lru_cache(maxsize=16)
def _cached_index(corpus_path: str, version: tuple[int, int] | None, index_dir: str) -> SearchIndex:
    return SearchIndex(corpus_path, index_dir or None)
