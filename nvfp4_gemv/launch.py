"""The host side every entry shares: compiling and launching a kernel, streams, tile counters, plan guards.

A launch plan (``leaderboard``'s for ``custom_kernel``, ``op``'s for ``gemv``) is cached per tensor metadata
(shapes, strides, dtypes, devices) and validated once; a call then reads the data pointers and the stream and
calls the compiled launcher (``Kernel``): through TVM-FFI (``--enable-tvm-ffi``, where apache-tvm-ffi is
installed), else with reused ctypes argument storage where this DSL version's layout is the one checked for (the
DSL's own argument conversion costs far more than the launch), else the DSL's own call. A call with a recent
plan's tensors skips even the metadata key: ``RecentPlans`` checks it with a C++ guard. Works with
nvidia-cutlass-dsl 4.3 to 4.8.

Also here: the argument errors both entries raise (``fail``) and the longest row they take (``MAX_K``).
"""

import ctypes
import os
import threading
import warnings

import torch
from cuda.bindings.driver import CUstream

import cutlass.cute as cute

MAX_K = 32768
LAUNCH_ENV = "NVFP4_GEMV_LAUNCH"  # "tvm-ffi", "direct" or "dsl": force one launch path (tests, measurements)
MAX_PLANS = 4096  # cached plans an entry keeps; past it the cache starts again
lock = threading.RLock()  # compiles, executors, counters: one at a time
_warned = set()


def keep_plan(plans, key, plan):
    """Files ``plan`` under ``key`` in an entry's plan cache (a dict) and returns it; past ``MAX_PLANS`` plans
    the cache starts again (a plan is cheap to rebuild, a cache that only grows is not)."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = plan
    return plan


def fail(exc, name, expected, got, who="nvfp4_gemv"):
    """Raises ``exc`` naming the argument: ``"<who>: argument '<name>': expected <expected>, got <got>"``."""
    raise exc(f"{who}: argument '{name}': expected {expected}, got {got}")


def warn_once(key, message):
    """A RuntimeWarning, once a process for each ``key``."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------------
# Compiling and launching
# ----------------------------------------------------------------------------------------------------


def _tvm_ffi_module():
    try:
        import tvm_ffi
    except ImportError:
        return None
    return tvm_ffi


def launch_kind(fn):
    """How a compiled kernel launches: ``"tvm-ffi"`` (compiled with ``--enable-tvm-ffi``), ``"direct"``
    (our ctypes storage matches this DSL version's) or ``"dsl"`` (the DSL's own argument conversion)."""
    tvm_ffi = _tvm_ffi_module()
    if tvm_ffi is not None and (isinstance(fn, tvm_ffi.Function) or hasattr(fn, "__tvm_ffi_object__")):
        return "tvm-ffi"
    return "direct" if Kernel.layout_matches(fn) else "dsl"


def tvm_ffi_function(fn):
    """The C function behind a kernel compiled with ``--enable-tvm-ffi``, called with plain ints and no
    Python in between; None where there is none (compiled for another arch than this machine's). DSL
    4.3-4.7 return a ``tvm_ffi.Function`` subclass; 4.8 wraps one (``__tvm_ffi_object__``, the FFI's
    own protocol) in a keyword-argument layer, which costs host time a call (docs/results.md)."""
    tvm_ffi = _tvm_ffi_module()
    if tvm_ffi is None:
        return None
    if isinstance(fn, tvm_ffi.Function):
        return fn if fn.__chandle__() else None
    get = getattr(fn, "__tvm_ffi_object__", None)
    raw = get() if get is not None else None
    return raw if isinstance(raw, tvm_ffi.Function) else None


