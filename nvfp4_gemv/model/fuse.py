"""One GEMV for sibling linears that read the same input: ``fuse_linears``.

A transformers Llama calls ``q_proj``, ``k_proj`` and ``v_proj`` on one hidden state, and ``gate_proj`` and
``up_proj`` on another: five launches a layer where two would do, and the smallest of them (k and v, 1024
rows on Llama-3-8B) use a fraction of the GPU. Serving stacks fuse these weights in their own model code
(``qkv_proj``, ``gate_up_proj``); a transformers model's code is not ours, so the fusion happens at the
modules instead:

* the group's weights, scales and biases are concatenated once into buffers of the group's first module
  (its owner: non-persistent, so the state_dict keeps ModelOpt's names), and every module's own buffers
  become row views of them (no second copy of a weight);
* the first call of a round (any module of the group, an input ``x`` not seen before) runs one GEMV over
  the concatenated rows and keeps its output; each module returns its column slice (a view, as
  ``torch.split`` would give), and the round ends, keeping nothing, once every module took its part of
  that same ``x`` object. Under ``torch.compile`` this traces to one op and slices (no graph break); in a
  CUDA graph it is one launch.
* a call pattern that does not fit (a module called again, or with another input, before the round ends)
  dissolves the group's fast path, with one warning; the modules then compute on their own views, as
  unfused modules do, until ``fuse_linears`` fuses them again.

Fusing needs what one GEMV can compute for all parts: the same ``in_features``, mode, device, bias or no
bias, weight layout (all packed, ``NVFP4Linear.pack``, or none; packed parts concatenate by rows, their
8-row groups being self-contained), and one ``weight_scale_2`` (and, for mode "w4a4", one ``input_scale``): the global scales multiply
the whole output. ModelOpt exports fused-in-serving groups with shared global scales, and
``quantize_model(fuse=True)`` quantizes each group with one (the group's amax); groups whose scalars
differ stay unfused (checking them syncs once a model). Move the model as a whole after fusing (``.to``
re-points each module's views at the moved concatenation). Anything else that changes a part's state ends
its group's fast path, with a warning (``fuse_linears`` fuses it again): a load_state_dict into a fused
module, a buffer replaced by any route (checked by identity at every call), an input changed in place
between the parts' calls (eager; under torch.compile the parts must see one tensor's values, as models
give them). Edit a scale in place and the group keeps the owner's: reassign it, or load, instead (as for
any ``NVFP4Linear``, whose derived scalars an in-place edit leaves stale).
"""

import warnings

import torch

# sibling groups by child name, as Llama, Mistral, Qwen2 and most decoder models in transformers name them
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# the owner's concatenations, and the part buffer each one backs
FUSED_BUFFERS = {"_fused_weight": "weight", "_fused_weight_scale": "weight_scale", "_fused_bias": "bias"}


# what a fused product reads of each part: checked by identity before every use, so that a buffer
# replaced by any route (setattr, load_state_dict(assign=True), torch.func.functional_call) is noticed
_PART_BUFFERS = ("weight", "weight_scale", "bias", "weight_scale_2", "input_scale")


def _warn_at_trace(ctx):
    """Warns while dynamo traces (``comptime``: warnings.warn itself cannot be traced)."""
    warnings.warn(ctx.get_local("msg").as_python_constant(), stacklevel=2)


# a traced group's round state after the group dissolved while torch.compile traced
_DISSOLVED = "dissolved"


