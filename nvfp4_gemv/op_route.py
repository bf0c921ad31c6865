"""Which of the W4A4 op's kernels takes a call, and how (``nvfp4_gemv.gemv`` with NVFP4 x on CUDA): the op's
routing in one place, as ``tuning.py`` holds ``custom_kernel``'s. ``route`` answers with a frozen ``OpRoute``;
each kernel class answers ``can_implement`` for its own limits (and a tuning's knobs) and the router asks it. The measurements
behind the cuts are in docs/results.md ("The op for model code").

* the tensor-core kernel (``nvfp4_gemv.mma``, ``mma.sync`` on exact f16 operands, ``MMA_TOKENS`` tokens a
  pass over ``w``) from 5 tokens on where its 8-row groups fill the GPU (``use_mma``);
* the bulk-copy dp4a kernel (``nvfp4_gemv.tokens_bulk``) for 1-3 tokens, and 4 at K = 16384, where ``w``'s
  scales are plain with 16-byte aligned rows, K % 1024 == 0, K <= 16384 and K >= 2048 for one token
  (``use_bulk``, ``bulk_tuning``);
* else the dp4a kernel (``nvfp4_gemv.tokens``), ``w`` read once for each group of tokens whose decoded
  copies fit shared memory (``token_group``).

A caller's ``tuning`` (tests, benchmarks) names one kernel: ``bulk=1`` or ``mma=1``; other keys tune the
dp4a kernel, except the tensor-core kernel's ``groups``.
"""

from dataclasses import dataclass

from .mma import MAX_GROUPS, Nvfp4GemvMma
from . import op_kernel
from .tokens import Nvfp4GemvTokens
from .tokens_bulk import Nvfp4GemvTokensBulk

MMA_TOKENS = 16  # tokens a launch of the tensor-core kernel takes


