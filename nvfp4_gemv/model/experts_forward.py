"""The routed experts' computation (``NVFP4Experts.forward``): ``grouped_forward``, and on CUDA for decode
its kernel path ``decode_forward`` (``nvfp4_gemv.experts_op``). Arguments and storage: ``experts.py``.

The forward is ``grouped_forward``. On CUDA, up to ``DECODE_MAX_TOKENS`` tokens a call and for expert shapes
the kernel takes, it is ``decode_forward``: the experts' kernel (``nvfp4_gemv.experts_kernel``), two launches
that read each expert hit once a group of up to 8 tokens (32 with few experts: ``group_size``), the same
formula with each product exact in fp32 and alpha applied at its end (the W4A16 kernel's bound) instead of
the weights rounded to x's dtype first. Otherwise (the CPU, prefill) the fallback below. With W_e
the effective weight of expert e, ``dequantize(weight, weight_scale, alpha)`` rounded to x's dtype
(alpha = ``weight_scale_2``; in mode "w4a4" ``input_scale * weight_scale_2``, x first replaced by
``quantize_dequantized(x, 1 / input_scale)`` of its expert, exactly the W4A4 op's operand), each of the
S = T*k slots (t, j), expert e = top_k_index[t, j], computes

    g = x_t @ W_e(gate_up).T    (in x's dtype)     h = act_fn(g[:I]) * g[I:]    d = h @ W_e(down).T
    out_t = sum_j fp32(d_j * top_k_weights[t, j])   (one fp32 sum over the slots of t, rounded to x's dtype)

i.e. what a bf16 model whose expert weights are the dequantized values computes (``torch.bmm`` /
``torch._grouped_mm`` round each product once). Sync-free (routing read on the device only), fixed shapes
for a given T: capturable in a CUDA graph, no graph break under ``torch.compile(fullgraph=True)``.

Cost of the fallback (prefill on the GPU, said once by a warning): below E slots ("slot path", decode), each slot
gathers its expert's NVFP4 bytes and dequantizes them, so an expert hit by n slots is read and dequantized n
times (temporaries of about 12 bytes a weight, in chunks of slots of at most ``SLOT_PATH_BYTES``); from E slots on
("grouped path", prefill, x bf16), every expert is dequantized once and the slots, sorted by expert on the
device, go through ``torch._grouped_mm``. fp16 x always takes the slot path (``torch._grouped_mm`` takes
bf16): an fp16 prefill dequantizes each slot's expert, T*k times the grouped path's work.

Error bound (each product, against float64): |y - Y| <= ulp(y)/2 + K * 2^-24 * sum_k |x_k W_k| with Y the
exact product with the rounded weights W (fp32 accumulation in any order), and |W - w| <= 2^-8 |w|
(bf16; 2^-11 fp16) against the unrounded dequantized weight w; the combine within ulp/2 + k * 2^-24 *
sum_j |d_j w_j|. tests/model/test_experts.py checks each stage against float64 on random cases.
"""

import torch

from ..experts_op import can_implement, experts_gemv
from ..library import eager
from ..quant import BLOCK, _quantize_rows, dequantize, e2m1_decode


# ----------------------------------------------------------------------------------------------------
# The computation: one function, the GPU grouped kernel's place
# ----------------------------------------------------------------------------------------------------


def quantize_dequantized_rows(x, global_scale):
    """``quantize_dequantized(x[r:r+1], global_scale[r])`` for every row r at once (``nvfp4_gemv.quant``'s
    steps with a per-row global scale): x [R, K] bf16/fp16, global_scale fp32 [R] -> [R, K] in x's dtype."""
    q, scale = _quantize_rows(x, global_scale.to(torch.float32).reshape(-1, 1))
    return dequantize(q, scale).to(x.dtype)


_cc = {}  # device index -> (major, minor)