class Kernel:
    """A compiled kernel on one device and its launch path, the fastest that this install offers:

    * ``tvm-ffi``: compiled with ``--enable-tvm-ffi`` (the DSL's public fast path, package
      apache-tvm-ffi); a call passes its values (18 for ``custom_kernel``'s kernels, 14 for the op's) as
      Python ints to a C function.
    * ``direct``: without apache-tvm-ffi (the leaderboard's image), ``custom_kernel``'s 18 values are
      written into ctypes storage and the compiled host function is called directly. This reads DSL
      internals, so the storage layout is checked once against the DSL's own conversion (it matches on
      4.3, not on 4.8; the op's kernel never takes this path).
    * ``dsl``: the DSL's own call, which converts every argument each time (many times the host time of the
      others: docs/results.md); a warning says so once.
    """

    I32 = (6, 15, 16)  # m, grid_x, num_l; the others are int64 addresses and strides

    def __init__(self, fn, device_index, op):
        self.fn = fn
        self.device_index = device_index
        self.op = op
        self.kind = "dsl" if os.environ.get(LAUNCH_ENV) == "dsl" else launch_kind(fn)
        self.ffi = tvm_ffi_function(fn) if self.kind == "tvm-ffi" else None
        self.direct = self.kind == "direct"
        self.executor = None

    def check_fast(self):
        """Warns once where launches will go through the DSL's slow argument conversion."""
        if self.ffi is None and not self.direct:
            import importlib.metadata as md

            warn_once("dsl", f"nvfp4_gemv: no fast launch path with nvidia-cutlass-dsl "
                      f"{md.version('nvidia-cutlass-dsl')} ({self.kind}): every call pays the DSL's "
                      "argument conversion, about 100 us of host time; pip install apache-tvm-ffi")

    @classmethod
    def layout_matches(cls, fn):
        probe = [1000 + i for i in range(17)] + [CUstream(0x5EED)]
        try:
            exe, _ = fn.args_spec.generate_execution_args(probe, {})
            addr = [e.value if isinstance(e, ctypes.c_void_p) else e for e in exe]
            vals = [(ctypes.c_int32 if i in cls.I32 else ctypes.c_int64).from_address(addr[i]).value
                    for i in range(17)]
            return (len(exe) == 18 and vals == probe[:17]
                    and ctypes.c_void_p.from_address(addr[17]).value == 0x5EED)
        except Exception:  # noqa: BLE001 - any surprise: not this layout
            return False

    def _executor(self):
        if self.executor is None:
            with lock:
                if self.executor is None:
                    ex = self.fn.to(self.device_index)
                    if not (callable(getattr(getattr(ex, "jit_module", None), "capi_func", None))
                            and hasattr(ex, "exec_context") and hasattr(ex, "cuda_result")):
                        self.direct = False
                    self.executor = ex
        return self.executor

    def args(self, static):
        """Argument storage for this kernel, ``(head, static values, packed, result, capi)``: ``head`` holds
        the six pointers and the stream side by side (one ``_HEAD.pack_into`` a call), the 11 values
        after the pointers are set to ``static``; the layout of the packed array is the DSL executor's."""
        ex = self._executor()
        head = (ctypes.c_int64 * 7)()
        values = [ctypes.c_int32(x) if i in self.I32 else ctypes.c_int64(x) for i, x in enumerate(static, 6)]
        result = type(ex.cuda_result)() if ex.cuda_result is not None else ctypes.c_int32()
        base = ctypes.addressof(head)
        ptrs = [base + 8 * i for i in range(6)] + [ctypes.addressof(v) for v in values] + [base + 48]
        if ex.cuda_result is not None:
            ptrs.append(ctypes.addressof(result))
        if ex.exec_context is not None:
            ptrs += [p.value for p in ex.exec_context.kernel_functions_ptrs]
        return head, values, (ctypes.c_void_p * len(ptrs))(*ptrs), result, ex.jit_module.capi_func

    def launch_dsl(self, values, stream_handle):
        self.fn(*values, stream_handle if self.kind == "tvm-ffi" else CUstream(stream_handle))


def dsl_compile(op, args, options=None, tvm_ffi=None):
    """``cute.compile`` with ``launch_options``; where the TVM-FFI build fails (an apache-tvm-ffi this DSL
    does not work with), warns once and builds without it (the ctypes launcher or the DSL's call)."""
    opts = launch_options(options, tvm_ffi)
    try:
        return cute.compile(op, *args, options=opts)
    except Exception as e:  # noqa: BLE001 - any failure of the optional path: retry without it
        if "--enable-tvm-ffi" not in opts:
            raise
        warn_once("tvm-ffi-compile", f"nvfp4_gemv: compiling with --enable-tvm-ffi failed ({type(e).__name__}: "
                  f"{str(e)[:200]}); compiled without it")
        return cute.compile(op, *args, options=launch_options(options, False))


