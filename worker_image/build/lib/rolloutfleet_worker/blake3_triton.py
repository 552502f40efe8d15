"""Triton kernels of ``blake3_device``: BLAKE3 compressions over many chunks or parents at once.

Imported only by ``blake3_device`` when it runs on a GPU (or in Triton's CPU interpreter in the unit
tests): importing triton is slow and only a GPU worker needs it. Each program holds ``LANES`` independent
compressions in uint32 vectors, one lane per chunk (or parent), so the compression function is written
out once and vectorised for free. The IV comes from memory as uint32 so no literal above 2^31 ever meets
Triton's integer promotion.
"""

# ruff: noqa: N803
# mypy: ignore-errors

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _g(a, b, c, d, mx, my):
    a = a + b + mx
    d = d ^ a
    d = (d >> 16) | (d << 16)
    c = c + d
    b = b ^ c
    b = (b >> 12) | (b << 20)
    a = a + b + my
    d = d ^ a
    d = (d >> 8) | (d << 24)
    c = c + d
    b = b ^ c
    b = (b >> 7) | (b << 25)
    return a, b, c, d


@triton.jit
def _round(
    s0,
    s1,
    s2,
    s3,
    s4,
    s5,
    s6,
    s7,
    s8,
    s9,
    s10,
    s11,
    s12,
    s13,
    s14,
    s15,
    m0,
    m1,
    m2,
    m3,
    m4,
    m5,
    m6,
    m7,
    m8,
    m9,
    m10,
    m11,
    m12,
    m13,
    m14,
    m15,
):
    s0, s4, s8, s12 = _g(s0, s4, s8, s12, m0, m1)
    s1, s5, s9, s13 = _g(s1, s5, s9, s13, m2, m3)
    s2, s6, s10, s14 = _g(s2, s6, s10, s14, m4, m5)
    s3, s7, s11, s15 = _g(s3, s7, s11, s15, m6, m7)
    s0, s5, s10, s15 = _g(s0, s5, s10, s15, m8, m9)
    s1, s6, s11, s12 = _g(s1, s6, s11, s12, m10, m11)
    s2, s7, s8, s13 = _g(s2, s7, s8, s13, m12, m13)
    s3, s4, s9, s14 = _g(s3, s4, s9, s14, m14, m15)
    return s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15


@triton.jit
def _compress(
    c0,
    c1,
    c2,
    c3,
    c4,
    c5,
    c6,
    c7,
    m0,
    m1,
    m2,
    m3,
    m4,
    m5,
    m6,
    m7,
    m8,
    m9,
    m10,
    m11,
    m12,
    m13,
    m14,
    m15,
    counter_lo,
    counter_hi,
    block_len,
    flags,
    i0,
    i1,
    i2,
    i3,
):
    """One BLAKE3 compression over uint32 lanes; returns the 8 words of the new chaining value."""
    s0, s1, s2, s3, s4, s5, s6, s7 = c0, c1, c2, c3, c4, c5, c6, c7
    s8, s9, s10, s11 = i0, i1, i2, i3
    s12, s13, s14, s15 = counter_lo, counter_hi, block_len, flags
    # round 1: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m0,
        m1,
        m2,
        m3,
        m4,
        m5,
        m6,
        m7,
        m8,
        m9,
        m10,
        m11,
        m12,
        m13,
        m14,
        m15,
    )
    # round 2: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m2,
        m6,
        m3,
        m10,
        m7,
        m0,
        m4,
        m13,
        m1,
        m11,
        m12,
        m5,
        m9,
        m14,
        m15,
        m8,
    )
    # round 3: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m3,
        m4,
        m10,
        m12,
        m13,
        m2,
        m7,
        m14,
        m6,
        m5,
        m9,
        m0,
        m11,
        m15,
        m8,
        m1,
    )
    # round 4: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m10,
        m7,
        m12,
        m9,
        m14,
        m3,
        m13,
        m15,
        m4,
        m0,
        m11,
        m2,
        m5,
        m8,
        m1,
        m6,
    )
    # round 5: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m12,
        m13,
        m9,
        m11,
        m15,
        m10,
        m14,
        m8,
        m7,
        m2,
        m5,
        m3,
        m0,
        m1,
        m6,
        m4,
    )
    # round 6: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m9,
        m14,
        m11,
        m5,
        m8,
        m12,
        m15,
        m1,
        m13,
        m3,
        m0,
        m10,
        m2,
        m6,
        m4,
        m7,
    )
    # round 7: the message words in BLAKE3's schedule for this round
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15 = _round(
        s0,
        s1,
        s2,
        s3,
        s4,
        s5,
        s6,
        s7,
        s8,
        s9,
        s10,
        s11,
        s12,
        s13,
        s14,
        s15,
        m11,
        m15,
        m5,
        m0,
        m1,
        m9,
        m8,
        m6,
        m14,
        m10,
        m2,
        m12,
        m3,
        m4,
        m7,
        m13,
    )
    return s0 ^ s8, s1 ^ s9, s2 ^ s10, s3 ^ s11, s4 ^ s12, s5 ^ s13, s6 ^ s14, s7 ^ s15


@triton.jit
def _word(ptr, offs, mask):
    return tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _store_cv(out_ptr, idx, mask, c0, c1, c2, c3, c4, c5, c6, c7):
    base = idx.to(tl.int64) * 8
    tl.store(out_ptr + base + 0, c0.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 1, c1.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 2, c2.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 3, c3.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 4, c4.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 5, c5.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 6, c6.to(tl.int32, bitcast=True), mask=mask)
    tl.store(out_ptr + base + 7, c7.to(tl.int32, bitcast=True), mask=mask)


