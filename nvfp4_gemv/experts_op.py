"""``experts_gemv``: a mixture-of-experts layer's W4A16 products in decode, every group of token rows times its
own expert's NVFP4 weight in one launch (``experts_kernel``), ``torch.ops.nvfp4.experts_gemv`` for
torch.compile, with an exact CPU path.

    out[g * NT + n, :] = alpha[e] * x[g * NT + n, :] @ (w[e] * ws[e]).T     for e = ids[g] in [0, E), n < NT

With ``act="silu"`` (the down launch of SwiGLU experts) ``x`` holds rows of 2K values, ``[gate | up]``, and the
product takes ``silu(gate) * up`` (rounded once to x's dtype) in their place: ``act(gate) * up`` made while the
kernel copies x, not by a launch of its own.

With ``prefetch=(w2, w2_scale)`` (another experts weight, the down launch's, of as many experts) the launch also
asks the L2 for each group's expert's bytes of ``w2`` and ``w2_scale``, so that the launch that reads them next
finds them there (a hint: the results are the same with or without it; measured slower at one token on an
H100, so ``decode_forward`` leaves it off: docs/results.md).

Groups with a negative int32 id are skipped (an int32 id must be below E): on CUDA their rows of ``out`` are
not written (whatever was in memory), on the CPU they are NaN (so that a caller that reads them shows it).
``ids`` int64 (a router's ``top_k_index`` as it is) may hold any value: one outside [0, E) is skipped the same
way. The caller (``nvfp4_gemv.model.experts_forward``) builds the groups on the device: no host sync here, fixed shapes, CUDA-graph capturable.

Error bound (CUDA): the W4A16 kernel's (``w4a16``: half an ulp of the output plus (K / (16 W) + W + 3) * 2^-22
of the sum of |terms|); the CPU path rounds the float64 result once. With ``act`` the CPU path rounds the
float64 ``silu(gate) * up`` once to x's dtype; the kernel computes it in fp32 (``experts_kernel``), so a value
of it within a few fp32 ulps of a rounding midpoint of x's dtype may round the other way (one ulp of that
value, times its weights, added to the bound).
"""

import torch

from .launch import MAX_K, KernelCache, RecentPlans, current_device, current_stream, fail, keep_plan, sm_count
from .library import eager, fast_autograd
from .reference import reference_product
from .w4a16 import MAX_TOKENS

_X_DTYPES = (torch.bfloat16, torch.float16)
ACTS = ("silu",)  # what ``act`` takes (transformers' SiLU experts: Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3)
_SCALE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
WHO = "nvfp4_gemv.experts_gemv"


def can_implement(m, k):
    """Whether the kernel takes experts of [m, k] weights (rows M % 128 == 0, K % 64 == 0, K <= 32768)."""
    return m > 0 and m % 128 == 0 and k > 0 and k % 64 == 0 and k <= MAX_K


def _bad(exc, name, expected, got):
    fail(exc, name, expected, got, WHO)