def launch_options(options, tvm_ffi):
    """Compile options: ``options`` plus ``--enable-tvm-ffi`` where ``tvm_ffi`` says so (by default where
    apache-tvm-ffi is installed and ``NVFP4_GEMV_LAUNCH`` does not name another path)."""
    if tvm_ffi is None:
        tvm_ffi = os.environ.get(LAUNCH_ENV, "tvm-ffi") == "tvm-ffi" and _tvm_ffi_module() is not None
    return ((options or "") + (" --enable-tvm-ffi" if tvm_ffi else "")).strip()


# ----------------------------------------------------------------------------------------------------
# Devices, streams and the bulk kernel's tile counters
# ----------------------------------------------------------------------------------------------------


class KernelCache:
    """Compiled kernels by a key of what changes their code: ``build(key)`` returns ``(op, compiled fn)``, run
    once a key under the module's lock (a second thread waits for the first's compile; compiles of every
    cache, the leaderboard's, the op's (both forms), quantize's and the experts', one at a time); ``get`` wraps it as a
    ``Kernel`` of the device and checks its fast launch path once."""

    def __init__(self, build):
        self._build = build
        self._kernels = {}

    def __len__(self):
        return len(self._kernels)

    def clear(self):
        with lock:
            self._kernels.clear()

    def get(self, device_index, key):
        kern = self._kernels.get(key)
        if kern is None:
            with lock:
                kern = self._kernels.get(key)
                if kern is None:
                    op, fn = self._build(key)
                    kern = Kernel(fn, device_index, op)
                    kern.check_fast()
                    self._kernels[key] = kern
        return kern


_device_info = {}
_sms = {}


def sm_count(device_index):
    """SMs of a CUDA device, read once (not ``device_info``, whose sm_100 probe of ``_scaled_mm`` syncs)."""
    sms = _sms.get(device_index)
    if sms is None:
        sms = _sms[device_index] = torch.cuda.get_device_properties(device_index).multi_processor_count
    return sms


def device_info(device_index):
    """(arch string, SM count, fp4 _scaled_mm usable) of a CUDA device, computed once."""
    info = _device_info.get(device_index)
    if info is None:
        major, minor = torch.cuda.get_device_capability(device_index)
        sms = sm_count(device_index)
        arch = f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
        if major == 10 and torch.cuda.is_current_stream_capturing():
            return arch, sms, True  # no probe inside a graph capture: go by the architecture
        info = (arch, sms, _probe_scaled_mm_fp4(device_index) if major == 10 else False)
        _device_info[device_index] = info
    return info


def _probe_scaled_mm_fp4(device_index):
    dev = torch.device("cuda", device_index)
    try:
        a = torch.zeros(128, 32, dtype=torch.uint8, device=dev).view(torch.float4_e2m1fn_x2)
        s = torch.ones(128 * 4, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.T, s, s, out_dtype=torch.float16)
        torch.cuda.synchronize(dev)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not supported here"
        return False


current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
current_stream = (getattr(torch._C, "_cuda_getCurrentRawStream", None)
                  or (lambda device_index: torch.cuda.current_stream(device_index).cuda_stream))
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) or torch.cuda.is_current_stream_capturing
_counters = {}  # (device, stream[, thread]) -> (batch indices held, address, tensor)
_counters_kept = []  # counters replaced by larger ones: another thread may be launching with their address
CUDA_STREAM_PER_THREAD = 2  # cudaStreamPerThread: one handle, another stream in each thread
_thread = threading.local()
_threads_numbered = [0]


def _thread_number():
    # not threading.get_ident(): a new thread may get an ended one's, while the ended thread's launches run
    n = getattr(_thread, "n", None)
    if n is None:
        with lock:
            _threads_numbered[0] += 1
            n = _thread.n = _threads_numbered[0]
    return n


def _new_counters(dev, n):
    return torch.zeros(n, dtype=torch.int32, device=torch.device("cuda", dev))


def tile_counters(dev, stream, l):
    """The address of the dynamic bulk kernel's tile counters for a launch on ``stream``: an int32 a batch
    index, zero between launches (each launch's last claim resets it), one set a stream (and thread, for the
    per-thread default stream), so that launches that may overlap never share one. 0 inside a graph capture:
    a graph can be replayed on any stream, beside eager launches on this one, so a captured launch keeps the
    static schedule. A set is allocated on its stream and never freed."""
    if _capturing():
        return 0
    key = (dev, stream) if stream != CUDA_STREAM_PER_THREAD else (dev, stream, _thread_number())
    got = _counters.get(key)
    if got is None or got[0] < l:
        with lock:
            got = _counters.get(key)
            if got is None or got[0] < l:
                if got is not None:
                    _counters_kept.append(got[2])
                n = max(64, 1 << (l - 1).bit_length())
                t = _new_counters(dev, n)  # zeroed on the current stream, ``stream``
                got = _counters[key] = (n, t.data_ptr(), t)
    return got[1]