class Siblings:
    """The shared state of one fused group (not a module: it holds references to its parts, which hold
    it as ``_siblings``). ``take(part, x, x2)`` is a part's forward while the group is active."""


    def __init__(self, name, owner, parts):
        self.name, self.owner, self.parts = name, owner, list(parts)
        self.bounds, lo = [], 0
        for p in self.parts:
            self.bounds.append((lo, lo + p.out_features))
            lo += p.out_features
        self.full = (1 << len(self.parts)) - 1
        self.active = True
        self._x = self._out = None
        self._seen, self._version = 0, 0
        self._held = [None] * len(self.parts)  # each part's buffers as fused (see _PART_BUFFERS)
        self._fused = None
        # the traced round (``_take_traced``): None between forwards. An instance attribute from the start:
        # a traced store into a class default would change the guarded instance dict after the first call
        self._round = None

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__dict__.setdefault("_round", None)
        self.restored()

    def restored(self):
        """Completes an unpickled group once it and every part have their state (pickle restores the cycle
        in either order; the last of them calls this with everything there): each part chooses its path
        (a part pickled before the path was chosen once has none)."""
        parts = self.__dict__.get("parts")
        if parts is None or not all("_mode" in p.__dict__ for p in parts):
            return
        for p in parts:
            p._choose()

    def choose_runs(self):
        """Sets each part's path (``_run``) while the group is active: its columns of the group's one
        GEMV, or, where the parts' kernels (chosen from mode and layout) differ from the owner's, a path
        that ends the group at its next call. Called by every part's ``_choose``, so that the compiled
        step is guarded on which function each part holds, not on every part's kernel."""
        if not all("_buffers" in p.__dict__ and "_mode" in p.__dict__ for p in self.parts):
            return  # (unpickling, some part's state not there yet: restored() chooses once the last arrives)
        owner = self.owner
        kernel = owner.__dict__.get("_kernel")
        same = kernel is not None and all(p.__dict__.get("_kernel") is kernel for p in self.parts)
        # what the traced round reads (``take_traced``), in one attribute: the parts' column counts, and
        # whether the group has a bias
        self.plan = (tuple(hi - lo for lo, hi in self.bounds), owner._buffers.get("_fused_bias") is not None)
        for i, p in enumerate(self.parts):
            p.__dict__["_run"] = _PART_RUNS[i] if same else _run_mixed

    def record(self, part):
        """Notes ``part``'s buffers (and, for the owner, the concatenations) as the ones fused."""
        self._held[part._sibling_index] = tuple(part._buffers.get(n) for n in _PART_BUFFERS)
        if part is self.owner:
            self._fused = tuple(part._buffers.get(n) for n in FUSED_BUFFERS)

    def _intact(self, part):
        """Whether ``part`` and the owner still hold the buffers the group fused (identity, no values)."""
        for p in (part, self.owner):
            held = self._held[p._sibling_index]
            for n, t in zip(_PART_BUFFERS, held):
                if p._buffers.get(n) is not t:
                    return False
        return all(self.owner._buffers.get(n) is t for n, t in zip(FUSED_BUFFERS, self._fused))

    def dissolve(self, why):
        """Stops fusing this group (the parts keep their views and compute alone; ``fuse_linears`` fuses
        it again), with one warning, also while torch.compile traces."""
        if self.active:
            self.active = False
            self._x = self._out = None
            self._seen = 0
            self._round = _DISSOLVED if torch.compiler.is_compiling() else None
            if not torch.compiler.is_compiling():  # (while tracing, take() sees active is False instead)
                for p in self.parts:
                    p._choose()  # each part's own GEMV from now on
            msg = f"nvfp4_gemv: {self.name}: no longer fused ({why}); each module now runs its own GEMV"
            if torch.compiler.is_compiling():
                from torch._dynamo.comptime import comptime

                comptime(_warn_at_trace)
            else:
                warnings.warn(msg, stacklevel=3)

    def take(self, part, x, x2, i):
        """``part`` (the group's ``i``-th)'s output rows for ``x2`` [R, in] (``x`` reshaped; the round is
        keyed by the ``x`` object the model passed) from the group's one GEMV, or None when the group is
        no longer active (the caller then computes alone).

        Eager, every call checks that the group still holds what it fused (buffers by identity, the
        device, the input's version, the order of calls). Traced by torch.compile, each such check would
        become dynamo guards evaluated on every call of the compiled model: there the group relies on
        what ends it eagerly (a buffer replaced or a mode changed re-chooses the parts' paths, on which
        the compiled code is guarded, ``choose_runs``): ``take_traced``. ``i`` comes with the part's path
        function (``_PART_RUNS``)."""
        if not self.active:  # dissolved while torch.compile traced: the parts' paths are chosen now
            for p in self.parts:
                p._choose()
            return None
        why = self._why_not_now(part, x, x2)
        if why is not None:
            self.dissolve(why)
            return None
        bit = 1 << i
        if self._x is not x or self._seen & bit:
            if self._seen:
                self.dissolve("its modules were not each called once on one input before another input came")
                return None
            self._x, self._seen = x, 0
            self._version = x._version
            self._out = self.owner._product(x2, fused=True)
        self._seen |= bit
        lo, hi = self.bounds[i]
        out = self._out[:, lo:hi]
        if self._seen == self.full:  # the round is complete: keep nothing between forwards
            self._x = self._out = None
            self._seen = 0
        return out

    def _why_not_now(self, part, x, x2):
        """(Eager) why the group cannot serve this call, or None."""
        if not self._intact(part):
            return f"a buffer of '{self.name}' was replaced (fuse_linears again to fuse it)"
        owner = self.owner
        if owner._fused_weight.device != x2.device:
            return f"its concatenation is on {owner._fused_weight.device}, the input on {x2.device}"
        if self._x is x and not self._seen & (1 << part._sibling_index) and x._version != self._version:
            return "its input was changed in place between its modules' calls"
        return None

    def repoint(self, part):
        """After ``part`` moved (``Module._apply``): its buffers as views of the owner's concatenations
        again, where those are already on the same device with the same dtype (the owner, registered
        first, moves first); otherwise the group dissolves."""
        owner, (lo, hi) = self.owner, self.bounds[part._sibling_index]
        for fused, mine in FUSED_BUFFERS.items():
            f, t = owner._buffers.get(fused), part._buffers.get(mine)
            if f is None or t is None:
                continue
            if f.device != t.device or f.dtype != t.dtype:
                self.dissolve(f"'{mine}' moved to {t.device}/{t.dtype} apart from the group's {f.device}/{f.dtype}")
                return
            part._buffers[mine] = f[lo:hi]
        self.record(part)