def _kernel_reads(w, ws):
    """Whether ``dequant_kernel`` takes these codes and scales: plain CUDA tensors outside any tracing or mode
    (``library.eager``: under torch.compile the torch ops below are traced instead, since a kernel launched by
    its data pointers cannot be, and inductor fuses those ops; fake tensors have no data), an sm_90+ device
    (the decode's ``cvt ... e4m3x2``), dense 8-byte aligned code rows, fewer than 2^31 blocks."""
    if not (w.is_cuda and eager(w, ws) and w.is_contiguous() and ws.is_contiguous()):
        return False
    dev = w.device.index
    cc = _cc.get(dev)
    if cc is None:
        cc = _cc[dev] = torch.cuda.get_device_capability(dev)
    p, n, half = w.shape
    return cc >= (9, 0) and w.data_ptr() % 8 == 0 and (2 * half) % BLOCK == 0 and p * n * (2 * half // BLOCK) < 2 ** 31


def _weights(w, ws, alpha, dtype):
    """``dequantize(w, ws) * alpha`` (fp32, the same operations as ``quant.dequantize`` with a scale_2)
    rounded to ``dtype``: w [P, N, K/2], ws [P, N, K/16], alpha [P] -> [P, N, K]. On CUDA ``e2m1 * scale``
    comes from ``dequant_kernel`` in bf16 (exact: at most 6 significant bits), multiplied by alpha in fp32, so
    the bits are those of the torch ops, in two passes instead of about ten (8 bytes of temporaries a
    weight); else bytes decode through a 256-entry table of value pairs made on the device (``e2m1_decode``
    of every byte; no host copy)."""
    p, n, half = w.shape
    if _kernel_reads(w, ws):
        from .. import dequant_kernel

        vals = torch.empty((p * n, 2 * half), dtype=torch.bfloat16, device=w.device)
        dequant_kernel.dequantize_cuda(w.reshape(p * n, half), ws.reshape(p * n, 2 * half // BLOCK), vals, 2 * half)
        # (bf16 times the fp32 alpha is computed in fp32: the same bits as widening first, without an fp32 copy)
        return (vals.reshape(p, n, 2 * half) * alpha.reshape(p, 1, 1)).to(dtype)
    pairs = e2m1_decode(torch.arange(256, dtype=torch.uint8, device=w.device).reshape(1, 256)).reshape(256, 2)
    v = pairs[w.long()].reshape(p, n, 2 * half // BLOCK, BLOCK) * ws.to(torch.float32).unsqueeze(-1)
    return (v.reshape(p, n, 2 * half) * alpha.reshape(p, 1, 1)).to(dtype)


SLOT_PATH_BYTES = 1 << 28  # the slot path's temporaries a chunk of slots, at most (12 bytes a weight: below)


def _products(xs, ids, route, w, ws, alpha, x_scale):
    """Each slot's row of xs times its expert's weight: [S, K] -> [S, N] in xs' dtype."""
    if x_scale is not None:  # mode w4a4: x on the NVFP4 grid of its expert's input scale
        xs = quantize_dequantized_rows(xs, x_scale[ids])
    if route is None:  # slot path: each slot's expert gathered and dequantized, in chunks of slots
        # (at the peak of _weights about 12 bytes a weight: the int64 byte indices of the pairs, two fp32
        # temporaries and the rounding; an fp16 prefill of 4096 slots would otherwise hold tens of GB at once).
        # The chunk count follows from shapes only: no sync, the same graph.
        s, n, k = xs.shape[0], w.shape[1], 2 * w.shape[2]
        step = max(1, SLOT_PATH_BYTES // (12 * n * k))
        parts = [torch.bmm(_weights(w[c], ws[c], alpha[c], xs.dtype), xs[i:i + step].unsqueeze(-1)).squeeze(-1)
                 for i in range(0, s, step) for c in (ids[i:i + step],)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    order, offs, inverse = route  # grouped path: every expert once, slots sorted by expert
    y = torch._grouped_mm(xs[order], _weights(w, ws, alpha, xs.dtype).transpose(1, 2), offs=offs)
    return y[inverse]


def grouped_forward(x, top_k_index, top_k_weights, gate_up, down, act_fn):
    """The experts' output for tokens ``x`` [T, H] routed by ``top_k_index`` / ``top_k_weights`` [T, k]
    (the module docstring's formula and bound). ``gate_up`` and ``down``: ``(weight uint8 [E, N, K/2],
    weight_scale e4m3 [E, N, K/16], alpha fp32 [E], x_scale fp32 [E] or None)``, alpha the product's scale
    (``weight_scale_2``, times ``input_scale`` in mode w4a4), x_scale the global scale x is quantized with
    (``1 / input_scale``; None: x as it is). No host sync; inputs are not validated here (``NVFP4Experts``
    does, from metadata). A GPU grouped kernel replaces this function, same arguments and result."""
    t, h = x.shape
    k = top_k_index.shape[1]
    e = gate_up[0].shape[0]
    if t * k == 0:
        return x.new_zeros((t, h))
    if x.is_cuda and experts_kernel_takes(t, gate_up, down):
        return decode_forward(x, top_k_index, top_k_weights, gate_up, down, act_fn)
    ids = top_k_index.reshape(-1)
    valid = (ids >= 0) & (ids < e)
    ids = torch.where(valid, ids, torch.zeros((), dtype=ids.dtype, device=ids.device)).long()
    route = None
    if t * k >= e and x.dtype == torch.bfloat16:  # dequantize every expert once: the grouped path
        key = torch.where(valid, ids, torch.full((), e, dtype=ids.dtype, device=ids.device))
        order = torch.argsort(key, stable=True)
        offs = torch.searchsorted(key[order], torch.arange(e, device=ids.device), right=True).to(torch.int32)
        route = (order, offs, torch.argsort(order))
    xs = x.unsqueeze(1).expand(t, k, h).reshape(t * k, h)
    g = _products(xs, ids, route, *gate_up)
    i = g.shape[1] // 2
    d = _products(act_fn(g[:, :i]) * g[:, i:], ids, route, *down)
    return combine(d, top_k_weights, valid, x.dtype)


# ----------------------------------------------------------------------------------------------------
# Decode on the GPU: the experts' kernel
# ----------------------------------------------------------------------------------------------------


DECODE_MAX_TOKENS = 64  # tokens a call up to which the GPU takes the experts' kernel (prefill: the fallback)
# tokens a call up to which W4A16 SiLU experts compute silu(gate) * up inside the down launch (experts_op's
# ``act``: no launch of its own); 1: the one-token route already copies x into shared memory, where the act is
# made. Past it the act needs that copy forced on a route measured without it (not yet measured: results.md),
# and x's rows must fit shared memory (Mixtral's down launch, K = 14336, does not at 8 tokens a group)
ACT_IN_KERNEL_MAX_TOKENS = 1
# tokens a call up to which the gate/up launch asks the L2 for the down launch's bytes of each expert it reads
# (experts_op's ``prefetch``). 0: never. The prediction was that at one token both launches are latency-bound
# and the down launch would find its bytes in the L2; measured 2026-12-07 on an H100 (Qwen3-30B-A3B's block,
# one token, rounds alternating) it is slower: the two launches alone 20.3 -> 23.2 us, the compiled block
# 28.7 -> 31.7 us (the gate/up launch then pulls down's 6 MB through DRAM beside its own 12 MB, and the down
# launch's time is not its DRAM latency). Kept as the op's option for other parts and shapes
# (``tools/bench_moe.py`` times the block both ways at one token); docs/results.md
PREFETCH_DOWN_MAX_TOKENS = 0


def kernel_act(act_fn):
    """The experts op's ``act`` for ``act_fn`` ("silu" for torch's ``SiLU``, transformers' ``SiLUActivation``
    and ``F.silu``), else None (the act then runs as torch ops between the launches)."""
    if act_fn is torch.nn.functional.silu or type(act_fn) is torch.nn.SiLU \
            or type(act_fn).__name__ == "SiLUActivation":
        return "silu"
    return None


def experts_kernel_takes(t, gate_up, down):
    """Whether a call of ``t`` tokens takes the experts' kernel (metadata only): decode-sized, and both
    matrices in shapes and layouts it takes (``experts_op.can_implement``; contiguous, as loaded: a TP shard's
    slice of them is not)."""
    if t > DECODE_MAX_TOKENS:
        return False
    for w, ws, alpha, _ in (gate_up, down):
        if not (can_implement(w.shape[1], 2 * w.shape[2]) and w.is_contiguous() and ws.is_contiguous()
                and alpha.is_contiguous()):
            return False
    return True


def group_size(t, k, e):
    """Token rows a group of the experts' kernel takes: the tokens (at most 8: the kernel's 8-token MMA tile
    costs the same for 1..8) unless the slots an expert expects, 2 t k / e, pass 8 (few experts: Mixtral's 8
    at 16 tokens and more): then up to 32, the kernel's most."""
    want = max(8, 2 * t * k // e)
    nt = 8
    while nt < want and nt < 32:
        nt *= 2
    return min(t, nt)


def slot_groups(top_k_index, e, nt):
    """The slots (t, j) of a call, sorted by expert (stable) and cut into groups of at most ``nt`` slots of
    one expert, on the device with fixed shapes: ``(order, row, ids, valid)`` with ``order`` the slots in
    sorted order (flat indices t * k + j), ``row[i]`` the row (group * nt + place) of sorted slot i, ``ids``
    int32 [G] each group's expert (-1: none; slots of ids outside [0, E) form groups of their own, unused),
    ``valid`` [S] whether a slot's id is in [0, E). G = min(S, E + 1 + S // nt) bounds the groups: a key of c
    slots takes ceil(c / nt) <= 1 + c / nt of them."""
    ids = top_k_index.reshape(-1)
    s, dev = ids.shape[0], ids.device
    valid = (ids >= 0) & (ids < e)
    key = torch.where(valid, ids, torch.full((), e, dtype=ids.dtype, device=dev)).long()
    order = torch.argsort(key, stable=True)
    skey = key[order]
    pos = torch.arange(s, device=dev)
    new_key = torch.ones(s, dtype=torch.bool, device=dev)
    new_key[1:] = skey[1:] != skey[:-1]
    first = torch.cummax(torch.where(new_key, pos, torch.zeros((), dtype=pos.dtype, device=dev)), 0).values
    place = (pos - first) % nt
    group = torch.cumsum((place == 0).long(), 0) - 1
    n_groups = min(s, e + 1 + s // nt)
    gid = torch.full((n_groups,), -1, dtype=torch.int32, device=dev)
    gid.scatter_(0, group, torch.where(skey < e, skey, torch.full((), -1, dtype=skey.dtype, device=dev)).to(torch.int32))
    return order, group * nt + place, gid, valid


def busy_groups(t, k, e, nt):
    """About how many groups have an expert: the experts t tokens of k distinct experts each hit (uniform
    routing), plus the groups that tokens past nt an expert add; from 4 tokens, half that (twice the CTAs an
    expert: measured faster at 4 and 16 tokens, slower at one; docs/results.md, the MoE block)."""
    hit = e * (1 - (1 - min(k, e) / e) ** t)
    busy = hit + max(0, t * k - hit * nt) / nt
    return max(1, min(t * k, round(busy / 2 if t >= 4 else busy)))


def decode_groups(x, top_k_index, e, nt, x_scale=None):
    """What the experts' first launch reads for a call: ``(xg, gid, at, valid)`` with ``xg`` [G * nt, H] the
    groups' token rows (``x_scale``: each quantized with its expert's input scale, mode w4a4), ``gid`` int32
    [G] each group's expert (-1: none; at one token int64 ids as they are, below), ``at`` [S] each slot's row
    of the launches' results in slot order (None: row s is slot s), ``valid`` [S] whether a slot's id is in [0, E). One token skips the sort: its
    k slots are the groups in slot order (a token's experts are distinct; a repeated one is read again) and,
    without ``x_scale``, every group reads x's one row; int64 ids (transformers' routers') are then ``gid``
    as they are (the kernel takes an id outside [0, E) as no expert: no kernel makes int32 ids)."""
    ids = top_k_index.reshape(-1)
    if x.shape[0] == 1:
        valid = (ids >= 0) & (ids < e)
        if ids.dtype == torch.int64:
            gid = ids.contiguous()
        else:
            gid = torch.where(valid, ids, torch.full((), -1, dtype=ids.dtype, device=ids.device)).to(torch.int32)
        if x_scale is not None:
            x = quantize_dequantized_rows(x.expand(ids.shape[0], -1), x_scale[ids.clamp(0, e - 1)])
        return x.contiguous(), gid, None, valid
    order, row, gid, valid = slot_groups(top_k_index, e, nt)
    xs = x[order // top_k_index.shape[1]]
    if x_scale is not None:
        xs = quantize_dequantized_rows(xs, x_scale[ids[order].clamp(0, e - 1)])
    xg = x.new_zeros((gid.shape[0] * nt, x.shape[1]))  # (rows past a group's slots: never read back)
    xg[row] = xs
    at = torch.empty_like(row)
    at[order] = row
    return xg, gid, at, valid


def decode_forward(x, top_k_index, top_k_weights, gate_up, down, act_fn):
    """``grouped_forward`` through the experts' kernel (``experts_op``): the slots sorted by expert into
    groups of at most ``group_size`` token rows (``decode_groups``), gate/up then ``act_fn(gate) * up`` then
    down, each one launch that reads every expert hit once a group, and the combine of ``grouped_forward``.
    Sync-free. Up to ``PREFETCH_DOWN_MAX_TOKENS`` tokens (default none: measured slower) the gate/up launch asks
    the L2 for the down launch's bytes of its experts. Up to ``ACT_IN_KERNEL_MAX_TOKENS`` tokens W4A16 SiLU
    experts make ``silu(gate) * up`` in the down launch (rounded once to x's dtype from fp32, as inductor's fused ``F.silu(g) * u``; eager torch rounds
    ``silu(g)`` first).

    Its products differ from the fallback's: exact products of x and the NVFP4 weights summed in fp32, alpha
    applied once at the end (the W4A16 kernel's bound), where the fallback rounds each weight times alpha to
    x's dtype first."""
    t, h = x.shape
    k = top_k_index.shape[1]
    e = gate_up[0].shape[0]
    nt = group_size(t, k, e)
    busy = busy_groups(t, k, e, nt)
    w, ws, alpha, x_scale = gate_up
    xg, gid, at, valid = decode_groups(x, top_k_index, e, nt, x_scale)
    pf = (down[0], down[1]) if t <= PREFETCH_DOWN_MAX_TOKENS else None
    g = experts_gemv(xg, gid, w, ws.view(torch.float8_e4m3fn), alpha, nt, busy, prefetch=pf)
    w, ws, alpha, x_scale = down
    act = kernel_act(act_fn) if x_scale is None and t <= ACT_IN_KERNEL_MAX_TOKENS else None
    if act is not None:  # the down launch reads g's [gate | up] rows and makes the act itself
        d = experts_gemv(g, gid, w, ws.view(torch.float8_e4m3fn), alpha, nt, busy, act)
    else:
        i = g.shape[1] // 2
        hid = act_fn(g[:, :i]) * g[:, i:]
        if x_scale is not None:  # (rows of groups without an expert: any scale, never read back)
            hid = quantize_dequantized_rows(hid, x_scale[gid.clamp(0, e - 1).long().repeat_interleave(nt)])
        d = experts_gemv(hid.contiguous(), gid, w, ws.view(torch.float8_e4m3fn), alpha, nt, busy)
    if at is not None:
        d = d[at]
    return combine(d, top_k_weights, valid, x.dtype)


def combine(d, top_k_weights, valid, dtype):
    """Each token's output from its slots' down products ``d`` [T * k, H] (slot order): one fp32 sum over
    its slots of ``d * weight``, a slot whose id is not in [0, E) adding nothing (its row of ``d`` may hold
    anything), rounded to ``dtype``."""
    t, k = top_k_weights.shape
    c = d.to(torch.float32) * top_k_weights.reshape(-1, 1).to(torch.float32)
    c = torch.where(valid.unsqueeze(1), c, torch.zeros((), dtype=c.dtype, device=c.device))
    return c.reshape(t, k, -1).sum(dim=1).to(dtype)
