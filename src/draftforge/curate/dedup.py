"""Exact and near-duplicate removal over prompt text (deterministic, numpy-vectorized MinHash + LSH).

Exact: sha1 of the normalized text (lowercase, word characters only) → 8-byte key in a set.
Near: MinHash over word n-gram shingles (n = `shingle`), `num_perm` universal hash functions
h(x) = (a·x + b) mod (2^61 − 1) over 32-bit crc32 shingle hashes; LSH with (bands, rows) chosen to minimize false positives +
false negatives around `threshold` Jaccard (same criterion as datasketch). A row whose band keys hit
any kept row's band key is a near duplicate. Memory is O(kept rows): `check` never inserts; only
`add` does (≈ bands × ~70 bytes per kept row).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from functools import lru_cache

import numpy as np

_WORD = re.compile(r"\w+")
_MERSENNE = np.uint64((1 << 61) - 1)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def words(text: str) -> list[str]:
    """Normalized word sequence: case, punctuation and whitespace differences vanish."""
    return _WORD.findall(text.lower())


def ngram_hashes(ws: list[str], n: int) -> list[int]:
    """crc32 (stable across processes, unlike hash()) of each word n-gram; a shorter text is one n-gram."""
    if len(ws) < n:
        return [zlib.crc32(" ".join(ws).encode())]
    return [zlib.crc32(g.encode()) for g in map(" ".join, zip(*(ws[j:] for j in range(n))))]


@lru_cache(maxsize=8)
def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimizing ∫ false-positive + ∫ false-negative probability around threshold."""
    s = np.linspace(0.0, 1.0, 1001)
    best, best_err = (1, num_perm), float("inf")
    for b in range(1, num_perm + 1):
        for r in range(1, num_perm // b + 1):
            p = 1.0 - (1.0 - s**r) ** b
            err = np.trapezoid(p[s <= threshold], s[s <= threshold]) + np.trapezoid(1 - p[s >= threshold], s[s >= threshold])
            if err < best_err:
                best, best_err = (b, r), err
    return best


class MinHasher:
    def __init__(self, num_perm: int, seed: int = 1) -> None:
        rng = np.random.RandomState(seed)
        self.a = rng.randint(1, 1 << 31, size=(num_perm, 1), dtype=np.int64).astype(np.uint64)  # (P, 1)
        self.b = rng.randint(0, 1 << 31, size=(num_perm, 1), dtype=np.int64).astype(np.uint64)  # (P, 1)

    def __call__(self, shingle_hashes: list[int]) -> np.ndarray:
        """k 32-bit shingle hashes → (P,) uint64 signature."""
        x = np.array(shingle_hashes, dtype=np.uint64)[None, :]  # (1, k) < 2^32: a·x + b < 2^63, no overflow
        return ((self.a * x + self.b) % _MERSENNE).min(axis=1)  # (P,)


class Deduper:
    """Stateful exact + near-duplicate index over kept prompts."""

    def __init__(self, *, exact: bool, near: bool, threshold: float, num_perm: int, shingle: int) -> None:
        self.exact, self.near, self.shingle = exact, near, shingle
        self._keys: set[bytes] = set()
        self._bands: set[int] = set()
        self._hasher = MinHasher(num_perm)
        self.bands, self.rows = lsh_params(threshold, num_perm)
        mult = np.uint64(0x100000001B3) ** np.arange(self.rows, dtype=np.uint64)  # (r,) wraps mod 2^64
        self._band_mult = mult
        self._band_salt = np.arange(self.bands, dtype=np.uint64) * _MIX  # (b,)

    def _band_keys(self, sig: np.ndarray) -> list[int]:
        grid = sig[: self.bands * self.rows].reshape(self.bands, self.rows)  # (b, r)
        with np.errstate(over="ignore"):
            keys = (grid * self._band_mult).sum(axis=1, dtype=np.uint64) ^ self._band_salt  # (b,)
        return keys.tolist()

    def check(self, text: str) -> tuple[str | None, object]:
        return self.check_words(words(text))

    def check_words(self, ws: list[str]) -> tuple[str | None, object]:
        """(drop reason or None, state to pass to `add` if the row is kept). Never inserts."""
        key = hashlib.sha1(" ".join(ws).encode()).digest()[:8]
        if self.exact and key in self._keys:
            return "duplicate_exact", None
        band_keys: list[int] = []
        if self.near:
            band_keys = self._band_keys(self._hasher(ngram_hashes(ws, self.shingle)))
            if any(k in self._bands for k in band_keys):
                return "duplicate_near", None
        return None, (key, band_keys)

    def add(self, state: object) -> None:
        key, band_keys = state  # type: ignore[misc]
        if self.exact:
            self._keys.add(key)
        self._bands.update(band_keys)
