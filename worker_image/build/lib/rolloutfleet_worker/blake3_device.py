"""BLAKE3 of a GPU tensor's bytes, computed on the GPU with Triton, bit-identical to the blake3 package.

Called by ``loader_mapped`` (when ``ROLLOUTFLEET_LOAD_GPU_HASH=1``) on each large tensor right after its
bytes reach GPU staging, so the host's cores only lock and copy; and by the unit tests, which run the same
kernels in Triton's CPU interpreter against the blake3 package. Owns BLAKE3's compression function (a
plain-Python one for the odd tail chunk and the tests, a Triton one over many chunks at once) and the
tree: every full 1 KiB chunk is compressed in parallel, then each level of parents pairs neighbours
(an odd last node moves up unchanged — the same left-heavy tree BLAKE3 defines), and the last pair is
compressed with the ROOT flag. Only the hash mode (no key, no derive) and 32-byte outputs, which is all
``digest.TensorHasher`` uses.

Nothing is trusted unverified: ``self_test()`` hashes random buffers on the device and compares them with
the blake3 package, and the loader falls back to the CPU hash if it fails. Triton is imported lazily (it
ships with vLLM; the operator never imports this module).
"""

from __future__ import annotations

import struct
from typing import Any

CHUNK_LEN = 1024
BLOCK_LEN = 64
CHUNK_START, CHUNK_END, PARENT, ROOT = 1, 2, 4, 8
IV = (0x6A09E667, 0xBB67AE85, 0x3C6EF372, 0xA54FF53A, 0x510E527F, 0x9B05688C, 0x1F83D9AB, 0x5BE0CD19)
_PERMUTATION = (2, 6, 3, 10, 7, 0, 4, 13, 1, 11, 12, 5, 9, 14, 15, 8)
_MASK = 0xFFFFFFFF
LANES = 64  # chunks (or parents) per Triton program


# -- plain Python (the tail chunk, the root of tiny trees, and the reference for the tests) ---------------


def _rotr(x: int, n: int) -> int:
    return ((x >> n) | (x << (32 - n))) & _MASK


