"""Which build of the W4A16 kernel (``w4a16.Nvfp4GemvW4A16``) a shape takes: ``route(n_tok, m, k, sms, tuning,
packed)`` gives a launch's frozen ``W4A16Route`` (as ``op_route.route`` gives the W4A4 op's ``OpRoute``), from
``default_tuning(n_tok, m, sms, k)``, the rules (threads, CTAs a SM, groups, where x lives, which decode),
and ``w4a16_groups``, the groups of 8 rows a CTA owns. Each rule was measured on H200 (DSL 4.3.5); the timings
behind them are in docs/results.md ("Measurements behind the tuning rules"), the why in docs/design.md
("W4A16"). Host-only.
"""

from dataclasses import dataclass

from . import op_kernel
from .ptx import SMEM_A_SM
from .w4a16 import MAX_GROUPS, W_A_TOKENS, Nvfp4GemvW4A16

SHARED_X_TOKENS = 4  # tokens up to which many rows take the 4-CTA shared-x build (measured to 8: slower from 6)
SHARED_X_VALUES = 16384  # ... where N x K is at most this (measured faster at 4096 x 4, 8192 x 2)
SHARED_X_MIN_K = 2048  # ... and K at least this (measured from 2048; the one-token route's across from 1024)
FEW_ROWS_MIN_K = 4096  # 1..4 tokens on rows whose 4-group tiles do not pass the SMs: 16-warp CTAs from this K
MANY_TOKENS_X_VALUES = 65536  # 9..16 tokens on many rows: x in shared memory (one 16-warp CTA) up to this N x K
ONE_SLICE_K = 2048  # ... and, at this K (a slice for each of 16 warps), 9..32 tokens (17..32 on any rows)
FOUR_WARPS_K = (2048, 6144)  # one token on many rows at K in this range: CTAs of 4 warps, 8 a SM (level at 8192)
FOUR_WARPS_TILES = 5  # ... where the 2-group tiles are at least this many a SM (faster from 672 on 132, slower at 544)
LONG_K_PAIR_VALUES = 32768  # 2 tokens on many rows past SHARED_X_VALUES: 2 CTAs of 4 groups up to this N x K


