"""The arithmetic every kernel shares: e2m1 and e4m3 decode, exact block dot products, the scale layouts.

The fp4 (e2m1) values are read as integers: no fp4 instruction is needed, so the same code runs on sm_90a,
which has none. ``2 * e2m1`` is an integer in [-12, 12], so a 16-value block's dot product is exact in
int32: a ``prmt`` byte lookup turns four nibbles into four int8 magnitudes (a nibble with its sign bit set
selects in sign-replicate mode and yields 0), a second lookup on the nibbles with their sign bits flipped
yields the magnitudes of the negative ones, and two ``dp4a`` against the int8 copy of ``b`` give the
positive and the negative part. Each block's integer dot is then scaled once by ``sfa * sfb / 4`` (exactly:
the product fits fp32's mantissa) and added to an fp64 sum (``custom_kernel``'s kernels) or an fp32 one (the
op's, whose accuracy contract allows it).

Scales: plain ``[rows, K/16]`` with a row stride, or the 128x4 blocked layout of cuBLAS (``to_blocked``; the
permuted tensors' memory order): ``blocked_row`` and ``scale_offset`` address both.
"""

import cutlass
import cutlass.cute as cute
from cutlass.cutlass_dsl import T, dsl_user_op

from .ptx import asm, ldg_u16, ldg_v4

E2M1_TIMES2_LO = 0x03020100  # 2 * e2m1 magnitude codes 0..3; codes 4..7 give 0x0C080604


# ----------------------------------------------------------------------------------------------------
# Decode and block dot products (inline PTX: prmt byte lookups, dp4a)
# ----------------------------------------------------------------------------------------------------


@dsl_user_op
def e4m3x2_to_f32x2(v, *, loc=None, ip=None):
    """Two e4m3 scale bytes (low 16 bits of ``v``) to two fp32, NaN kept: ``cvt.rn.f16x2.e4m3x2`` (sm_89+)
    and two ``cvt.f32.f16``; ``cute.arch`` has no e4m3 conversion on DSL 4.3."""
    r = asm([T.f32(), T.f32()], [cutlass.Int32(v)],
            "{\n.reg .b16 s, lo, hi;\n.reg .b32 h;\ncvt.u16.u32 s, $2;\ncvt.rn.f16x2.e4m3x2 h, s;\n"
            "mov.b32 {lo, hi}, h;\ncvt.f32.f16 $0, lo;\ncvt.f32.f16 $1, hi;\n}", "=f,=f,r", loc, ip)
    return cutlass.Float32(r[0]), cutlass.Float32(r[1])


@dsl_user_op
def fp4x16_dot_i8(x0, x1, w0, w1, w2, w3, tbl, *, loc=None, ip=None):
    """Exact ``sum(2a * 2b)`` over 16 values: ``x0, x1`` hold 16 e2m1 nibbles of ``a`` (value order),
    ``w0..w3`` the 16 int8 values ``2b``; ``tbl`` is ``E2M1_TIMES2_LO``, passed in so that one register
    serves every lookup.

    ``prmt`` with the table {0,1,2,3,4,6,8,12} maps a nibble's magnitude to ``2|v|``; a nibble whose
    sign bit is set selects in sign-replicate mode and gives 0 (the table bytes are positive). So the
    lookup of ``x`` keeps the positive values, the lookup of ``x ^ 0x88888888`` the negative ones.
    """
    r = asm([T.i32()], [cutlass.Int32(v) for v in (x0, x1, w0, w1, w2, w3, tbl)],
            "{\n.reg .b32 n0, n1, h, p, q, s;\n"
            "xor.b32 n0, $1, 0x88888888;\nxor.b32 n1, $2, 0x88888888;\n"
            "prmt.b32 s, $7, 0x0C080604, $1;\ndp4a.s32.s32 p, s, $3, 0;\n"
            "prmt.b32 s, $7, 0x0C080604, n0;\ndp4a.s32.s32 q, s, $3, 0;\n"
            "shr.b32 h, $1, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 p, s, $4, p;\n"
            "shr.b32 h, n0, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 q, s, $4, q;\n"
            "prmt.b32 s, $7, 0x0C080604, $2;\ndp4a.s32.s32 p, s, $5, p;\n"
            "prmt.b32 s, $7, 0x0C080604, n1;\ndp4a.s32.s32 q, s, $5, q;\n"
            "shr.b32 h, $2, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 p, s, $6, p;\n"
            "shr.b32 h, n1, 16;\nprmt.b32 s, $7, 0x0C080604, h;\ndp4a.s32.s32 q, s, $6, q;\n"
            "sub.s32 $0, p, q;\n}", "=r,r,r,r,r,r,r,r", loc, ip)
    return cutlass.Int32(r[0])