def take_traced(sib, part, x, x2, i):
    """``Siblings.take`` while torch.compile traces (a function, not a method: each attribute a traced call
    looks up on the group is a guard on every compiled call). Reads two attributes of the group: ``_round``
    (None between forwards; within a traced forward the tuple it holds is the trace's own, so reading it
    again costs no guard) and ``plan``; the owner is the group's first part, so the usual round, which
    starts there, reads nothing else."""
    r = sib._round
    if r is _DISSOLVED:  # dissolved earlier in this trace: the parts compute alone
        return None
    if r is None or r[0] is not x or r[1] & (1 << i):
        if r is not None:
            sib.dissolve("its modules were not each called once on one input before another input came")
            return None
        sizes, bias = sib.plan
        owner = part if i == 0 else sib.owner
        out = owner._kernel(owner, x2, True)
        if bias:
            out = out + owner._buffers["_fused_bias"].to(out.dtype)
        r = (x, 0, torch.split(out, sizes, dim=1))
    seen = r[1] | (1 << i)
    sib._round = None if seen == (1 << len(r[2])) - 1 else (x, seen, r[2])  # a whole round: keep nothing
    return r[2][i]


# What a fused group's parts run (``Siblings.choose_runs`` sets a part's ``_run``): plain functions of (module,
# x), as the layer's own paths are (``linear``), so that a traced forward is guarded on which function a
# module holds, not on the state it was chosen from.