def w4a16_groups(n_tok, m, sms, even=False, cap=None):
    """Groups of 8 rows a CTA owns at a time: as many as fill the SMs evenly (up to ``cap``; ``pick_groups``'
    rounds x (groups + 2)). ``cap``: by default what the registers hold without ``across`` (a lane holds
    ``5 * groups`` words of ``w`` and 16 of ``x`` per 8 tokens, twice: the slice computed and the next in
    flight; with 8 warps 4 groups spill at 25-32 tokens, sm_90a, DSL 4.3.5, hence 2 there, and 6 and 4 at
    9-16 and 17-24 tokens); the route passes its own (``default_tuning``). ``even``: only even counts (``w_a``
    pairs the groups; M is a multiple of 128, so 16 groups at least)."""
    if cap is None:
        cap = MAX_GROUPS if n_tok <= 8 else 6 if n_tok <= 16 else 4 if n_tok <= 24 else 2
    return op_kernel.pick_groups(m, sms, range(2 if even else 1, min(cap, m // 8) + 1, 2 if even else 1))


def default_tuning(n_tok, m, sms, k):
    """The tuning keywords of the build that ``n_tok`` tokens on ``m`` rows of ``k`` values take on ``sms`` SMs.
    8 warps a CTA unless a rule says 16 (or 4). One token where the 4-group tiles outnumber the SMs: x in shared
    memory, the scales after the MMA (``late``), the three-operation bf16 decode (``dec``), x in pair order
    (``xpair``), CTAs of 2 groups, four or five a SM where their shared memory fits (else two of 4 groups),
    eight of 4 warps at K 2048..6144 on rows of at least 5 two-group tiles a SM. Up to 8 tokens w is the MMA's
    A operand (``w_a``). 2..4 tokens on many rows with N x K <= 16384 and K >= 2048: the one-token build
    without ``late``. 1..4 tokens on fewer rows (the 2-group tiles one or two a SM) from K = 4096, and 5..8
    tokens from 1920 rows where two fit: 16-warp CTAs, two a SM, x in shared memory. 2 tokens on many rows
    with 16384 < N x K <= 32768: two CTAs of 4 groups, x in shared memory. Otherwise x in registers with
    ``across`` from 2 tokens; from 9 tokens x is the A operand and a CTA takes as many groups as the registers
    hold (``w4a16_groups``), 16 warps of up to 4 on rows of at most two rounds, or one 16-warp CTA with x in
    shared memory (9..16 tokens on many rows from K = 4096 where N x K <= 65536; at K = 2048 9..32 tokens).
    Every rule was measured faster where it applies, on H200: the timings, and where each was slower,
    in docs/results.md, "Measurements behind the tuning rules"."""
    w_a = {"w_a": 1} if n_tok <= W_A_TOKENS else {}
    if n_tok == 1 and m // 32 > sms:
        if FOUR_WARPS_K[0] <= k <= FOUR_WARPS_K[1] and m // 16 >= FOUR_WARPS_TILES * sms:
            # CTAs of 4 warps, 8 a SM (the same 32 warps), as many as take the tiles in even rounds: a warp takes 8
            # slices a tile instead of 4 before the partials meet, 4 warps meet instead of 8, and no CTA has a
            # tile more than another (slower where the tiles leave too few warps a SM, level from K = 8192).
            # Eight such CTAs take at most 124 KB of a SM's shared memory (K = 6144; a test checks the fit)
            return {"threads": 128, "ctas": 8, "even": 1, "groups": 2, "late": 1, "dec": 1, "xpair": 1, "across": 1,
                    **w_a}
        # four 2-group CTAs where their shared memory (as the class sizes it) and the 1 KiB a SM keeps for each
        # CTA fit a SM
        two = Nvfp4GemvW4A16(k, 1, 2, True, False, False, True, threads=256, x_smem=1, xpair=1, late=1, **w_a)
        fit = SMEM_A_SM // (two.smem_bytes + 1024)  # such CTAs a SM's shared memory holds
        if fit < 4:
            return {"threads": 256, "ctas": 2, "groups": 4, "dec": 1, "xpair": 1, "late": 1, **w_a}
        # five where the 2-group tiles fill five a SM in one round but not four
        ctas = 5 if fit >= 5 and 4 * sms < m // 16 <= 5 * sms else 4
        # across where every warp has a slice (tested and timed there)
        across = {"across": 1} if k >= 1024 else {}
        return {"threads": 256, "ctas": ctas, "groups": 2, "dec": 1, "xpair": 1, "late": 1, **across, **w_a}
    if 2 <= n_tok <= SHARED_X_TOKENS and SHARED_X_MIN_K <= k and n_tok * k <= SHARED_X_VALUES and m // 32 > sms:
        # 2..4 tokens on many rows: the one-token route's 4 CTAs of 2 groups with x in shared memory, without
        # late (which would take N MMAs a k-step: measured slower). Where the four copies of x take more of a
        # SM's shared memory (N x K above 16384) it was slower than x in registers, likely because the 2-byte
        # scale loads lose the L1 they share it with (not profiled).
        return {"threads": 256, "ctas": 4, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, **w_a}
    if (n_tok <= SHARED_X_TOKENS and k >= FEW_ROWS_MIN_K and m // 32 <= sms and m // 16 >= sms - sms // 8
            and _ctas_fit(2, k, n_tok, 2, threads=512)):
        # 1..4 tokens on fewer rows (1920..4224 on 132 SMs; measured at 2048..4096): the 2-group tiles are about
        # one or two a SM, so 16 warps a CTA (two CTAs a SM: 32 warps) with x in shared memory, late at one token;
        # slower where only one such CTA fits a SM, so two must fit
        late = {"late": 1} if n_tok == 1 else {}
        return {"threads": 512, "ctas": 2, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, **late, "across": 1,
                **w_a}
    if n_tok == 2 and SHARED_X_VALUES < n_tok * k <= LONG_K_PAIR_VALUES and m // 32 > sms and _ctas_fit(2, k, n_tok, 4):
        # 2 tokens on many rows past SHARED_X_VALUES (K 8256..16384): two CTAs of 4 groups with x in shared
        # memory (slower at 3 and 4 tokens, and where only one fits: not taken). The fit holds at every such K
        # (two such CTAs take at most 146 of a SM's 228 KiB); it is a guard should LONG_K_PAIR_VALUES grow
        return {"threads": 256, "ctas": 2, "groups": 4, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, **w_a}
    if (SHARED_X_TOKENS < n_tok <= W_A_TOKENS and k >= FEW_ROWS_MIN_K and sms - sms // 8 <= m // 16
            and _ctas_fit(2, k, n_tok, 2, 512)):
        # 5..8 tokens from 1920 rows (on 132 SMs) where two 16-warp CTAs' x fit a SM (N x K up to about 53000):
        # the 16-warp build of fewer rows, without late (slower where one CTA fits a SM: not taken)
        return {"threads": 512, "ctas": 2, "groups": 2, "x_smem": 1, "dec": 1, "xpair": 1, "across": 1, **w_a}
    if n_tok <= W_A_TOKENS:
        # 2..8 tokens (and one on fewer rows): x in registers; with across from 2 tokens (level to 6% faster; any K:
        # at depth 1 a warp without slices skips the loop)
        return {"threads": 256, "x_smem": 0, **w_a, **({"across": 1} if n_tok > 1 else {})}
    # 9..32 tokens, x the A operand: a warp reads x's slice once a tile, N / (2 * groups) times w's bytes,
    # so as many groups as the registers hold, with across (its builds keep 8 groups at 32 tokens without a
    # stack); 9..16 tokens on rows whose 4-group tiles fill at most two rounds: 16 warps of up to 4 groups
    # (6 spill at 128 registers a thread)
    if n_tok <= 16 and k >= 2048 and m // 32 <= 2 * sms:
        return {"threads": 512, "x_smem": 0, "across": 1, "groups": w4a16_groups(n_tok, m, sms, cap=4)}
    if n_tok * k <= MANY_TOKENS_X_VALUES and (k == ONE_SLICE_K or (n_tok <= 16 and k >= FEW_ROWS_MIN_K)):
        # 9..16 tokens on the many rows past that from K = 4096, up to the measured N x K (x and the partials 160 KB
        # of the SM's shared memory at 16 x 4096, one CTA): x read once a CTA from shared memory instead of once a
        # tile, 16 warps of 4 groups. At K = 2048 (a slice a warp) the same for 9..16 tokens on many rows and
        # 17..32 tokens on any rows (at K = 2048 N x K is always within the bound), of as many groups as fill
        # the SMs, 2 to 4. Not past K = 2048 for 17..32 tokens (slower or level there: one rule for K = 2048)
        return {"threads": 512, "x_smem": 1, "across": 1,
                "groups": 4 if n_tok <= 16 else max(2, w4a16_groups(n_tok, m, sms, cap=4))}
    return {"threads": 256, "x_smem": 0, "across": 1, "groups": w4a16_groups(n_tok, m, sms, cap=MAX_GROUPS)}


@dataclass(frozen=True)
class W4A16Route:
    """One launch's build of the W4A16 kernel: ``tokens`` it takes, ``groups`` of 8 rows a CTA, and ``tuning``,
    its other build options as sorted ``(key, value)`` pairs (what the compile cache keys on)."""

    tokens: int
    groups: int
    tuning: tuple


def route(n_tok, m, k, sms, tuning=(), packed=False):
    """The ``W4A16Route`` of a launch of ``n_tok`` tokens against an [m, k] weight on ``sms`` SMs: the rules'
    build (``default_tuning``) under a caller's ``tuning`` pairs, the packed weight layout where ``packed``.
    :raises ValueError: for a build the kernel cannot take (``Nvfp4GemvW4A16.can_implement``)."""
    tune = {**default_tuning(n_tok, m, sms, k), **dict(tuning), **({"packed": 1} if packed else {})}
    groups = tune.pop("groups", None) or w4a16_groups(n_tok, m, sms, even=bool(tune.get("w_a")))
    if not Nvfp4GemvW4A16.can_implement(k, n_tok, groups, **tune):
        try:  # the kernel's own reason
            Nvfp4GemvW4A16(k, n_tok, groups, True, False, True, True, **tune)
            why = ""
        except (ValueError, TypeError) as e:
            why = f": {e}"
        raise ValueError(f"nvfp4_gemv: the W4A16 kernel cannot build K={k}, {n_tok} tokens a launch, "
                         f"groups={groups} with {tune}{why}")
    return W4A16Route(n_tok, groups, tuple(sorted(tune.items())))


def _ctas_fit(ctas, k, n_tok, groups, threads=256):
    """Whether ``ctas`` CTAs of the shared-x build (x rows, late's padding at one token, the partials) and the
    1 KiB a SM keeps for each fit a SM's shared memory."""
    try:
        op = Nvfp4GemvW4A16(k, n_tok, groups, True, False, False, True, threads=threads, x_smem=1, xpair=1,
                            late=int(n_tok == 1), w_a=int(n_tok <= W_A_TOKENS))
    except ValueError:  # not even one CTA's x fits (4 tokens at K = 32768)
        return False
    return ctas * (op.smem_bytes + 1024) <= SMEM_A_SM