def _g(s: list[int], a: int, b: int, c: int, d: int, mx: int, my: int) -> None:
    s[a] = (s[a] + s[b] + mx) & _MASK
    s[d] = _rotr(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotr(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b] + my) & _MASK
    s[d] = _rotr(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & _MASK
    s[b] = _rotr(s[b] ^ s[c], 7)


def compress(cv: list[int], words: list[int], counter: int, block_len: int, flags: int) -> list[int]:
    """BLAKE3's compression function; returns the 8-word chaining value."""
    s = [*cv, *IV[:4], counter & _MASK, (counter >> 32) & _MASK, block_len, flags]
    m = list(words)
    for r in range(7):
        _g(s, 0, 4, 8, 12, m[0], m[1])
        _g(s, 1, 5, 9, 13, m[2], m[3])
        _g(s, 2, 6, 10, 14, m[4], m[5])
        _g(s, 3, 7, 11, 15, m[6], m[7])
        _g(s, 0, 5, 10, 15, m[8], m[9])
        _g(s, 1, 6, 11, 12, m[10], m[11])
        _g(s, 2, 7, 8, 13, m[12], m[13])
        _g(s, 3, 4, 9, 14, m[14], m[15])
        if r < 6:
            m = [m[i] for i in _PERMUTATION]
    return [s[i] ^ s[i + 8] for i in range(8)]


def chunk_cv(data: bytes, counter: int, root: bool = False) -> list[int]:
    """The chaining value of one chunk (at most 1 KiB; the last one of an input may be shorter)."""
    cv = list(IV)
    blocks = max(1, -(-len(data) // BLOCK_LEN))
    for j in range(blocks):
        block = data[j * BLOCK_LEN : (j + 1) * BLOCK_LEN]
        flags = (CHUNK_START if j == 0 else 0) | (CHUNK_END if j == blocks - 1 else 0)
        if root and j == blocks - 1:
            flags |= ROOT
        words = list(struct.unpack("<16I", block.ljust(BLOCK_LEN, b"\0")))
        cv = compress(cv, words, counter, len(block), flags)
    return cv


def parent_cv(left: list[int], right: list[int], root: bool = False) -> list[int]:
    return compress(list(IV), [*left, *right], 0, BLOCK_LEN, PARENT | (ROOT if root else 0))


def words_to_bytes(cv: list[int]) -> bytes:
    return struct.pack("<8I", *cv)


def hash_bytes(data: bytes) -> bytes:
    """BLAKE3 of ``data`` in plain Python (slow: tests and tiny inputs only)."""
    n = max(1, -(-len(data) // CHUNK_LEN))
    if n == 1:
        return words_to_bytes(chunk_cv(data, 0, root=True))
    level = [chunk_cv(data[i * CHUNK_LEN : (i + 1) * CHUNK_LEN], i) for i in range(n)]
    while len(level) > 2:
        level = [parent_cv(level[i], level[i + 1]) if i + 1 < len(level) else level[i] for i in range(0, len(level), 2)]
    return words_to_bytes(parent_cv(level[0], level[1], root=True))


# -- on a device: the Triton kernels of blake3_triton ---------------------------------------------------


_ivs: dict[Any, Any] = {}


def _signed(words: list[int] | tuple[int, ...]) -> list[int]:
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]


def _iv(device: Any) -> Any:
    """The IV as int32 words on ``device``, made once (the first call synchronises, later ones need not)."""
    if device not in _ivs:
        import torch

        _ivs[device] = torch.tensor(_signed(IV), dtype=torch.int32, device=device)
    return _ivs[device]


def hash_on_device(data: Any, tail: bytes | None = None) -> Any:
    """Queue BLAKE3 of ``data`` (a contiguous uint8 tensor of more than 1 KiB) on the current stream.

    Returns a device tensor of 8 int32 words (``words_to_bytes(result.tolist())`` after the stream got
    there). ``tail`` is the last partial chunk as host bytes when the length is not a multiple of 1 KiB
    (the caller has it in host memory; reading it back from the device would need a sync here).
    """
    import torch

    from rolloutfleet_worker import blake3_triton

    n = data.numel()
    full, rest = divmod(n, CHUNK_LEN)
    if full == 0 or (full == 1 and rest == 0):
        raise ValueError("hash_on_device needs more than one chunk; hash small inputs on the host")
    if rest and (tail is None or len(tail) != rest):
        raise ValueError(f"the tail must be the last {rest} bytes")
    device = data.device
    iv = _iv(device)
    level = torch.empty((full + (1 if rest else 0), 8), dtype=torch.int32, device=device)
    words = data[: full * CHUNK_LEN].view(torch.int32)
    blake3_triton.chunks_kernel[(-(-full // LANES),)](words, level, iv, full, LANES=LANES)
    if rest:
        assert tail is not None
        # Asynchronous from page-locked memory: a plain host tensor would make this thread wait for the
        # stream (the copies queued before it), and the copier must keep queueing.
        cv = torch.tensor(_signed(chunk_cv(tail, full)), dtype=torch.int32)
        level[full] = cv.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else cv
    while level.shape[0] > 1:
        count = level.shape[0]
        pairs = count // 2
        upper = torch.empty(((count + 1) // 2, 8), dtype=torch.int32, device=device)
        flags = PARENT | (ROOT if count == 2 else 0)
        blake3_triton.parents_kernel[(-(-pairs // LANES),)](level, upper, iv, pairs, flags, LANES=LANES)
        if count % 2:
            upper[pairs] = level[count - 1]  # an odd last node moves up a level unchanged
        level = upper
    return level[0]


def digest_of(result: Any) -> bytes:
    """The 32-byte hash from ``hash_on_device``'s result (synchronises with the device)."""
    return words_to_bytes([w & _MASK for w in result.tolist()])


def self_test(device: Any, sizes: tuple[int, ...] = (2 * CHUNK_LEN, 5 * CHUNK_LEN + 17, (1 << 20) + 1000)) -> bool:
    """Hash random buffers on ``device`` and compare with the blake3 package; False on any difference."""
    import blake3
    import torch

    generator = torch.Generator().manual_seed(20261130)
    for size in sizes:
        host = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        raw = host.numpy().tobytes()
        full = size // CHUNK_LEN * CHUNK_LEN
        got = digest_of(hash_on_device(host.to(device), raw[full:] if size % CHUNK_LEN else None))
        if got != blake3.blake3(raw).digest():
            return False
    return True