# ----------------------------------------------------------------------------------------------------
# Plan guards: C++ checks of a call's tensor metadata
# ----------------------------------------------------------------------------------------------------


def _guard_maker():
    """A maker of C++ checks of tensor metadata, or None. ``torch._C._dynamo.guards.TensorGuards`` (what
    torch.compile checks its inputs with: Python type, dispatch keys, dtype, device index, sizes, strides,
    requires_grad) matches a call's tensors against a plan's in a fraction of the time the plan key takes
    (docs/results.md). It is private API: used only where it passes this self-check, else a warning and the
    key alone."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        def make(ts):
            return TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                dynamic_dims_strides=[list(t.stride()) for t in ts])

        t = torch.zeros(4, 2)
        g = make((t, t[:, :1]))
        if (g.check(torch.ones(4, 2), torch.ones(4, 2)[:, 1:]) and not g.check(t, t)
                and not g.check(t.t().contiguous().t(), t[:, :1]) and not g.check(t.half(), t[:, :1])
                and not g.check(t.to("meta"), t[:, :1]) and not g.check(t, 1)):
            return make
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        pass
    warn_once("guards", "nvfp4_gemv: torch._C._dynamo.guards.TensorGuards is missing or failed its self-check; "
                         "the per-call metadata check runs in Python (about 2 us more host time a call)")
    return None


_make_guard = _guard_maker()
# a guard keeps a borrowed pointer to each tensor's Python type: only types that live as long as torch
_GUARD_TYPES = (torch.Tensor, torch.nn.Parameter)


class RecentPlans:
    """Recent calls' plans, so that a hit skips the Python key: first by the identity of one of the call's
    tensors (custom_kernel's ``a``; gemv's ``w``, which a model passes at every step), then the last few
    plans in turn (fresh tensors of a recent shape: the leaderboard's inputs, or ``w.detach()`` each call).
    A hit is a plan's call behind a C++ guard of all the call's tensor metadata, returning None where the
    guard rejects them (another plan's metadata, or a dead tensor's id reused: the guard makes both safe).
    A plan keeps a guard a variant of its key's tensors (``nn.Parameter`` or not, requires_grad, inference
    tensors: what the key does not hold), up to ``VARIANTS``."""

    SIZE = 4096  # ids, not tensors: nothing is kept alive
    RECENT = 8  # a decoder layer's distinct weight shapes, and then some
    VARIANTS = 4

    def __init__(self):
        self.hits = {}
        self.recent = ()  # the newest hits, newest first; one assignment: thread-safe reads

    def scan(self, anchor, tried, *args):
        """The result of the first recent hit other than ``tried`` that takes ``args``, filed under
        ``anchor`` for its next call; else None."""
        for hit in self.recent:
            if hit is not tried:
                res = hit(*args)
                if res is not None:
                    hits, key = self.hits, id(anchor)
                    if key in hits or len(hits) < self.SIZE:
                        hits[key] = hit
                    return res
        return None

    def add(self, anchor, ts, plan):
        """Files a hit of ``plan`` for ``ts`` (the call's tensors, in the order its hit path checks them)
        under ``anchor`` and first in ``recent``, with the plan's variant whose guard takes ``ts`` (a new one
        if none does); nothing for tensor subclasses or nested tensors."""
        if _make_guard is None or any(type(t) not in _GUARD_TYPES or t.is_nested or t.layout != torch.strided
                                      for t in ts):
            return
        try:
            hit = next((h for g, h in plan.variants if g.check(*ts)), None)
            if hit is None:
                guard = _make_guard(ts)
                hit = plan.hit_path(guard.check)
                plan.variants = ((guard, hit),) + plan.variants[: self.VARIANTS - 1]
        except (TypeError, RuntimeError):
            return
        hits, key = self.hits, id(anchor)
        if key not in hits and len(hits) >= self.SIZE:
            hits.clear()
        hits[key] = hit
        self.recent = (hit,) + tuple(h for h in self.recent if h is not hit)[: self.RECENT - 1]
