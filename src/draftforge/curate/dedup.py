"""Exact and near-duplicate removal over prompt text.

Exact: sha1 of the normalized text (lowercase, word characters only) → 8-byte key in a set.
Near: MinHash (datasketch, shared permutations) over word shingles, LSH at `threshold` Jaccard.
Memory is O(kept rows): only rows that are kept are inserted; `seen()` queries without inserting.
"""

from __future__ import annotations

import hashlib
import re

from datasketch import MinHash, MinHashLSH

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    """Normalized word sequence: case, punctuation and whitespace differences vanish."""
    return _WORD.findall(text.lower())


def text_key(text: str) -> bytes:
    return hashlib.sha1(" ".join(words(text)).encode()).digest()[:8]


def shingles(ws: list[str], n: int) -> list[bytes]:
    """Word n-grams as bytes; a text shorter than n words is one shingle (its whole text)."""
    if len(ws) < n:
        return [" ".join(ws).encode()]
    return [" ".join(ws[i : i + n]).encode() for i in range(len(ws) - n + 1)]


class MinHasher:
    """MinHash signatures with one set of permutations (datasketch regenerates them per instance)."""

    def __init__(self, num_perm: int, seed: int = 1) -> None:
        self.num_perm = num_perm
        self.seed = seed
        proto = MinHash(num_perm=num_perm, seed=seed)
        self._perms, self._scheme = proto.permutations, proto.scheme

    def __call__(self, items: list[bytes]) -> MinHash:
        m = MinHash(num_perm=self.num_perm, seed=self.seed, permutations=self._perms, scheme=self._scheme)
        m.update_batch(items)
        return m


class Deduper:
    """Stateful exact + near-duplicate index over kept prompts."""

    def __init__(self, *, exact: bool, near: bool, threshold: float, num_perm: int, shingle: int) -> None:
        self.exact, self.near, self.shingle = exact, near, shingle
        self._keys: set[bytes] = set()
        self._hasher = MinHasher(num_perm) if near else None
        self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm) if near else None
        self._n = 0

    def check(self, text: str) -> tuple[str | None, object]:
        """(drop reason or None, state to pass to `add` if the row is kept)."""
        ws = words(text)
        key = hashlib.sha1(" ".join(ws).encode()).digest()[:8]
        if self.exact and key in self._keys:
            return "duplicate_exact", None
        sig = None
        if self.near:
            sig = self._hasher(shingles(ws, self.shingle))
            if self._lsh.query(sig):
                return "duplicate_near", None
        return None, (key, sig)

    def add(self, state: object) -> None:
        key, sig = state  # type: ignore[misc]
        if self.exact:
            self._keys.add(key)
        if self.near and sig is not None:
            self._lsh.insert(self._n, sig, check_duplication=False)
        self._n += 1