@triton.jit
def chunks_kernel(words_ptr, out_ptr, iv_ptr, n_chunks, LANES: tl.constexpr):
    """Chaining values of ``n_chunks`` full 1 KiB chunks (chunk i has counter i); one lane per chunk."""
    idx = tl.program_id(0) * LANES + tl.arange(0, LANES)
    mask = idx < n_chunks
    base = idx.to(tl.int64) * 256
    i0 = tl.load(iv_ptr + 0).to(tl.uint32, bitcast=True)
    i1 = tl.load(iv_ptr + 1).to(tl.uint32, bitcast=True)
    i2 = tl.load(iv_ptr + 2).to(tl.uint32, bitcast=True)
    i3 = tl.load(iv_ptr + 3).to(tl.uint32, bitcast=True)
    i4 = tl.load(iv_ptr + 4).to(tl.uint32, bitcast=True)
    i5 = tl.load(iv_ptr + 5).to(tl.uint32, bitcast=True)
    i6 = tl.load(iv_ptr + 6).to(tl.uint32, bitcast=True)
    i7 = tl.load(iv_ptr + 7).to(tl.uint32, bitcast=True)
    zero = (idx * 0).to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = (
        zero + i0,
        zero + i1,
        zero + i2,
        zero + i3,
        zero + i4,
        zero + i5,
        zero + i6,
        zero + i7,
    )
    counter_lo = idx.to(tl.uint32)
    counter_hi = zero
    block_len = zero + 64
    # A loop, not unrolled: one compression's code instead of sixteen keeps the first compile short.
    for j in range(16):
        off = base + j * 16
        flags = zero + tl.where(j == 0, 1, 0) + tl.where(j == 15, 2, 0)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            c0,
            c1,
            c2,
            c3,
            c4,
            c5,
            c6,
            c7,
            _word(words_ptr, off + 0, mask),
            _word(words_ptr, off + 1, mask),
            _word(words_ptr, off + 2, mask),
            _word(words_ptr, off + 3, mask),
            _word(words_ptr, off + 4, mask),
            _word(words_ptr, off + 5, mask),
            _word(words_ptr, off + 6, mask),
            _word(words_ptr, off + 7, mask),
            _word(words_ptr, off + 8, mask),
            _word(words_ptr, off + 9, mask),
            _word(words_ptr, off + 10, mask),
            _word(words_ptr, off + 11, mask),
            _word(words_ptr, off + 12, mask),
            _word(words_ptr, off + 13, mask),
            _word(words_ptr, off + 14, mask),
            _word(words_ptr, off + 15, mask),
            counter_lo,
            counter_hi,
            block_len,
            flags,
            i0,
            i1,
            i2,
            i3,
        )
    _store_cv(out_ptr, idx, mask, c0, c1, c2, c3, c4, c5, c6, c7)


@triton.jit
def parents_kernel(cv_ptr, out_ptr, iv_ptr, n_pairs, flag_bits, LANES: tl.constexpr):
    """Parent i of a level = compress(IV, cv[2i] ++ cv[2i+1], flags ``flag_bits``); one lane per parent."""
    idx = tl.program_id(0) * LANES + tl.arange(0, LANES)
    mask = idx < n_pairs
    left = idx.to(tl.int64) * 16
    i0 = tl.load(iv_ptr + 0).to(tl.uint32, bitcast=True)
    i1 = tl.load(iv_ptr + 1).to(tl.uint32, bitcast=True)
    i2 = tl.load(iv_ptr + 2).to(tl.uint32, bitcast=True)
    i3 = tl.load(iv_ptr + 3).to(tl.uint32, bitcast=True)
    i4 = tl.load(iv_ptr + 4).to(tl.uint32, bitcast=True)
    i5 = tl.load(iv_ptr + 5).to(tl.uint32, bitcast=True)
    i6 = tl.load(iv_ptr + 6).to(tl.uint32, bitcast=True)
    i7 = tl.load(iv_ptr + 7).to(tl.uint32, bitcast=True)
    zero = (idx * 0).to(tl.uint32)
    c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
        zero + i0,
        zero + i1,
        zero + i2,
        zero + i3,
        zero + i4,
        zero + i5,
        zero + i6,
        zero + i7,
        _word(cv_ptr, left + 0, mask),
        _word(cv_ptr, left + 1, mask),
        _word(cv_ptr, left + 2, mask),
        _word(cv_ptr, left + 3, mask),
        _word(cv_ptr, left + 4, mask),
        _word(cv_ptr, left + 5, mask),
        _word(cv_ptr, left + 6, mask),
        _word(cv_ptr, left + 7, mask),
        _word(cv_ptr, left + 8, mask),
        _word(cv_ptr, left + 9, mask),
        _word(cv_ptr, left + 10, mask),
        _word(cv_ptr, left + 11, mask),
        _word(cv_ptr, left + 12, mask),
        _word(cv_ptr, left + 13, mask),
        _word(cv_ptr, left + 14, mask),
        _word(cv_ptr, left + 15, mask),
        zero,
        zero,
        zero + 64,
        zero + flag_bits,
        i0,
        i1,
        i2,
        i3,
    )
    _store_cv(out_ptr, idx, mask, c0, c1, c2, c3, c4, c5, c6, c7)
