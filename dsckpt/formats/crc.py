"""CRC-32 (zip's, zlib's): the fastest implementation installed, and the CRC of joined buffers from theirs.

``crc32`` is ISA-L's (the ``isal`` package: carry-less multiply, AVX-512 where the CPU has it) when installed,
else zlib's (both release the GIL; ISA-L's is about ten times faster).  A zip writer checksums every byte it
writes (docs/dev/performance-log.md 12, 15).  CRC-32 is linear over GF(2), so the CRC of ``a + b`` follows
from the CRCs of ``a`` and ``b`` and ``len(b)`` (zlib's ``crc32_combine``, not exposed by Python's zlib):
crc(a + b) = crc(a) * x^(8 len(b)) mod P  xor  crc(b), computed here as zlib computes it (reflected
bit order, P = 0xEDB88320).
"""
from __future__ import annotations

from array import array
from functools import lru_cache

try:
    from isal.isal_zlib import crc32
except ImportError:  # a platform without isal's wheels: zlib's, ~10x slower, the same values
    from zlib import crc32

POLY = 0xEDB88320  # CRC-32's polynomial, reflected
_X0 = 1 << 31  # the polynomial 1, reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo P (both reflected)."""
    m, product = _X0, 0
    while m:
        if a & m:
            product ^= b
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return product


def _powers() -> list[int]:
    """x^(2^k) mod P for k = 0..31."""
    p, out = 1 << 30, []  # x^1
    for _ in range(32):
        out.append(p)
        p = _multmodp(p, p)
    return out


_X2N = _powers()


@lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """x^(8 nbytes) mod P: what appending ``nbytes`` bytes does to a CRC."""
    p, k, n = _X0, 3, nbytes
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


TABLE_AFTER = 16  # a length joined more often than this gets byte tables (a reshard or TP join repeats a few)
_uses: dict[int, int] = {}


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if len(_uses) > 1 << 16:  # (a long-lived process joining ever new lengths)
        _uses.clear()
    uses = _uses[len_b] = _uses.get(len_b, 0) + 1  # (threads may miscount: it only moves when the tables come)
    if uses <= TABLE_AFTER:
        return _multmodp(_shift(len_b), crc_a) ^ crc_b
    t0, t1, t2, t3 = _tables(len_b)
    return int(t0[crc_a & 255] ^ t1[crc_a >> 8 & 255] ^ t2[crc_a >> 16 & 255] ^ t3[crc_a >> 24] ^ crc_b)


@lru_cache(maxsize=256)
def _tables(nbytes: int) -> tuple["array[int]", ...]:
    """Appending ``nbytes`` bytes as four 256-entry tables (4 KiB), one per byte of the CRC (it is linear): a join is
    then four lookups, not a 32-step multiplication (performance log 27)."""
    shift = _shift(nbytes)
    tables = []
    for byte in range(4):
        basis = [_multmodp(shift, 1 << (8 * byte + bit)) for bit in range(8)]
        table = array("I", bytes(4 * 256))
        for v in range(1, 256):
            low = v & -v
            table[v] = table[v ^ low] ^ basis[low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)