def token_group(n, k):
    """Tokens a launch takes: all ``n`` where their decoded copies fit shared memory, else equal groups."""
    cap = max(1, Nvfp4GemvTokens.max_tokens(k))
    launches = -(-n // cap)
    return -(-n // launches)


def use_mma(n, m, sms):
    """The tensor-core kernel (``nvfp4_gemv.mma``) from 5 tokens on where its 8-row groups fill the GPU; the
    dp4a kernel (``nvfp4_gemv.tokens``) below and for short weights. On H200 the dp4a kernel was faster at
    N = 3 and (on one of two shapes) 4, the tensor-core kernel far faster at N = 8; N = 5..7 were not measured,
    so the cut at 5 is interpolated (docs/results.md)."""
    return n >= 5 and m // 8 >= sms


def bulk_tuning(n, m, k):
    """CTAs a SM and rows a thread for the bulk-copy kernel, as measured fastest on H200 (docs/results.md). At
    K = 16384, 3-4 tokens: one CTA a SM, each thread on 4 rows of a stage (faster than two CTAs of one row a
    thread, and than the dp4a kernel). Else two CTAs, except at 3 tokens on short weights (M < 2048), where one
    was faster."""
    if n >= 3 and k == 16384:
        return {"ctas": 1, "rt": 4}
    return {"ctas": 2 if n <= 2 or m >= 2048 else 1}


def use_bulk(n, m, k):
    """The bulk-copy dp4a kernel (``nvfp4_gemv.tokens_bulk``) for 1-3 tokens, and 4 at K = 16384, where its
    rows split into whole warps (K % 1024 == 0), K <= 16384 (the range measured; above it the two-CTA builds
    spill on DSL 4.3.5 from K = 19456) and K >= 2048 for one token. On H200 it beat the dp4a kernel at N = 1..4
    on 7168x16384 and on most of 15 shapes from 256x16384 to 14336x4096 at N <= 3; it lost at N = 1 with
    K = 1024, on a few shapes at N = 2 and 3, and at N = 4 on 4096x7168 while it won there on 2048x7168: 4
    tokens elsewhere stay on dp4a (docs/results.md)."""
    if k % 1024 or k > 16384 or n > 4 or (n == 1 and k < 2048) or (n == 4 and k != 16384):
        return False
    return Nvfp4GemvTokensBulk.can_implement(k, n, **bulk_tuning(n, m, k))


@dataclass(frozen=True)
class OpRoute:
    """One call's kernel and launches: ``kernel`` "mma", "bulk" or "tokens"; ``tokens`` a launch (the last
    launch takes the rest); ``groups`` the tensor-core kernel's row groups; ``tuning`` the kernel's build
    options as sorted ``(key, value)`` pairs; ``forced``: the caller named the bulk-copy kernel (a w_scale off
    16 bytes is then an error, not a fall back to the dp4a kernel)."""

    kernel: str
    tokens: int
    groups: int
    tuning: tuple
    forced: bool = False

    @property
    def ws_mask(self):
        """Address bits of w_scale that must be zero: bulk copies read 16-byte aligned rows, the others pairs."""
        return 15 if self.kernel == "bulk" else 1


def mma_groups(m, sms):
    """Groups of 8 rows a CTA of the tensor-core kernel owns at a time, 1..``MAX_GROUPS`` (``pick_groups``'
    model: the H200 measurements ran what it picks, 7 groups for M = 7168 and 4 for 4096 on 132 SMs; other
    counts not measured)."""
    return op_kernel.pick_groups(m, sms, range(1, MAX_GROUPS + 1))


def route(n, m, k, sms, copyable, tuning=()):
    """The ``OpRoute`` for ``n`` tokens of x against an [m, k] weight on ``sms`` SMs; ``copyable``: w's
    scales are plain with 16-byte row strides (what bulk copies need). ``tuning``: a caller's
    ``(key, value)`` pairs (module docstring). :raises ValueError: for a tuning no kernel can take."""
    tuning = dict(tuning)
    forced, mma = tuning.pop("bulk", None), tuning.pop("mma", None)
    if forced and mma:
        raise ValueError("nvfp4_gemv: a tuning names one kernel: bulk=1 (bulk copies) or mma=1 (tensor cores)")
    # other keys tune one kernel: without "bulk" or "mma" they are the dp4a kernel's (the routed kernels
    # get none but the tensor-core kernel's "groups"); a w_scale address off 16 bytes is handled per call
    named = forced or bool(set(tuning) - {"groups"})
    mma = bool(mma) if mma is not None else not named and use_mma(n, m, sms)
    auto = not named and use_bulk(n, m, k) and copyable
    bulk = not mma and bool(auto if forced is None else forced)
    forced = forced is not None and bulk
    groups = tuning.pop("groups", None) or mma_groups(m, sms)
    if mma:
        g = -(-n // -(-n // MMA_TOKENS))
        if not Nvfp4GemvMma.can_implement(k, g, groups, **tuning):
            raise ValueError(f"nvfp4_gemv: the tensor-core kernel cannot build K={k}, {g} tokens a launch, "
                             f"groups={groups} with {tuning}")
    elif bulk:
        g = -(-n // -(-n // Nvfp4GemvTokensBulk.MAX_TOKENS))
        tuning = {**bulk_tuning(g, m, k), **tuning}
        if not copyable or not Nvfp4GemvTokensBulk.can_implement(k, g, **tuning):
            raise ValueError("nvfp4_gemv: the bulk-copy kernel needs plain w scales with 16-byte aligned "
                             f"rows and K split into whole warps (K % 1024 == 0; K={k}, {g} tokens a "
                             f"launch, {tuning})")
    else:
        g = token_group(n, k)
        if not Nvfp4GemvTokens.can_implement(k, g, **tuning):
            raise ValueError(f"nvfp4_gemv: the dp4a kernel cannot build K={k}, {g} tokens a launch with {tuning}")
    return OpRoute("mma" if mma else "bulk" if bulk else "tokens", g, groups, tuple(sorted(tuning.items())), forced)
