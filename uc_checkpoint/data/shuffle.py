"""Within-shard shuffling: a keyed bijection on a shard's sample indices, one per (seed, epoch, shard).

With ``DataTracker(..., shuffle_within_shard=True)`` the tracker's intervals stay *positions*
``[0, num_samples)`` in a shard's reading order, and position ``p`` of shard ``s`` in epoch ``e`` is
sample ``ShardPermutation(seed, e, s.name, s.num_samples).indices(p, p + 1)[0]``. The permutation is
a function of its key alone (nothing is stored: the saved state stays the same size) and can be
evaluated at any position, so a consumer that resumes at position ``p`` of a shard continues the very
same order, on any world size and number of workers.

The bijection is a balanced Feistel network over the smallest even power of two that holds
``num_samples`` values, with cycle-walking for values that fall outside ``[0, num_samples)``
(Black and Rogaway, "Ciphers with Arbitrary Finite Domains", CT-RSA 2002): each value outside the
range is encrypted again until it lands inside, which keeps the map a permutation of the range. The
domain is less than four times ``num_samples``, so a position needs fewer than four walks on average.
The round function is the splitmix64 finalizer (Steele, Lea and Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014) over the round key and the half block. Everything is vectorised with
numpy over ``uint64`` arrays (their arithmetic wraps modulo 2**64, which the mixing relies on).
"""

from __future__ import annotations

import hashlib

import numpy as np

from uc_checkpoint.data.intervals import check_int

# Domain tag of the key derivation; changing it changes every shuffled run's order.
_SHUFFLE_TAG = b"uc_checkpoint.data_tracker.shuffle.v1\n"
_ROUNDS = 6
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_CHUNK = 1 << 16  # positions per vectorised step


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer applied to every element of a ``uint64`` array (a bijection on 64-bit
    values with full avalanche); returns a new array of the same shape."""
    z = x ^ (x >> np.uint64(30))
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


class ShardPermutation:
    """The order in which epoch ``epoch`` of a run seeded ``seed`` reads the samples of one shard.

    Args:
        seed: the tracker's seed.
        epoch: the epoch, ``>= 0``.
        shard_name: the shard's :attr:`~uc_checkpoint.data.intervals.ShardSpec.name` (the key uses
            the name, not the shard's index, so that the order follows the shard when shards are
            added or removed around it).
        num_samples: the shard's size; the permutation is of ``range(num_samples)``.

    :meth:`indices` maps positions to sample indices. Two permutations with the same arguments are
    equal on every interpreter and platform (the keys come from sha256).

    Raises:
        TypeError, ValueError: an argument has the wrong type or is out of range.
    """

    __slots__ = ("_half_bits", "_keys", "num_samples")

    def __init__(self, seed: int, epoch: int, shard_name: str, num_samples: int) -> None:
        check_int(seed, "seed")
        check_int(epoch, "epoch", minimum=0)
        check_int(num_samples, "num_samples", minimum=0)
        if not isinstance(shard_name, str):
            raise TypeError(f"shard_name must be a str, got {type(shard_name).__name__}")
        self.num_samples = num_samples
        bits = max(1, (num_samples - 1).bit_length())
        self._half_bits = (bits + 1) // 2
        name = shard_name.encode("utf-8", "surrogatepass")
        h = hashlib.sha256(_SHUFFLE_TAG)
        h.update(f"{seed}:{epoch}:{num_samples}:{len(name)}:".encode())
        h.update(name)
        material = h.digest() + hashlib.sha256(h.digest()).digest()  # 64 bytes: 8 keys, _ROUNDS used
        self._keys = [np.uint64(int.from_bytes(material[8 * r : 8 * r + 8], "little")) for r in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self._half_bits)
        mask = np.uint64((1 << self._half_bits) - 1)
        left = x >> h
        right = x & mask
        for key in self._keys:
            left, right = right, left ^ (mix64(right ^ key) & mask)
        return (left << h) | right

    def indices(self, start: int, end: int) -> np.ndarray:
        """Sample indices at positions ``start .. end - 1``: an ``int64`` array of ``end - start``
        distinct values in ``[0, num_samples)``; over ``(0, num_samples)`` every index exactly once.

        Raises:
            ValueError: not ``0 <= start <= end <= num_samples``.
        """
        check_int(start, "start", minimum=0)
        check_int(end, "end", minimum=0)
        if not start <= end <= self.num_samples:
            raise ValueError(f"positions [{start}, {end}) are outside the shard's [0, {self.num_samples})")
        if self.num_samples <= 1:
            return np.arange(start, end, dtype=np.int64)
        out = np.empty(end - start, dtype=np.int64)
        for lo in range(start, end, _CHUNK):  # chunks keep the temporaries in cache
            hi = min(lo + _CHUNK, end)
            out[lo - start : hi - start] = self._permute(np.arange(lo, hi, dtype=np.uint64))
        return out

    def _permute(self, x: np.ndarray) -> np.ndarray:
        n = np.uint64(self.num_samples)
        out = self._encrypt(x)
        outside = np.flatnonzero(out >= n)
        while outside.size:  # cycle-walking: re-encrypt until inside the range
            walked = self._encrypt(out[outside])
            out[outside] = walked
            outside = outside[walked >= n]
        return out


__all__ = ["ShardPermutation", "mix64"]