def as_rows(x):
    """x [..., K] as K-contiguous rows [R, K] the kernels read (16-byte aligned)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    # a view at an odd offset: the kernels read 16-byte aligned rows (traced code has no addresses; its
    # own allocations are aligned)
    if not torch.compiler.is_compiling() and x2.data_ptr() % 16:
        x2 = x2.clone()
    return x2


def _run_mixed(mod, x):
    """A fused group's part while the parts' kernels differ (``Siblings.choose_runs``): the group ends here,
    and this part computes alone."""
    sib = mod._siblings
    if sib is not None and sib.active:
        sib.dissolve("its modules' modes differ")
    elif sib is not None and not torch.compiler.is_compiling():  # ended while traced: the paths are chosen now
        for p in sib.parts:
            p._choose()
    x2 = as_rows(x)
    out = mod._product(x2)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _part_run(i):
    def run(mod, x):
        """A fused group's ``i``-th part: its columns of the group's one GEMV."""
        x2 = as_rows(x)
        out = None
        if x2.shape[0]:
            sib = mod._siblings
            out = take_traced(sib, mod, x, x2, i) if torch.compiler.is_compiling() else sib.take(mod, x, x2, i)
        if out is None:  # the group ended (its path is re-chosen), or no rows
            out = mod._product(x2)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    run.__name__ = run.__qualname__ = f"_run_part{i}"
    return run


# one function a part's index: the index is known from which function runs (no guard on an attribute);
# each a module-level name too, so that a pickled module (torch.save of a whole model) finds it
_PART_RUNS = tuple(_part_run(i) for i in range(16))
globals().update({f.__name__: f for f in _PART_RUNS})


def _groups(model, groups):
    """``(qualified group name, parent, [(child name, module)])`` for each parent whose children of one
    group can all join one (``NVFP4Linear`` and its subclasses), not yet fused, in the parent's registration
    order."""
    out = []
    for pname, parent in model.named_modules():
        kids = dict(parent.named_children())
        for names in groups:
            # a module that can join a group answers _why_not_fusable (None when it can) and has what the group
            # reads of its parts: _siblings, in_features, mode, packed, weight, bias, input_scale and its
            # buffers (NVFP4Linear; fuse imports no model module, so it asks rather than checks the class)
            if not all(hasattr(kids.get(n), "_why_not_fusable") and kids[n]._why_not_fusable() is None
                       for n in names):
                continue
            order = [n for n in kids if n in names]  # the owner is the first registered (it moves first)
            parts = [(n, kids[n]) for n in order]
            if any(m._siblings is not None and m._siblings.active for _, m in parts) \
                    or len({id(m) for _, m in parts}) != len(parts):
                continue
            label = f"{pname + '.' if pname else ''}{{{','.join(order)}}}"
            out.append((label, parent, parts))
    return out


def _compatible(parts):
    """Why one GEMV cannot serve these parts (metadata only), or None."""
    if len(parts) > len(_PART_RUNS):
        return f"more than {len(_PART_RUNS)} parts"
    first = parts[0]
    for m in parts[1:]:
        if m.in_features != first.in_features:
            return "in_features differ"
        if m.mode != first.mode:
            return "modes differ"
        if m.packed != first.packed:
            return "one is packed, another not"
        if m.weight.device != first.weight.device or m.weight.device.type == "meta":
            return "devices differ" if m.weight.device != first.weight.device else "on the meta device"
        if (m.bias is None) != (first.bias is None) or (m.bias is not None and m.bias.dtype != first.bias.dtype):
            return "bias differs"
        if (m.input_scale is None) != (first.input_scale is None):
            return "one has an input_scale, another not"
    return None


def fuse_linears(model, groups=FUSE_GROUPS):
    """Fuses, in place, each group of sibling ``NVFP4Linear`` modules that read the same input (by child
    name, ``groups``: q/k/v and gate/up by default) into one GEMV a forward (module docstring). Groups
    that one GEMV cannot compute (different ``in_features``, mode, device or bias, or different global
    scales) are left as they are. Syncs once (the global scales' comparison); no copy of a weight stays
    behind. :return: the names of the groups fused, e.g. ``"model.layers.0.self_attn.{q_proj,k_proj,v_proj}"``.
    """
    cands, taken = [], set()
    for label, parent, parts in _groups(model, groups):
        mods = [m for _, m in parts]
        if _compatible(mods) is None and not taken & {id(m) for m in mods}:  # a module shared by two
            cands.append((label, mods))                                     # parents joins one group
            taken |= {id(m) for m in mods}
    if not cands:
        return []
    # one sync for the whole model: do the parts of each group share their global scales?
    checks = []
    for _, mods in cands:
        ws2 = torch.stack([m.weight_scale_2.reshape(()) for m in mods])
        ok = (ws2 == ws2[0]).all()
        if mods[0].input_scale is not None:
            ins = torch.stack([m.input_scale.reshape(()) for m in mods])
            ok = ok & (ins == ins[0]).all()
        checks.append(ok)
    agree = torch.stack([c.to(checks[0].device) for c in checks]).tolist()
    fused = []
    for (label, mods), ok in zip(cands, agree):
        if not ok:
            continue
        _fuse(label, mods)
        fused.append(label)
    return fused


def _fuse(label, mods):
    owner = mods[0]
    with torch.no_grad():
        cat = {fused: torch.cat([m._buffers[mine] for m in mods], dim=0)
               for fused, mine in FUSED_BUFFERS.items() if owner._buffers.get(mine) is not None}
    for m in mods:  # a dissolved group fused again: its old owner lets go of the old concatenations
        old = m._siblings
        if old is not None and old.owner is not owner:
            for fused in FUSED_BUFFERS:
                old.owner._buffers[fused] = None
    for fused in FUSED_BUFFERS:
        owner.register_buffer(fused, cat.get(fused), persistent=False)
    sib = Siblings(label, owner, mods)
    for i, m in enumerate(mods):
        m._sibling_index = i
        m._siblings = sib
    for m in mods:
        sib.repoint(m)  # the parts' own copies are freed here; each part's buffers recorded
    for m in mods:
        m._choose()  # forward runs the group's part from now on