def check_prefetch(w, prefetch, addresses=True):
    """``prefetch``: None or (w2, w2_scale), an experts weight of as many experts as ``w`` (no sync);
    ``addresses``: their alignment too (not of fake tensors, which have none)."""
    if prefetch is None:
        return
    if not isinstance(prefetch, (tuple, list)) or len(prefetch) != 2:
        _bad(TypeError, "prefetch", "None or a pair (w2, w2_scale) of tensors", type(prefetch).__name__)
    w2, s2 = prefetch
    for name, t in (("prefetch[0]", w2), ("prefetch[1]", s2)):
        if not isinstance(t, torch.Tensor):
            _bad(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.device != w.device:
            _bad(ValueError, name, f"a tensor on {w.device} (where w is)", f"one on {t.device}")
    e = w.shape[0]
    # (an expert's bytes: the kernel's 32-bit offsets into them)
    if w2.dtype != torch.uint8 or w2.dim() != 3 or w2.shape[0] != e or not w2.is_contiguous() or w2.shape[1] % 128 \
            or w2.shape[2] % 32 or not 0 < w2.shape[1] * w2.shape[2] < 2 ** 31 or (addresses and w2.data_ptr() % 16):
        _bad(ValueError, "prefetch[0]", f"a contiguous uint8 tensor [{e}, M2, K2/2] (M2 % 128 == 0, K2 % 64 == 0, both "
             "> 0, under 2^31 bytes an expert) at a 16-byte aligned address", f"{w2.dtype} {tuple(w2.shape)}")
    want = (e, w2.shape[1], w2.shape[2] // 8)
    if s2.dtype not in _SCALE_DTYPES or tuple(s2.shape) != want or not s2.is_contiguous() \
            or (addresses and s2.data_ptr() % 16):
        _bad(ValueError, "prefetch[1]", f"a contiguous float8_e4m3fn or uint8 tensor {list(want)} at a 16-byte "
             "aligned address", f"{s2.dtype} {tuple(s2.shape)}")


def check_args(x, ids, w, w_scale, alpha, n_tok, act=None):
    """Metadata checks (no sync); returns (groups, M, K)."""
    if act is not None and act not in ACTS:
        _bad(ValueError, "act", f"None or one of {ACTS}", repr(act))
    for name, t in (("x", x), ("ids", ids), ("w", w), ("w_scale", w_scale), ("alpha", alpha)):
        if not isinstance(t, torch.Tensor):
            _bad(TypeError, name, "a torch.Tensor", type(t).__name__)
        if t.device != w.device:
            _bad(ValueError, name, f"a tensor on {w.device} (where w is)", f"one on {t.device}")
    # (a SymInt under torch.compile with dynamic shapes: the fake's shape follows it; a real call gets an int)
    if isinstance(n_tok, bool) or not isinstance(n_tok, (int, torch.SymInt)) or not 1 <= n_tok <= MAX_TOKENS:
        _bad(ValueError, "n_tok", f"an int in 1..{MAX_TOKENS}", repr(n_tok))
    if w.dtype != torch.uint8 or w.dim() != 3 or not w.is_contiguous():
        _bad(ValueError, "w", "a contiguous uint8 tensor [E, M, K/2]", f"{w.dtype} {tuple(w.shape)}")
    e, m, half = w.shape
    k = 2 * half
    if not can_implement(m, k):
        _bad(ValueError, "w", "experts of M % 128 == 0 rows and K % 64 == 0 (K <= 32768) values",
             f"M={m}, K={k}")
    if w_scale.dtype not in _SCALE_DTYPES or tuple(w_scale.shape) != (e, m, k // 16) or not w_scale.is_contiguous():
        _bad(ValueError, "w_scale", f"a contiguous float8_e4m3fn or uint8 tensor [{e}, {m}, {k // 16}]",
             f"{w_scale.dtype} {tuple(w_scale.shape)}")
    if alpha.dtype != torch.float32 or tuple(alpha.shape) != (e,) or not alpha.is_contiguous():
        _bad(ValueError, "alpha", f"a contiguous float32 tensor [{e}]", f"{alpha.dtype} {tuple(alpha.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 1 or not ids.is_contiguous():
        _bad(ValueError, "ids", "a contiguous int32 or int64 tensor [groups]", f"{ids.dtype} {tuple(ids.shape)}")
    g = ids.shape[0]
    rows_ok = x.dim() == 2 and (x.shape[0] == g * n_tok or (n_tok == 1 and x.shape[0] == 1))
    kx = k if act is None else 2 * k  # act: [gate | up] rows
    if x.dtype not in _X_DTYPES or not rows_ok or x.shape[1] != kx or not x.is_contiguous():
        what = "K" if act is None else f"2K: gate then up, for act={act!r}"
        _bad(ValueError, "x", f"a contiguous bfloat16 or float16 tensor [{g * n_tok}, {kx}] (groups x n_tok, {what}; "
             f"with n_tok 1 also [1, {kx}], one row every group reads)", f"{x.dtype} {tuple(x.shape)}")
    return g, m, k


# ----------------------------------------------------------------------------------------------------
# CUDA: a plan per metadata
# ----------------------------------------------------------------------------------------------------


def _build(key):
    from .experts_kernel import compile_experts_w4a16

    _, k, nt, groups, x_bf16, tuning, act, prefetch, ids64 = key
    return compile_experts_w4a16(k, nt, groups, x_bf16, x_bf16, act=act, prefetch=prefetch, ids64=ids64,
                                 **dict(tuning))


_kernels = KernelCache(_build)
_plans = {}


FEW_CTAS_THREADS = 128  # a group's few CTAs at 8 tokens a group: 4 warps, not the plain route's 8 (below)
FEW_CTAS_GRID = 8


def launch_shape(n_tok, m, k, sms, busy):
    """(route, grid_x) of a launch where about ``busy`` groups have an expert: the plain W4A16 kernel's build
    for ``n_tok`` tokens on the experts' rows stacked (``busy * m`` rows), its grid shared by the groups.

    One rule of the experts' own (tools/tune_experts.py, session 76, one H100, Qwen3-30B-A3B at 16 tokens,
    one timing a build: docs/results.md): where the plain route gives 8 tokens a group 8-warp CTAs with x in
    registers and a group gets at most ``FEW_CTAS_GRID`` CTAs, 4-warp CTAs (gate/up 94 -> 74 us, down 61 -> 44
    us). Only that case was measured: other group sizes and builds (16 warps, x in shared memory) keep the
    plain route, whose builds were tuned for one matrix's wide grid."""
    from .w4a16 import Nvfp4GemvW4A16
    from .w4a16_route import W4A16Route, route

    busy = max(1, busy)
    r = route(n_tok, m * busy, k, sms)
    tiles = -(-(m // 8) // r.groups)

    def grid(tune):
        op = Nvfp4GemvW4A16(k, n_tok, r.groups, True, False, True, True, **tune)
        return max(1, min(tiles, -(-op.grid_x(m * busy, sms) // busy)))

    tune = dict(r.tuning)
    g = grid(tune)
    if n_tok == 8 and g <= FEW_CTAS_GRID and tune.get("threads") == 256 and not tune.get("x_smem"):
        few = {**tune, "threads": FEW_CTAS_THREADS}
        if Nvfp4GemvW4A16.can_implement(k, n_tok, r.groups, **few):
            return W4A16Route(r.tokens, r.groups, tuple(sorted(few.items()))), grid(few)
    return r, g


def act_tuning(tuning, act):
    """A route's tuning (``launch_shape``) for a launch with ``act``: x in shared memory, where the act is
    computed (``experts_kernel``), 4 copies of x in flight a thread (each holds gate and up: twice a plain
    copy's registers; at 8, Mixtral's down launch, K = 14336, spilled 48 bytes a thread)."""
    if act is None:
        return tuning
    return tuple(sorted({**dict(tuning), "x_smem": 1, "xbatch": 4}.items()))


class ExpertsPlan:
    def __init__(self, x, ids, w, n_tok, busy, dims, act=None, prefetch=None):
        g, m, k = dims
        self.dev = w.device.index
        self.shape = (g * n_tok, m)
        self.dtype = x.dtype
        self.device = w.device
        self.n_tok, self.busy, self.act, self.pf = n_tok, busy, act, prefetch is not None
        self.variants = ()  # (guard, hit) pairs: RecentPlans'
        r, grid_x = launch_shape(n_tok, m, k, sm_count(self.dev), busy)
        # (an expert's bytes of the prefetched weight and of its scales)
        pf = None if prefetch is None else tuple(t.shape[1] * t.shape[2] for t in prefetch)
        ids64 = w.shape[0] if ids.dtype == torch.int64 else 0  # (int64 ids: the build checks them against E)
        self.kern = _kernels.get(self.dev, ("experts", k, n_tok, r.groups, x.dtype == torch.bfloat16,
                                            act_tuning(r.tuning, act), act, pf, ids64))
        shared = x.shape[0] == 1 and g > 1  # one row every group reads (n_tok 1): row stride 0
        self.static = (m, k // 2, k // 16, 0 if shared else x.shape[1] * 2, g, 2 * m, grid_x)

    def __call__(self, x, ids, w, w_scale, alpha, prefetch=None):
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        if not self.shape[0]:  # no groups: nothing to launch
            return out
        ptrs = (w.data_ptr(), x.data_ptr(), w_scale.data_ptr(), ids.data_ptr(), out.data_ptr(), alpha.data_ptr())
        args = self.static if prefetch is None else (*self.static, prefetch[0].data_ptr(), prefetch[1].data_ptr())
        kern = self.kern
        if kern.ffi is not None and current_device() == self.dev:
            kern.ffi(*ptrs, *args, current_stream(self.dev))
        else:
            with torch.cuda.device(self.dev):
                kern.launch_dsl((*ptrs, *args), current_stream(self.dev))
        return out

    def hit_path(self, check):
        """The op's call for tensors with exactly this plan's metadata (``check``: the plan's C++ guard of the
        five tensors' types, dtypes, devices, sizes and strides), ``n_tok`` and ``busy``, at aligned addresses;
        None otherwise (the call then takes ``_run``'s key, which raises for what the op cannot take). What
        the key costs in Python (about 4 us a call on a slow host), the guard checks in C++ (about 0.5)."""
        n_tok, busy, act, pf, plan = self.n_tok, self.busy, self.act, self.pf, self

        def call(x, ids, w, w_scale, alpha, nt, b, a, prefetch=None):
            if nt != n_tok or b != busy or a != act or (prefetch is not None) != pf:
                return None
            try:
                # a strided nested tensor aborts the guard's stride read: tested first
                if x.is_nested or ids.is_nested or w.is_nested or w_scale.is_nested or alpha.is_nested:
                    return None
                if pf:  # the guard covers the two prefetched tensors too (the plan's variant filed with them)
                    w2, s2 = prefetch
                    if w2.is_nested or s2.is_nested or not check(x, ids, w, w_scale, alpha, w2, s2) \
                            or (w2.data_ptr() | s2.data_ptr()) & 15:
                        return None
                elif not check(x, ids, w, w_scale, alpha):
                    return None
                if (x.data_ptr() | w.data_ptr()) & 15 or w_scale.data_ptr() & 1:
                    return None
            except (TypeError, AttributeError, ValueError):  # not tensors, or not a pair
                return None
            return plan(x, ids, w, w_scale, alpha, prefetch)

        return call


def _key(x, ids, w, w_scale, alpha, n_tok, busy, act, prefetch=None):
    """Everything a plan depends on (addresses: their alignment is in the key, checked once a plan)."""
    pf = None if prefetch is None else tuple((type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)
                                             for t in prefetch)
    return (x.shape, x.stride(), x.dtype, ids.shape, ids.stride(), ids.dtype, w.shape, w.stride(), w.dtype, w.device,
            w_scale.shape, w_scale.stride(), w_scale.dtype, alpha.shape, alpha.stride(), alpha.dtype, n_tok, busy, act,
            (x.data_ptr() | w.data_ptr()) % 16, w_scale.data_ptr() % 2,
            tuple(t.device for t in (x, ids, w_scale, alpha)), pf)


# a model's step calls the op with the same weight tensors every token: a hit by w's identity (behind the
# plan's C++ guard) skips the key
_recent = RecentPlans()


def _run(x, ids, w, w_scale, alpha, n_tok, busy, act=None, prefetch=None):
    if not w.is_cuda:
        dims = check_args(x, ids, w, w_scale, alpha, n_tok, act)
        check_prefetch(w, prefetch)  # (a hint: nothing to do on the CPU)
        return _cpu(x, ids, w, w_scale, alpha, n_tok, dims, act)
    hit = _recent.hits.get(id(w))
    if hit is not None:
        res = hit(x, ids, w, w_scale, alpha, n_tok, busy, act, prefetch)
        if res is not None:
            return res
    if prefetch is not None:  # (named before the key reads its tensors' metadata)
        check_prefetch(w, prefetch, addresses=False)
    key = _key(x, ids, w, w_scale, alpha, n_tok, busy, act, prefetch)
    plan = _plans.get(key)
    if plan is None:
        dims = check_args(x, ids, w, w_scale, alpha, n_tok, act)
        check_prefetch(w, prefetch)
        if x.data_ptr() % 16 or w.data_ptr() % 16 or w_scale.data_ptr() % 2:
            _bad(ValueError, "x", "x and w at 16-byte aligned addresses, w_scale at an even one",
                 f"addresses {x.data_ptr():#x}, {w.data_ptr():#x}, {w_scale.data_ptr():#x}")
        plan = keep_plan(_plans, key, ExpertsPlan(x, ids, w, n_tok, busy, dims, act, prefetch))
    _recent.add(w, (x, ids, w, w_scale, alpha) + (() if prefetch is None else tuple(prefetch)), plan)
    return plan(x, ids, w, w_scale, alpha, prefetch)


def silu_mul_exact(x, k):
    """``silu(gate) * up`` of rows ``[gate | up]`` (K values each) in float64, rounded once to x's dtype."""
    gate, up = x[:, :k].double(), x[:, k:].double()
    return (gate / (1 + torch.exp(-gate)) * up).to(x.dtype)


def _cpu(x, ids, w, w_scale, alpha, n_tok, dims, act=None):
    """The exact path: each group's rows through the op's float64 reference, rounded once (with ``act``,
    ``silu(gate) * up`` rounded once first)."""
    g, m, k = dims
    if act is not None:
        x = silu_mul_exact(x, k)
    # rows of groups without an expert: NaN, as unknown as the kernel's unwritten rows (a caller must not read them)
    out = torch.full((g * n_tok, m), float("nan"), dtype=x.dtype, device=x.device)
    for grp, e in enumerate(ids.tolist()):
        if e >= 0 and (ids.dtype == torch.int32 or e < w.shape[0]):  # (int32 E or past: w[e] names it)
            rows = slice(grp * n_tok, (grp + 1) * n_tok)
            xr = x if x.shape[0] == 1 else x[rows]  # (one row every group reads)
            out[rows] = reference_product((n_tok, m, k, False, False), xr, None, w[e], w_scale[e],
                                          alpha[e:e + 1], x.dtype)
    return out


@torch.library.custom_op("nvfp4::experts_gemv", mutates_args=())
def _experts_gemv_op(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     alpha: torch.Tensor, n_tok: int, busy: int, act: str = "", pf_w: torch.Tensor | None = None,
                     pf_scale: torch.Tensor | None = None) -> torch.Tensor:
    return _run(x, ids, w, w_scale, alpha, n_tok, busy, act or None, None if pf_w is None else (pf_w, pf_scale))


@_experts_gemv_op.register_fake
def _experts_gemv_fake(x, ids, w, w_scale, alpha, n_tok, busy, act="", pf_w=None, pf_scale=None):
    g, m, _ = check_args(x, ids, w, w_scale, alpha, n_tok, act or None)
    check_prefetch(w, None if pf_w is None else (pf_w, pf_scale), addresses=False)
    return x.new_empty((g * n_tok, m))


fast_autograd(_experts_gemv_op)


def experts_gemv(x, ids, w, w_scale, alpha, n_tok, busy=1, act=None, prefetch=None):
    """Every group's ``n_tok`` rows of ``x`` times its expert's weight (module docstring).

    :param x: [G * n_tok, K] bf16 or fp16, contiguous: group g's rows g * n_tok ... (g + 1) * n_tok - 1;
        with ``n_tok`` 1 also [1, K]: one row every group reads (one token's experts). With ``act`` rows of
        2K values, gate then up.
    :param ids: int32 [G]: each group's expert, or a negative number (no expert: its rows are not computed);
        or int64 [G], any value, one outside [0, E) being no expert (a router's ``top_k_index`` as it is).
    :param w, w_scale: the experts' NVFP4 weights, uint8 [E, M, K/2] and e4m3 [E, M, K/16], contiguous.
    :param alpha: fp32 [E], each expert's scale of the product.
    :param n_tok: token rows a group, 1..32.
    :param busy: about how many groups have an expert (the launch shares the GPU among them; any value is
        correct).
    :param act: None, or "silu": the product takes ``silu(gate) * up`` of x's rows (module docstring).
    :param prefetch: None, or (w2, w2_scale): an experts weight [E, M2, K2/2] and its scales [E, M2, K2/16]
        (contiguous, 16-byte aligned) whose bytes of each group's expert the launch asks the L2 for, for the
        launch that reads them next (module docstring; the results do not depend on it).
    :return: [G * n_tok, M] in x's dtype.
    """
    if eager(x, ids, w, w_scale, alpha, *(prefetch if isinstance(prefetch, (tuple, list)) else ())):
        return _run(x, ids, w, w_scale, alpha, n_tok, busy, act, prefetch)
    if not torch.compiler.is_compiling():  # our error naming the argument, not the dispatcher's
        check_args(x, ids, w, w_scale, alpha, n_tok, act)
        check_prefetch(w, prefetch, addresses=False)  # (fake tensors reach here: the op checks addresses)
    pf_w, pf_scale = (None, None) if prefetch is None else prefetch
    return torch.ops.nvfp4.experts_gemv(x, ids, w, w_scale, alpha, n_tok, busy, act or "", pf_w, pf_scale)