@dsl_user_op
def fp4x8_to_i8(x, *, loc=None, ip=None):
    """8 e2m1 nibbles to 8 signed int8 ``2v`` (two words), for the one-time decode of ``b``."""
    r = asm([T.i32(), T.i32()], [cutlass.Int32(x)],
            "{\n.reg .b32 t0, t1, n, h, p, q;\n"
            "mov.b32 t0, 0x03020100;\nmov.b32 t1, 0x0C080604;\nxor.b32 n, $2, 0x88888888;\n"
            "prmt.b32 p, t0, t1, $2;\nprmt.b32 q, t0, t1, n;\n"
            "or.b32 p, p, 0x80808080;\nsub.u32 p, p, q;\nxor.b32 $0, p, 0x80808080;\n"
            "shr.b32 h, $2, 16;\nshr.b32 n, n, 16;\nprmt.b32 p, t0, t1, h;\nprmt.b32 q, t0, t1, n;\n"
            "or.b32 p, p, 0x80808080;\nsub.u32 p, p, q;\nxor.b32 $1, p, 0x80808080;\n}",
            "=r,=r,r", loc, ip)
    return cutlass.Int32(r[0]), cutlass.Int32(r[1])


@dsl_user_op
def fp4x16_lookups(x0, x1, tbl, *, loc=None, ip=None):
    """The byte lookups of 16 e2m1 nibbles that ``fp4x16_dot_i8`` makes, kept for reuse across tokens:
    ``(p, q)`` for each group of four values, ``p`` the magnitudes ``2|v|`` of the positive values, ``q``
    of the negative ones."""
    r = asm([T.i32()] * 8, [cutlass.Int32(v) for v in (x0, x1, tbl)],
            "{\n.reg .b32 n0, n1, h;\n"
            "xor.b32 n0, $8, 0x88888888;\nxor.b32 n1, $9, 0x88888888;\n"
            "prmt.b32 $0, $10, 0x0C080604, $8;\nprmt.b32 $1, $10, 0x0C080604, n0;\n"
            "shr.b32 h, $8, 16;\nprmt.b32 $2, $10, 0x0C080604, h;\n"
            "shr.b32 h, n0, 16;\nprmt.b32 $3, $10, 0x0C080604, h;\n"
            "prmt.b32 $4, $10, 0x0C080604, $9;\nprmt.b32 $5, $10, 0x0C080604, n1;\n"
            "shr.b32 h, $9, 16;\nprmt.b32 $6, $10, 0x0C080604, h;\n"
            "shr.b32 h, n1, 16;\nprmt.b32 $7, $10, 0x0C080604, h;\n}",
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


# The integer dot products start from the bits of 1.5 * 2^23: the sum's bits are then those of the fp32
# 1.5 * 2^23 + dot (|dot| <= 2304 < 2^22), and one exact fp32 subtraction gives float(dot) (no I2F, whose
# quarter-rate pipe bounds several tokens a block).
MAGIC, MAGIC_F = "0x4B400000", "0f4B400000"


@dsl_user_op
def lookups_dot(s, w, *, loc=None, ip=None):
    """``float(sum(2a * 2b))`` over 16 values (exact) from ``fp4x16_lookups``' eight words and ``b``'s
    four int8 words."""
    r = asm([T.f32()], [cutlass.Int32(v) for v in (*s, *w)],
            "{\n.reg .b32 p, q;\n.reg .f32 f;\n"
            f"dp4a.s32.s32 p, $1, $9, {MAGIC};\ndp4a.s32.s32 q, $2, $9, 0;\n"
            "dp4a.s32.s32 p, $3, $10, p;\ndp4a.s32.s32 q, $4, $10, q;\n"
            "dp4a.s32.s32 p, $5, $11, p;\ndp4a.s32.s32 q, $6, $11, q;\n"
            "dp4a.s32.s32 p, $7, $12, p;\ndp4a.s32.s32 q, $8, $12, q;\n"
            f"sub.s32 p, p, q;\nmov.b32 f, p;\nsub.f32 $0, f, {MAGIC_F};\n}}", "=f,r,r,r,r,r,r,r,r,r,r,r,r", loc, ip)
    return cutlass.Float32(r[0])


@dsl_user_op
def lookups_signed(s, *, loc=None, ip=None):
    """The four signed int8 words ``2a`` of a block from its eight lookup words (``p - q`` a byte: at most
    one of the two is non-zero, so the bytes never borrow from each other)."""
    r = asm([T.i32()] * 4, [cutlass.Int32(v) for v in s],
            "{\n.reg .b32 t;\n"
            "or.b32 t, $4, 0x80808080;\nsub.u32 t, t, $5;\nxor.b32 $0, t, 0x80808080;\n"
            "or.b32 t, $6, 0x80808080;\nsub.u32 t, t, $7;\nxor.b32 $1, t, 0x80808080;\n"
            "or.b32 t, $8, 0x80808080;\nsub.u32 t, t, $9;\nxor.b32 $2, t, 0x80808080;\n"
            "or.b32 t, $10, 0x80808080;\nsub.u32 t, t, $11;\nxor.b32 $3, t, 0x80808080;\n}",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def signed_dot(a, w, *, loc=None, ip=None):
    """``float(sum(2a * 2b))`` over 16 values (exact) from four signed int8 words of each."""
    r = asm([T.f32()], [cutlass.Int32(v) for v in (*a, *w)],
            "{\n.reg .b32 p;\n.reg .f32 f;\n"
            f"dp4a.s32.s32 p, $1, $5, {MAGIC};\ndp4a.s32.s32 p, $2, $6, p;\n"
            "dp4a.s32.s32 p, $3, $7, p;\ndp4a.s32.s32 p, $4, $8, p;\n"
            f"mov.b32 f, p;\nsub.f32 $0, f, {MAGIC_F};\n}}", "=f,r,r,r,r,r,r,r,r", loc, ip)
    return cutlass.Float32(r[0])


def chunk_lookups(v, tbl, signed):
    """A chunk's two blocks of 16 e2m1 values (four words) decoded once for every token: their
    ``fp4x16_lookups``, or where ``signed`` their signed int8 words."""
    lk = (fp4x16_lookups(v[0], v[1], tbl), fp4x16_lookups(v[2], v[3], tbl))
    return tuple(lookups_signed(b) for b in lk) if signed else lk


def chunk_dots(lk, xv, signed):
    """The two blocks' exact dot products (``chunk_lookups``) with a token's eight int8 words of the chunk."""
    dot = signed_dot if signed else lookups_dot
    return dot(lk[0], xv[0:4]), dot(lk[1], xv[4:8])


# ----------------------------------------------------------------------------------------------------
# Scale layouts
# ----------------------------------------------------------------------------------------------------


def blocked_row(base, row64, tile_stride):
    """Address of a row's first scale in the 128x4 blocked layout (``to_blocked``; the permuted scales'
    memory order) from ``base``: 128-row tiles ``tile_stride`` bytes apart, in a tile 32 rows of 16 bytes,
    the four 32-row groups 4 bytes apart."""
    return base + (row64 >> 7) * tile_stride + (row64 & 31) * 16 + ((row64 >> 5) & 3) * 4


def scale_offset(c, blocked):
    """Byte offset, from a row's first scale, of the two scales of its 16-byte chunk ``c`` (scales 2c and
    2c + 1): adjacent, and in the blocked layout in groups of four 512 bytes apart."""
    if blocked:
        return cutlass.Int64((c >> 1) * 512 + (c & 1) * 2)
    return cutlass.Int64(2 * c)


# ----------------------------------------------------------------------------------------------------
# custom_kernel's kernels: a chunk's scaled dot, b in registers, the group sum
# ----------------------------------------------------------------------------------------------------


def scaled_chunk_dot(acc, x, s16, w, sb0, sb1, tbl):
    """``acc`` (fp64) plus the scaled dot of one 16-byte chunk of ``a`` (32 values, 2 blocks; ``x`` its
    words, ``s16`` its two scale bytes) with ``b`` (``w`` 8 words of int8 ``2b``, ``sb0``/``sb1`` its
    scales / 4). Each block's term is exact in fp32 (an int below 2^12 times a product of two e4m3
    scales), so a row's only roundings are those of its fp64 sum, each at most 2^-53 of the running sum:
    rows whose blocks cancel keep their small remainder (an fp32 Kahan sum did not:
    tests/leaderboard/test_accuracy.py)."""
    sa0, sa1 = e4m3x2_to_f32x2(s16)
    d0 = fp4x16_dot_i8(x[0], x[1], w[0], w[1], w[2], w[3], tbl)
    d1 = fp4x16_dot_i8(x[2], x[3], w[4], w[5], w[6], w[7], tbl)
    acc = acc + cutlass.Float64(cutlass.Float32(d0) * (sa0 * sb0))
    return acc + cutlass.Float64(cutlass.Float32(d1) * (sa1 * sb1))


def b_in_registers(b_base, sfb_base, first, step, n, scale_offset, last=None):
    """Chunks ``first, first + step, ...`` (``n`` of them) of ``b`` as int8 ``2b`` (8 words a chunk) and
    their two scales / 4 as fp32: the share of ``b`` a lane keeps in registers. With ``last`` (the row's
    last chunk), the final one is clamped to it: a tail lane reads real scales, which its zero ``a``
    words and scales then cancel (a read past the row could decode an e4m3 NaN)."""
    wb, sb = [], []
    for i in range(n):
        ch = first + i * step
        if last is not None and i == n - 1:
            ch = cutlass.min(ch, last)
        x = ldg_v4(b_base + cutlass.Int64(ch) * 16)
        for w in range(4):
            wb += list(fp4x8_to_i8(x[w]))
        s0, s1 = e4m3x2_to_f32x2(ldg_u16(sfb_base + scale_offset(ch)))
        sb += [s0 * 0.25, s1 * 0.25]
    return wb, sb


def probe_sum(acc, x, s16):
    """The probe's stand-in for the arithmetic: keeps the loads alive, computes nothing useful."""
    return acc + cutlass.Float64(cutlass.Float32(x[0] ^ x[1] ^ x[2] ^ x[3] ^ s16))


def group_sum(acc, offsets):
    """Butterfly fp64 sum over the lanes that ``offsets`` span; every lane gets the total."""
    for off in offsets:
        acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=off)
    return acc


@dsl_user_op
def scaled_f16x8(q0, q1, s8, scaled=True, *, loc=None, ip=None):
    """16 e2m1 nibbles (two words, value order) times their block's e4m3 scale byte ``s8``: eight f16x2
    ``v * s * 2^-14``, in MMA-slot order: word 0's pairs (0,4), (1,5), (2,6), (3,7), then word 1's.

    A nibble ``s e1 e0 m`` is the high byte ``s000 e1e0m0`` of its f16 (the low byte is zero): with the odd
    nibbles at bits 4..7 of each byte (``h``), ``(h >> 3) ^ h`` puts e1e0m at bits 1..3 and keeps s at bit 7;
    the even nibbles likewise after a shift by 4; one ``prmt`` with zero then places two such bytes a pair.
    ``scaled=False`` (the ``late`` builds, whose scales multiply the MMA sums): ``v * 2^-14`` (0.5 is the
    subnormal 2^-15), no scale read."""
    body = ["{", ".reg .b32 t, u, s, z;", ".reg .b16 h;"]
    if scaled:
        body += ["prmt.b32 t, $9, 0, 0x0000;", "cvt.u16.u32 h, t;", "cvt.rn.f16x2.e4m3x2 s, h;"]
    body.append("mov.b32 z, 0;")
    for w, q in enumerate(("$8", "$10")):
        o = [f"${4 * w + j}" for j in range(4)]
        # u: the odd nibbles' f16 high bytes (n1, n3, n5, n7), t: the even ones' (n0, n2, n4, n6)
        body += [f"and.b32 u, {q}, 0xF0F0F0F0;", "shr.b32 t, u, 3;", "xor.b32 t, t, u;",
                 "and.b32 u, t, 0x8E8E8E8E;", f"shl.b32 t, {q}, 4;", "and.b32 t, t, 0xF0F0F0F0;",
                 f"shr.b32 {o[0]}, t, 3;", f"xor.b32 t, t, {o[0]};", "and.b32 t, t, 0x8E8E8E8E;",
                 f"prmt.b32 {o[0]}, t, z, 0x2404;", f"prmt.b32 {o[1]}, u, z, 0x2404;",
                 f"prmt.b32 {o[2]}, t, z, 0x3414;", f"prmt.b32 {o[3]}, u, z, 0x3414;"]
        if scaled:
            body += [f"mul.rn.f16x2 {o[j]}, {o[j]}, s;" for j in range(4)]
    body.append("}")
    # operands: $0..$7 out, $8 q0, $9 s8, $10 q1
    r = asm([T.i32()] * 8, [cutlass.Int32(q0), cutlass.Int32(s8), cutlass.Int32(q1)], "\n".join(body),
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def scaled_bf16x8(q0, q1, s8, scaled=True, *, loc=None, ip=None):
    """16 e2m1 nibbles (two words, value order) times their block's e4m3 scale byte ``s8``: eight bf16x2
    ``v * s * 2^-7``, in the order of ``scaled_f16x8`` (word 0's pairs (0,4), (1,5), (2,6), (3,7), then
    word 1's).

    Pair ``(i, i + 4)`` of a word: shifting by ``6 - 4i`` puts both magnitudes at bf16 bits 6..8 of their
    halves, shifting by ``12 - 4i`` both signs at bit 15; that is ``v * 2^-126``. The scale: the e4m3 byte to
    f16 (exact, subnormal scales included; the NaN bytes stay NaN), to fp32, times 2^119, packed to bf16x2
    (exact: 4 significant bits); one ``mul.rn.bf16x2`` a pair (bf16 subnormals are kept). ``scaled=False``
    (the ``late`` builds): ``v * 2^-126`` as it is, no scale read."""
    body = ["{", ".reg .b32 a, b, p, s;", ".reg .f32 f;", ".reg .b16 h, l, u;"]
    if scaled:
        body += ["cvt.u16.u32 h, $9;", "cvt.rn.f16x2.e4m3x2 s, h;", "mov.b32 {l, u}, s;", "cvt.f32.f16 f, l;",
                 "mul.rn.f32 f, f, 0f7B000000;", "cvt.rn.bf16x2.f32 p, f, f;"]
    for w, q in enumerate(("$8", "$10")):
        for i in range(4):
            o = f"${4 * w + i}"
            ms, ss = 6 - 4 * i, 12 - 4 * i
            body.append(f"shl.b32 a, {q}, {ms};" if ms >= 0 else f"shr.b32 a, {q}, {-ms};")
            body.append("and.b32 a, a, 0x01C001C0;")
            if ss:
                body.append(f"shl.b32 b, {q}, {ss};")
                body.append(f"lop3.b32 {o}, a, b, 0x80008000, 0xF8;")  # a | (b & c)
            else:
                body.append(f"lop3.b32 {o}, a, {q}, 0x80008000, 0xF8;")
            if scaled:
                body.append(f"mul.rn.bf16x2 {o}, {o}, p;")
    body.append("}")
    r = asm([T.i32()] * 8, [cutlass.Int32(q0), cutlass.Int32(s8), cutlass.Int32(q1)], "\n".join(body),
             "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", loc, ip)
    return [cutlass.Int32(v) for v in r]


@dsl_user_op
def scaled_bf16_chunk(q0, q1, q2, q3, s16, scaled=True, *, loc=None, ip=None):
    """W4A16's bf16 decode in the builds with ``dec``: a chunk's 32 e2m1 nibbles (four words, value order)
    times their two blocks' e4m3 scales (``s16``: block 0's byte low): sixteen bf16x2 ``v * s * 2^-7`` in
    ``scaled_bf16x8``'s order, block 0's eight words then block 1's (the same bits as two calls of it).

    Pair ``(i, i + 4)`` of a word in three operations: the two nibbles masked in place, one multiply by
    ``2^(6 - 4j) + 2^(12 - 4j)`` (``j = i % 2``) (two copies of each nibble, at bits 6..9 and 12..15 of its half: they do not
    overlap, so no carries), one AND keeping bits 6..8 (magnitude) and 15 (sign): the bf16 of ``v * 2^-126``.
    Pairs 2 and 3 take the word shifted right by 8 first (``mul.hi``, on the FMA pipe). The two scales convert
    together (one ``cvt.rn.f16x2.e4m3x2``). ``scaled=False`` (the ``late`` builds): ``v * 2^-126``, the same
    three operations a pair without the multiply, no scale read."""
    body = ["{", ".reg .b32 n, t, s, p0, p1, w8;", ".reg .f32 f;", ".reg .b16 h, l, u;"]
    if scaled:
        body += ["cvt.u16.u32 h, $20;", "cvt.rn.f16x2.e4m3x2 s, h;", "mov.b32 {l, u}, s;",
                 "cvt.f32.f16 f, l;", "mul.rn.f32 f, f, 0f7B000000;", "cvt.rn.bf16x2.f32 p0, f, f;",
                 "cvt.f32.f16 f, u;", "mul.rn.f32 f, f, 0f7B000000;", "cvt.rn.bf16x2.f32 p1, f, f;"]
    for w, q in enumerate(("$16", "$17", "$18", "$19")):
        p = "p0" if w < 2 else "p1"
        for i in range(4):
            o = f"${4 * w + i}"
            src = q if i < 2 else "w8"
            if i == 2:
                body.append(f"mul.hi.u32 w8, {q}, 16777216;")
            j = i % 2
            mask = 0x000F000F << (4 * j)
            mult = (1 << (6 - 4 * j)) + (1 << (12 - 4 * j))
            body += [f"and.b32 n, {src}, {mask:#010x};", f"mul.lo.u32 t, n, {mult};",
                     f"and.b32 {o}, t, 0x81C081C0;"]
            if scaled:
                body.append(f"mul.rn.bf16x2 {o}, {o}, {p};")
    body.append("}")
    r = asm([T.i32()] * 16, [cutlass.Int32(v) for v in (q0, q1, q2, q3, s16)], "\n".join(body),
            ",".join(["=r"] * 16 + ["r"] * 5), loc, ip)
    return [cutlass.Int32(v) for v in r]
