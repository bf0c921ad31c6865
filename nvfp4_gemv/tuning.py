"""Which of ``custom_kernel``'s kernels runs a problem, and how it is configured: the heuristics, as data.

A configuration is a frozen dataclass a kernel class: ``Streaming`` (``Nvfp4Gemv``), ``Split``
(``Nvfp4GemvSplit``), ``Bulk`` (``Nvfp4GemvBulk``). Its fields are the kernel's keyword arguments; a field left
``None`` is the kernel's own default for K. Iterating a configuration gives the ``(name, value)`` pairs it sets,
sorted (``Bulk`` adds ``("bulk", 1)``, the kernel's selector), which is how configurations were written before
they were classes: ``dict(config)`` is the kernel's keyword arguments, and ``as_config`` reads a configuration
back from such pairs (experiments and tools pass them to ``leaderboard.run_cute``).

``pick_tuning`` chooses for one problem size (K, M, L, the GPU's SM count, the scale layout): rows split over
warps where one wave of CTAs holds the problem and rows are long enough (``split_tuning``), else the bulk-copy
kernel for long rows (``bulk_suits``), else the latency configuration for one wave (``latency_tuning``), else the
streaming kernel with 16-byte scale loads where they pay (``wide_tuning``), else its default. The rules follow
measurements on H200 (docs/results.md); where a rule was not measured, the docstring says so.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .bulk import Nvfp4GemvBulk
from .split import Nvfp4GemvSplit
from .streaming import Nvfp4Gemv

BULK_MIN_K = 7168  # shorter rows: the register-streaming kernel is as fast (docs/results.md)


def _dsl_version():
    import importlib.metadata as md

    try:
        return tuple(int(v) for v in md.version("nvidia-cutlass-dsl").split(".")[:2])
    except (md.PackageNotFoundError, ValueError):
        return (0, 0)


DSL_VERSION = _dsl_version()  # (major, minor): one tuning rule differs by the code the DSL generates


class _Config:
    """What the three configurations share: their pairs, and whether their kernel needs 16-byte ``sfa`` rows."""

    selector = ()  # pairs that name the kernel class (``Bulk``'s)

    def __iter__(self):
        pairs = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
        return iter(sorted(self.selector + tuple((n, v) for n, v in pairs if v is not None)))

    def sfa_rows_16(self):
        """Whether the kernel reads ``sfa`` rows in 16-byte pieces (bulk copies, 16-byte scale loads)."""
        return False


@dataclass(frozen=True)
class Streaming(_Config):
    """``Nvfp4Gemv``: ``group`` lanes a row, ``batch`` chunks a lane a work unit, ``min_blocks`` CTAs a SM (the
    register cap), ``depth`` units in registers, ``sf_wide`` the scales in 16-byte loads; ``probe`` skips the
    arithmetic (measurements)."""

    group: Optional[int] = None
    batch: Optional[int] = None
    min_blocks: Optional[int] = None
    depth: Optional[int] = None
    probe: Optional[int] = None
    sf_wide: Optional[int] = None

    kernel = Nvfp4Gemv

    def sfa_rows_16(self):
        return bool(self.sf_wide)


@dataclass(frozen=True)
class Split(_Config):
    """``Nvfp4GemvSplit``: ``split`` warps a row, ``rows`` rows a CTA, ``min_blocks`` CTAs a SM."""

    split: int
    rows: Optional[int] = None
    min_blocks: Optional[int] = None
    probe: Optional[int] = None

    kernel = Nvfp4GemvSplit


@dataclass(frozen=True)
class Bulk(_Config):
    """``Nvfp4GemvBulk``: ``warps`` consumer warps, ``ctas`` CTAs a SM, ``stages`` tiles in flight, at most ``max_n``
    chunks a thread, ``evict`` the L2 evict-first hint, ``dynamic`` tiles claimed at run time."""

    warps: Optional[int] = None
    ctas: Optional[int] = None
    stages: Optional[int] = None
    max_n: Optional[int] = None
    evict: Optional[int] = None
    probe: Optional[int] = None
    dynamic: Optional[int] = None

    kernel = Nvfp4GemvBulk
    selector = (("bulk", 1),)

    def sfa_rows_16(self):
        return True


def as_config(tuning):
    """A configuration from one, or from ``(name, value)`` pairs or a dict: ``bulk`` names the bulk-copy kernel,
    ``split`` the split-row kernel, anything else configures the streaming kernel."""
    if isinstance(tuning, _Config):
        return tuning
    kw = dict(tuning)
    if kw.get("bulk"):
        kw.pop("bulk")
        return Bulk(**kw)
    if kw.get("split"):
        return Split(**kw)
    return Streaming(**kw)


def make_op(k, blocked_scales, **tuning):
    """The kernel object for a configuration given as keyword arguments: ``bulk=1`` picks the bulk-copy kernel,
    ``split=`` the split-row kernel."""
    config = as_config(tuning)
    return config.kernel(k, blocked_scales, **dict(config))


def latency_tuning(k, m, l, sms):
    """The streaming kernel's configuration for a problem that fits in one wave of CTAs, else None.

    Such a problem is latency-bound, not bandwidth-bound: the streaming default gives a CTA 8-16 rows and each
    lane a chain of dependent units, which leaves most SMs idle on small M * L. Here up to a whole warp takes a
    row and every lane loads its share of the row in one unit, so a row costs one memory round trip."""
    chunks = k // 32
    group = min(32, chunks & -chunks)
    per_lane = chunks // group
    ctas = -(-m * group // Nvfp4Gemv.threads) * l
    if group < 2 or per_lane > 12 or ctas > 2 * sms:
        return None
    # All of a lane's arithmetic waits for its last byte; with 8+ chunks a lane and two CTAs on some SMs that
    # tail costs more than the streaming kernel's overlap, where its units hold 3+ chunks (measured at K = 4608
    # and 2304 on 192-256 CTAs; on 96-128 CTAs the latency configuration won: docs/results.md)
    if per_lane >= 8 and ctas > sms and Nvfp4Gemv(k, False).batch >= 3:
        return None
    return Streaming(batch=per_lane, group=group, min_blocks=2)


def wide_tuning(k, dsl=None):
    """The streaming default with ``sf_wide`` for the unit shapes where it measured faster, else None.

    Small scale loads cost the streaming kernel more than their bytes. Units of 4 chunks (a lane's whole share of
    the row) then run 3 CTAs a SM (4 were faster on some shapes but spill on DSL 4.8), except over 8 lanes
    (K = 1024) on DSL 4.4+ (``dsl``, default the installed one), where 3 CTAs measured slower than 2 on 4.8.1
    and faster on 4.3.5. Where a lane's share divides in fours over 16 lanes below the bulk kernel's K
    (K = 4096, 6144), units of 4 chunks (each row's scales in 128-byte pieces, not 64) at 3 CTAs: faster on the
    shapes measured, 16384x4096x1 alone mixed. Longer rows where the bulk kernel does not apply keep units of 2
    (not measured). Units of 3 chunks (K = 4608) measured no gain; units of 1 were not measured. The times are
    in docs/results.md."""
    try:
        op = Nvfp4Gemv(k, False, sf_wide=1)  # needs 8+ lanes a row: then K % 256 == 0 and sfa rows of 16 bytes
    except ValueError:
        return None
    if op.batch == 4 and op.group == 8 and (dsl or DSL_VERSION) >= (4, 4):
        return Streaming(sf_wide=1)  # the default for a lane's whole row share: 2 CTAs a SM
    if op.batch == 4:
        return Streaming(min_blocks=3, sf_wide=1)
    if op.batch == 2 and op.group == 16:
        if op.per_lane % 4 == 0 and k < BULK_MIN_K:
            return Streaming(batch=4, min_blocks=3, sf_wide=1)
        return Streaming(sf_wide=1)
    return None


def split_tuning(k, m, l, sms, long_tails=False):
    """The split-row kernel's configuration for a problem whose threads all fit on the GPU at once, else None.

    One chunk a lane where possible, else up to four (more spill registers); None where no split fits or rows are
    shorter than two warps' chunks. The largest split whose CTAs all fit at the occupancy they ask for, else
    (CTAs whose threads do not fill the SM's) the largest whose threads fit, in two waves. Where the split does
    not divide the row, the last chunk of some lanes lies past it (measured faster than the latency
    configuration). A CTA gets up to 512 threads (measured faster than 256) or up to 256 where that puts fewer
    threads on the busiest SM and keeps two rows a CTA; the occupancy hint caps registers so that the threads
    fit. ``long_tails``: such a tail also at 2-4 chunks a lane, for pick_tuning where the alternative is the bulk
    kernel. The times are in docs/results.md."""
    chunks = k // 32
    warps = -(-chunks // 32)  # warps a row at one chunk a lane
    two_waves = None  # the largest split whose threads fit but whose CTAs take two waves
    for split in range(warps, 1, -1):
        n = -(-chunks // (32 * split))
        lanes = 32 * split
        threads_a_sm = 1536 if n == 1 else 1024  # more chunks a lane, more registers
        if n > 4 or m * l * lanes > sms * threads_a_sm:
            continue
        # A tail at several chunks a lane only as measured (faster than the bulk kernel at 2048x7168x1 and
        # 768x11264x1): with a power-of-two split (CTAs of a power of two threads fill the 1024 a SM) and the row
        # filling 85% of the lanes' chunks
        if n > 1 and chunks % lanes and (not long_tails or split & (split - 1)
                                         or chunks < 0.85 * n * lanes):
            continue
        best, first = None, None
        for cap in (512, 256):
            rows = 1 << max(0, (cap // lanes).bit_length() - 1)
            if cap == 256 and rows < 2:  # one-row CTAs each fetch b from L2 (measured slower)
                continue
            per_sm = max(1, threads_a_sm // (rows * lanes))
            tuning = Split(split=split, rows=rows, min_blocks=per_sm)
            first = first or tuning
            busiest = -(-(-(-m // rows) * l) // sms)  # CTAs on the busiest SM, spread breadth-first
            if busiest <= per_sm and (best is None or busiest * rows < best[0]):  # ties: the larger CTA
                best = (busiest * rows, tuning)
        if best:
            return best[1]
        # A smaller split may fit one wave (faster than a larger split in two); where none does, the two waves
        # still beat the alternatives (docs/results.md)
        two_waves = two_waves or first
    return two_waves


def bulk_suits(k):
    """Rows long enough for the bulk path to pay (K >= 7168, measured) that it can split evenly."""
    try:
        return k >= BULK_MIN_K and Nvfp4GemvBulk(k, False).n <= 12
    except ValueError:
        return False


def pick_tuning(k, m, l, sms, blocked_scales):
    """The kernel and configuration for one problem size: rows split over warps where one wave of CTAs holds the
    problem and rows are long enough, else the bulk-copy kernel for long rows (where both apply it measured as
    fast as the latency configuration or faster), else the latency configuration for one wave, else the
    streaming kernel (``wide_tuning`` where it applies, else ``Streaming()``, the default)."""
    bulk = not blocked_scales and bulk_suits(k)
    split = split_tuning(k, m, l, sms, long_tails=bulk)
    if split:
        return split
    if bulk:
        # tiles claimed at run time where a tile holds several rows (faster at K = 7168 x 8); one-row tiles
        # (K = 16384) turn too fast for a claim's round trip (slower), docs/results.md
        return Bulk(dynamic=1) if Nvfp4GemvBulk(k, False).rows >= 2 else Bulk()
    tuning = latency_tuning(k, m, l, sms)
    if tuning is None and not blocked_scales:
        tuning = wide_tuning(k)
    return tuning or Streaming()
