"""A canonical Huffman code over byte symbols, in numpy: the paper's entropy stage (correct, not fast)."""

# The bitstream of a piece is one continuous MSB-first code sequence. It is cut into segments of SEGMENT
# symbols whose bit lengths are stored (uint16) in front of it, so decoding can run all segments in lockstep
# (one numpy step per symbol position); this framing costs 16 / SEGMENT bits per symbol.

from __future__ import annotations

import heapq

import numpy as np

from geofed_hpc.errors import CodecError

MAX_LEN = 20  # longest code; 2**MAX_LEN-entry decode table
WINDOW = 1 << 20  # symbols placed at a time by the encoder
SEGMENT = 3072  # symbols per segment: SEGMENT * MAX_LEN < 2**16 bits, so a uint16 holds a segment's length


_UP = np.ldexp(1.0, np.arange(65))  # _UP[k] = 2**k
_DOWN = np.ldexp(1.0, -np.arange(65))  # _DOWN[k] = 2**-k


def code_lengths(counts: np.ndarray) -> np.ndarray:
    """Huffman code lengths (uint8, 0 for absent symbols) for symbol counts, limited to MAX_LEN bits."""
    counts = np.asarray(counts, np.int64)
    while True:
        lengths = _huffman_lengths(counts)
        if lengths.max(initial=0) <= MAX_LEN:
            return lengths
        counts = np.where(counts > 0, np.maximum(counts >> 1, 1), 0)  # flatten the tail until codes fit


def _huffman_lengths(counts: np.ndarray) -> np.ndarray:
    lengths = np.zeros(counts.size, np.uint8)
    present = [int(s) for s in np.flatnonzero(counts)]
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    heap = [(int(counts[s]), s, [s]) for s in present]
    heapq.heapify(heap)
    while len(heap) > 1:
        c1, t1, s1 = heapq.heappop(heap)
        c2, t2, s2 = heapq.heappop(heap)
        for s in s1 + s2:
            lengths[s] += 1
        heapq.heappush(heap, (c1 + c2, min(t1, t2), s1 + s2))
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codewords (uint32) for code lengths: shorter first, then by symbol."""
    codes = np.zeros(lengths.size, np.uint32)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def check_lengths(lengths: object) -> np.ndarray:
    """Validated code lengths from a header: 256 integers in 0..MAX_LEN satisfying Kraft's inequality."""
    if not (isinstance(lengths, list) and len(lengths) == 256 and all(type(n) is int for n in lengths)):
        raise CodecError("header: huffman.lengths must be a list of 256 integers")
    arr = np.array(lengths, np.int64)
    if arr.min() < 0 or arr.max() > MAX_LEN or not arr.any():
        raise CodecError(f"header: huffman.lengths must lie in 0..{MAX_LEN} with at least one code")
    if np.sum(np.ldexp(1.0, -arr[arr > 0])) > 1.0:
        raise CodecError("header: huffman.lengths violate Kraft's inequality (not a prefix code)")
    return arr.astype(np.uint8)


def encode(symbols: np.ndarray, lengths: np.ndarray) -> bytes:
    """Segment bit lengths (uint16 LE) followed by the packed bitstream of `symbols` (uint8)."""
    codes = canonical_codes(lengths).astype(np.float64)
    sizes = lengths.astype(np.int64)
    if symbols.size and not lengths[symbols].min():
        raise CodecError("huffman: a symbol has no code (the code table was built from other data)")
    seg_lens = np.add.reduceat(lengths[symbols].astype(np.int64), np.arange(0, symbols.size, SEGMENT))
    total = int(seg_lens.sum()) if symbols.size else 0
    # Codes are summed into 32-bit big-endian words (float64 sums of disjoint bit fields are exact); a code
    # of at most 20 bits touches two words at most. Symbols are placed WINDOW at a time to bound temporaries.
    words = np.zeros(total // 32 + 2, np.float64)
    base = 0
    for start in range(0, symbols.size, WINDOW):
        sym = symbols[start : start + WINDOW]
        nbits = sizes[sym]
        ends = np.cumsum(nbits) + base
        base = int(ends[-1])
        starts = ends - nbits
        val = codes[sym]
        word, room = starts >> 5, 32 - (starts & 31)
        over = np.maximum(nbits - room, 0)  # bits that spill into the next word
        head = np.floor(val * _DOWN[over])
        words += np.bincount(word, weights=head * _UP[np.maximum(room - nbits, 0)], minlength=words.size)
        spill = np.flatnonzero(over)
        tail = (val[spill] - head[spill] * _UP[over[spill]]) * _UP[32 - over[spill]]
        words += np.bincount(word[spill] + 1, weights=tail, minlength=words.size)
    stream = words.astype(">u4").tobytes()[: -(-total // 8)]
    return seg_lens.astype("<u2").tobytes() + stream


def _table(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decode tables indexed by the next MAX_LEN bits: symbol and code length (0 = no code starts so)."""
    codes = canonical_codes(lengths)
    sym = np.zeros(1 << MAX_LEN, np.uint8)
    size = np.zeros(1 << MAX_LEN, np.uint8)
    for s in np.flatnonzero(lengths):
        shift = MAX_LEN - int(lengths[s])
        lo = int(codes[s]) << shift
        sym[lo : lo + (1 << shift)] = s
        size[lo : lo + (1 << shift)] = lengths[s]
    return sym, size


def decode(blob: memoryview, count: int, lengths: np.ndarray, what: str) -> np.ndarray:
    """`count` uint8 symbols from a blob made by `encode`; CodecError naming `what` if it is inconsistent."""
    nseg = -(-count // SEGMENT)
    if len(blob) < 2 * nseg:
        raise CodecError(f"{what}: huffman blob of {len(blob)} bytes cannot hold {nseg} segment lengths")
    seg_lens = np.frombuffer(blob[: 2 * nseg], "<u2").astype(np.int64)
    total = int(seg_lens.sum())
    stream = blob[2 * nseg :]
    if len(stream) != -(-total // 8):
        raise CodecError(f"{what}: huffman stream is {len(stream)} bytes, its segments need {-(-total // 8)}")
    sym_table, len_table = _table(lengths)
    buf = np.zeros(len(stream) + 8, np.uint8)
    buf[: len(stream)] = np.frombuffer(stream, np.uint8)
    out = np.empty(nseg * SEGMENT, np.uint8).reshape(nseg, SEGMENT)
    starts = np.cumsum(seg_lens) - seg_lens
    pos = starts.copy()
    steps = np.full(nseg, SEGMENT)
    if nseg:
        steps[-1] = count - (nseg - 1) * SEGMENT
    mask = (1 << MAX_LEN) - 1
    for k in range(int(steps.max(initial=0))):
        live = steps > k
        byte = np.minimum(pos >> 3, len(stream))  # a corrupt stream may run past its end
        window = (
            (buf[byte].astype(np.uint32) << 24)
            | (buf[byte + 1].astype(np.uint32) << 16)
            | (buf[byte + 2].astype(np.uint32) << 8)
            | buf[byte + 3]
        )
        idx = (window >> (32 - MAX_LEN - (pos & 7)).astype(np.uint32)) & mask
        n = len_table[idx]
        if not n[live].all():
            raise CodecError(f"{what}: huffman stream holds a bit pattern that is no codeword (corrupt)")
        out[:, k] = sym_table[idx]
        pos += np.where(live, n, 0)
    if not np.array_equal(pos - starts, seg_lens):
        raise CodecError(f"{what}: huffman segments do not end where their stored lengths say (corrupt)")
    return out.reshape(-1)[:count]
