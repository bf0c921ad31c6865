"""A slow, scalar NVFP4 quantizer in Python floats (the specification of nvfp4_gemv.quant, value by value),
independent of the vectorized torch code it checks: fp32 rounding by struct, e4m3 and e2m1 by nearest
search over their value tables. Small inputs only."""

import math
import struct

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def f32(v):
    """A Python float rounded to the nearest fp32 (ties to even), overflowing to inf."""
    if math.isnan(v) or math.isinf(v):
        return v
    try:
        return struct.unpack("<f", struct.pack("<f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def e4m3_value(b):
    """The value of an e4m3fn byte (0x00..0x7E positive finite; bit 7 the sign)."""
    e, m = (b >> 3) & 0xF, b & 7
    v = m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -v if b & 0x80 else v


E4M3_POSITIVE = [e4m3_value(b) for b in range(0x7F)]


def e4m3_byte(v):
    """Nearest e4m3 byte, ties to an even mantissa, saturating at 448; NaN -> 0x7F."""
    if math.isnan(v):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    a = min(abs(v), 448.0)
    best = min(range(0x7F), key=lambda b: (abs(a - E4M3_POSITIVE[b]), b & 1))
    return best | sign


def e2m1_code(q):
    """Magnitude code (0..7) of the e2m1 value nearest |q|, ties to even, saturating; NaN -> 0."""
    if math.isnan(q):
        return 0
    a = abs(q)
    if a >= 6.0:
        return 7
    return min(range(8), key=lambda c: (abs(a - E2M1[c]), c & 1))


def quantize(values, signs, gs):
    """``values``: rows of Python floats (K a multiple of 16); ``signs``: their sign bits; ``gs``: float.
    :return: (rows of packed bytes, rows of scale bytes)."""
    q_rows, s_rows = [], []
    for row, sign_row in zip(values, signs):
        codes, scales = [], []
        for b0 in range(0, len(row), 16):
            blk = row[b0:b0 + 16]
            amax = math.nan if any(math.isnan(v) for v in blk) else max(abs(v) for v in blk)
            sb = e4m3_byte(f32(f32(amax * gs) / 6.0))
            sd = math.nan if sb == 0x7F else e4m3_value(sb)
            scales.append(sb)
            for v, neg in zip(blk, sign_row[b0:b0 + 16]):
                mag = 0 if sd == 0 else e2m1_code(f32(f32(v * gs) / sd))
                codes.append(mag | (8 if neg else 0))
        q_rows.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        s_rows.append(scales)
    return q_rows, s_rows


def quantize_weight(values, signs):
    """NVIDIA's weight recipe value by value. :return: (packed rows, scale rows, weight_scale_2)."""
    amax = max(abs(v) for row in values for v in row)
    ws2 = f32(amax / 2688.0)
    q_rows, s_rows = [], []
    for row, sign_row in zip(values, signs):
        codes, scales = [], []
        for b0 in range(0, len(row), 16):
            blk = row[b0:b0 + 16]
            bamax = max(abs(v) for v in blk)
            sb = e4m3_byte(0.0 if ws2 == 0 else f32(f32(bamax / 6.0) / ws2))
            denom = f32(e4m3_value(sb) * ws2)
            scales.append(sb)
            for v, neg in zip(blk, sign_row[b0:b0 + 16]):
                mag = 0 if denom == 0 else e2m1_code(f32(v / denom))
                codes.append(mag | (8 if neg else 0))
        q_rows.append([codes[i] | (codes[i + 1] << 4) for i in range(0, len(codes), 2)])
        s_rows.append(scales)
    return q_rows, s_rows, ws2
