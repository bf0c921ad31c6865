"""``generate``: greedy or sampled decoding of a transformers causal LM with the whole decode step in one
CUDA graph, so that the host costs one graph launch a token instead of a model's worth of Python.

``model.generate`` runs the model's Python (and, compiled, dynamo's guards and the CUDA-graph trees'
bookkeeping) and syncs once a token to test for EOS: on a decode step whose kernels take ~3 ms, that host
work is exposed as a ms or more a token (docs/results.md). Here the prompt is prefilled eagerly (as
``model.generate`` does; ``compile_prefill=True`` compiles it), one decode
step runs eagerly (it compiles our kernels for the decode shapes, and it is the first decoded token), then
the step (forward, token selection, the EOS bookkeeping, the cache position) is captured once in a CUDA
graph and replayed; the host looks at the device only every ``sync_every`` tokens, to stop once every row
has ended.

Semantics are ``model.generate(input_ids, max_new_tokens=..., do_sample=..., cache_implementation="static")``'s
for a batch without padding: greedy picks the first largest logit (the same tokens as ``generate``); rows
that produced an EOS id continue with the pad id; the result stops at the token where the last row ended
(or at ``max_new_tokens``). Sampling applies temperature, then top-k, then top-p (the smallest set of
tokens whose probability reaches ``top_p``; the most likely token always stays) as transformers' warpers
do, and draws with the exponential-race form of a categorical draw (``argmax(p / E)``, E ~ Exp(1)), which
needs no sync and is capturable; it draws from torch's default generator of the device, so
``torch.manual_seed`` makes a run reproducible (not token-equal to ``model.generate``'s sampling, which
draws differently).

On the CPU (tests) the same step runs eagerly. Where the step cannot be captured (a model whose forward
syncs or allocates outside the graph's pool), it runs eagerly too, with one warning.

A capture (and the eager step before it) costs a few hundred ms on an 8B model, as much as 100 tokens'
replays: the latest captured step of each model is kept (its static cache, its buffers, the graph and its
memory pool) and a later call with the same batch, cache length (``max_cache_len``, by default prompt + new
tokens) and selection options replays it after the prefill. A model changed since (a parameter, a
buffer or a module replaced, a mode switched) is captured anew: the kept graph would read memory the model
no longer uses. ``release(model)`` frees what is kept.
"""

import contextlib
import inspect
import weakref

import torch

from ..launch import warn_once

__all__ = ["generate", "release"]

# model -> _Kept: the model's latest captured decode step. Weak: the graph and cache go with the model.
_kept = weakref.WeakKeyDictionary()


def _fail(exc, arg, expected, got):
    raise exc(f"generate: '{arg}': expected {expected}, got {got}")


def _eos_ids(model, eos_token_id):
    """The EOS ids as a list (``None``: the model's generation_config's, as ``model.generate`` takes them)."""
    if eos_token_id is None:
        cfg = getattr(model, "generation_config", None)
        eos_token_id = getattr(cfg, "eos_token_id", None)
        if eos_token_id is None:
            return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                      for i in ids):
        _fail(TypeError, "eos_token_id", "None, a non-negative int or a list of them", repr(eos_token_id))
    return list(ids)


def _check(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, sync_every, max_cache_len):
    if not isinstance(model, torch.nn.Module) or not callable(getattr(model, "forward", None)):
        _fail(TypeError, "model", "a transformers causal LM (a torch.nn.Module)", type(model).__name__)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2 \
            or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        got = f"{input_ids.dtype} of shape {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) \
            else type(input_ids).__name__
        _fail(TypeError if not isinstance(input_ids, torch.Tensor) else ValueError, "input_ids",
              "a LongTensor [batch, prompt length], both > 0", got)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        _fail(ValueError, "max_new_tokens", "an int >= 0", repr(max_new_tokens))
    if not isinstance(do_sample, bool):
        _fail(TypeError, "do_sample", "a bool", repr(do_sample))
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
            or temperature == float("inf"):
        _fail(ValueError, "temperature", "a finite float > 0", repr(temperature))
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        _fail(ValueError, "top_k", "None or an int >= 1", repr(top_k))
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        _fail(ValueError, "top_p", "None or a float in (0, 1]", repr(top_p))
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        _fail(ValueError, "sync_every", "an int >= 1", repr(sync_every))
    if max_cache_len is not None:
        need = input_ids.shape[1] + max_new_tokens
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < need:
            _fail(ValueError, "max_cache_len", f"None or an int >= prompt + max_new_tokens = {need}",
                  repr(max_cache_len))
    dev = next((t.device for t in model.parameters()), None) or next((t.device for t in model.buffers()), None)
    if dev is not None and dev != input_ids.device and dev.type != "meta":
        _fail(ValueError, "input_ids", f"a tensor on {dev} (where the model is)", f"one on {input_ids.device}")


def _select(logits, do_sample, temperature, top_k, top_p):
    """The next token of each row from its last logits [B, V] (float32), without a sync."""
    if not do_sample:
        return logits.argmax(-1)
    if temperature != 1.0:
        logits = logits / temperature
    neg = torch.finfo(logits.dtype).min
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, neg)
    if top_p is not None and top_p < 1.0:
        srt, idx = torch.sort(logits, dim=-1, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= (1 - top_p)
        drop[:, -1] = False  # the most likely token stays
        logits = logits.masked_fill(drop.scatter(1, idx, drop), neg)
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_()
    return (probs / race).argmax(-1)


class _Decoder:
    """The decode state on the device and the step that advances it by one token. It holds no reference to
    the model (it is kept in a weak dictionary keyed by the model): the model is an argument."""

    def __init__(self, model, batch, max_len, device, eos, pad, sel):
        from transformers import StaticCache

        self.sel = sel
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed forward's past_key_values to cache (the old name deprecated)
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.keep_kw = "logits_to_keep" in params
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.eos = torch.tensor(eos, dtype=torch.long, device=device) if eos else None
        self.pad = pad
        self.tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.col = torch.zeros(1, dtype=torch.long, device=device)
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        # the new tokens; as wide as the cache, so that any request that fits the cache fits here
        self.out = torch.full((batch, max_len), pad, dtype=torch.long, device=device)
        self.decode_forward = _Decoder.forward

    def restart(self):
        """Back to no tokens, in place (a captured step reads these addresses)."""
        self.cache.reset()
        self.out.fill_(self.pad)
        self.done.zero_()
        self.col.zero_()

    def forward(self, model, ids, cache_position):
        kw = {self.cache_kw: self.cache}
        if self.keep_kw:
            kw["logits_to_keep"] = 1
        out = model(input_ids=ids, cache_position=cache_position, use_cache=True, **kw)
        return out.logits[:, -1, :].to(torch.float32)

    def prefill(self, model, ids, cache_position):
        """``forward`` on the prompt: its own code object, so that under ``torch.compile`` its entries (the
        prompt's length symbolic) and the decode step's (one token, static) are cached apart."""
        return _Decoder.forward(self, model, ids, cache_position)

    def cache_ready(self):
        """Whether every layer of the static cache has its tensors (transformers makes them at a layer's
        first update, and marks their addresses static only outside a compiled region)."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(getattr(layer, "is_initialized", False) for layer in layers)

    def accept(self, nxt):
        """Records the tokens ``nxt`` [B] at column ``col`` (pad where a row has ended) and advances."""
        if self.eos is not None:
            nxt = torch.where(self.done, torch.full_like(nxt, self.pad), nxt)
            self.done |= torch.isin(nxt, self.eos)
        self.out.index_copy_(1, self.col, nxt[:, None])
        self.tok.copy_(nxt[:, None])
        self.col.add_(1)

    def step(self, model):
        nxt = self.sel(self.decode_forward(self, model, self.tok, self.pos))
        self.accept(nxt)
        self.pos.add_(1)


class _Kept:
    """A model's captured decode step: what it was captured for (``key``), the model's state then
    (``state``), the decoder whose buffers the graph reads, and the graph."""

    def __init__(self, key, state, dec, graph):
        self.key, self.state, self.dec, self.graph = key, state, dec, graph


def _state(model):
    """What a captured step depends on besides its own buffers: every module (its identity, type, mode,
    hooks and, for NVFP4Linear, the path it chose) and every parameter and buffer (address, shape, dtype).
    Equal states mean the graph's kernels read the model's current tensors. A tuple; well under a ms for an
    8B model, once a call."""
    st = []
    for m in model.modules():
        d = m.__dict__
        st.append((id(m), type(m), m.training, d.get("_run"), d.get("_kernel"), len(d.get("_forward_hooks", ())),
                   len(d.get("_forward_pre_hooks", ()))))
        for group in (d.get("_parameters", {}), d.get("_buffers", {})):
            for t in group.values():
                st.append(None if t is None else (t.data_ptr(), t.shape, t.dtype, t.device))
    return tuple(st)


@contextlib.contextmanager
def _own_cublas_workspace():
    """Drops torch's cached cuBLAS workspaces before a capture and after it (as inductor's CUDA-graph trees
    do), so that a captured matmul's workspace is allocated in the graph's own memory pool and lives as long
    as the graph. torch caches one workspace a (handle, stream), and from 2.12 drops a stream's entry when any
    graph captured on that stream is destroyed (pytorch/pytorch#175276; 2.11 has no such call): a graph whose
    capture found another graph's or an eager call's workspace cached could then replay into freed, later
    unmapped memory (pytorch/pytorch#193402; ``torch.cuda.graph`` captures every graph on one default stream).
    Clearing after the capture keeps eager matmuls on that stream out of the graph's pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None) or (lambda: None)
    clear()
    try:
        yield
    finally:
        clear()


def release(model=None):
    """Frees the captured decode step (its static cache, buffers, graph and memory pool) that ``generate``
    keeps for ``model``, or for every model when None."""
    if model is None:
        _kept.clear()
    else:
        _kept.pop(model, None)


_compiled = {}


def _compiled_forward(prefill=False):
    """``_Decoder.forward`` (the decode step: static shapes, fullgraph) or ``_Decoder.prefill`` (the prompt:
    its length marked dynamic where the model lets it be, so that one compile serves prompts of any length; a
    model whose code specializes on it, such as the experts' groups, compiles once a length, and past dynamo's
    ``recompile_limit`` that prefill runs eagerly, with dynamo's warning: not fullgraph, which would raise
    there; a break costs only host time outside the graph) under ``torch.compile``, each made once (dynamo
    keeps an entry a model and batch shape). The default mode makes no CUDA graphs of its own, so ours
    captures the step's kernels; "max-autotune-no-cudagraphs" would autotune for minutes."""
    fn = _compiled.get(prefill)
    if fn is None:
        fn = _compiled[prefill] = (torch.compile(_Decoder.prefill, dynamic=None) if prefill
                                   else torch.compile(_Decoder.forward, fullgraph=True, dynamic=False))
    return fn


def _prefill(dec, model, input_ids, compiled):
    """The prompt through the model (positions 0..prompt-1): its last logits [B, V] in float32. ``compiled``:
    through ``torch.compile`` once the cache has its tensors (a kept decoder's later calls), so that the
    compiled code never makes them (one entry, not one before and one after; transformers marks their
    addresses static only outside a compiled region); a fresh cache's prefill, the call that captures, runs
    eagerly."""
    prompt = input_ids.shape[1]
    ids, positions = input_ids, torch.arange(prompt, device=input_ids.device)
    fn = _Decoder.prefill
    if compiled and dec.cache_ready():
        fn = _compiled_forward(prefill=True)
        if prompt > 1:  # one compile for every prompt length, where the model's code allows it
            ids = input_ids.clone()  # (the mark is an attribute of the tensor: not set on the caller's)
            torch._dynamo.maybe_mark_dynamic(ids, 1)
            torch._dynamo.maybe_mark_dynamic(positions, 0)
    return fn(dec, model, ids, positions)


@torch.no_grad()
def generate(model, input_ids, max_new_tokens, *, do_sample=False, temperature=1.0, top_k=None, top_p=None,
             eos_token_id=None, pad_token_id=None, sync_every=8, cuda_graph=True, compile=False,
             max_cache_len=None, compile_prefill=False):
    """Decodes ``max_new_tokens`` tokens after ``input_ids`` [batch, prompt] (no padding) with a static
    cache, the decode step replayed from one CUDA graph (module docstring). Returns a LongTensor [batch,
    prompt + new], as ``model.generate`` does: greedy tokens are ``model.generate(input_ids,
    max_new_tokens=..., do_sample=False, cache_implementation="static")``'s.

    :param model: a transformers causal LM (``forward(input_ids, cache_position, use_cache, cache /
        past_key_values)`` with ``.logits``), bf16 or quantized by ``quantize_model`` / ``load_modelopt``.
    :param eos_token_id: an id or a list of ids ending a row; None takes ``model.generation_config``'s.
    :param pad_token_id: what follows a row's EOS; None takes the generation config's, else the first EOS id.
    :param sync_every: tokens between the host's checks whether every row has ended (a sync each).
    :param cuda_graph: replay the step from a CUDA graph (on a CUDA device); False runs it eagerly.
    :param compile: run the decode step's forward through ``torch.compile`` (inductor, without its own CUDA
        graphs: norms, rotary embeddings and activations fused into fewer kernels) inside the graph; the
        first call compiles (tens of seconds for an 8B model), later calls with the same batch reuse it.
    :param compile_prefill: run the prefill through ``torch.compile`` too in calls that replay a kept
        capture (the capturing call, and calls without a CUDA graph, prefill eagerly: the cache's tensors are
        made outside compiled code), the prompt's length symbolic where the model's code allows (one compile
        for every length; else one a length, up to dynamo's ``recompile_limit``, then eagerly). Its host is
        then inductor's launches, not a model's worth of eager ops (most of a short call's time).
        ``model.generate`` prefills eagerly: the compiled prefill rounds otherwise (fused kernels), so its
        cache, and past a near-tie its tokens, may differ from ``model.generate``'s.
    :param max_cache_len: the static cache's length (None: prompt + ``max_new_tokens``). The captured step
        is kept and replayed by later calls with the same batch, cache length and options: a fixed
        ``max_cache_len`` lets prompts and lengths that differ share one capture.
    """
    _check(model, input_ids, max_new_tokens, do_sample, temperature, top_k, top_p, sync_every, max_cache_len)
    if not isinstance(compile_prefill, bool):
        _fail(TypeError, "compile_prefill", "a bool", repr(compile_prefill))
    eos = _eos_ids(model, eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos[0] if eos else 0
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        _fail(TypeError, "pad_token_id", "None or an int >= 0", repr(pad_token_id))
    if max_new_tokens == 0:
        return input_ids.clone()
    batch, prompt = input_ids.shape
    device = input_ids.device
    cap = prompt + max_new_tokens if max_cache_len is None else max_cache_len
    use_graph = cuda_graph and device.type == "cuda"
    key = (batch, cap, device, do_sample, float(temperature), top_k, top_p, tuple(eos), pad_token_id,
           bool(compile))
    kept = _kept.get(model) if use_graph else None
    state = None
    if kept is not None:
        state = _state(model)
        if kept.key != key or kept.state != state:
            kept = None
            _kept.pop(model, None)  # its pool and cache go before the new capture allocates its own

    def sel(logits):
        return _select(logits, do_sample, float(temperature), top_k, top_p)

    if kept is not None:
        dec, graph = kept.dec, kept.graph
        dec.restart()
    else:
        dec, graph = _Decoder(model, batch, cap, device, eos, pad_token_id, sel), None
        if compile:
            dec.decode_forward = _compiled_forward()
    # the prefill: the prompt at positions 0..prompt-1 gives the first new token
    dec.accept(sel(_prefill(dec, model, input_ids, compile_prefill)))
    dec.pos.fill_(prompt)
    made = 1
    if kept is None and made < max_new_tokens and use_graph:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dec.step(model)  # eager: compiles the decode shapes' kernels; it is the second token
        torch.cuda.current_stream(device).wait_stream(side)
        made += 1
        if made < max_new_tokens:
            graph = torch.cuda.CUDAGraph()
            try:
                with _own_cublas_workspace(), torch.cuda.graph(graph):
                    dec.step(model)
            except Exception as e:  # noqa: BLE001 - the step is correct eagerly; only its capture failed
                graph = None
                warn_once(("generate capture", type(model)), f"generate: the decode step of {type(model).__name__} could "
                           f"not be captured in a CUDA graph ({type(e).__name__}: {str(e)[:200]}); it runs "
                           "eagerly, with the model's host time exposed each token")
                torch.cuda.synchronize(device)
            else:
                _kept[model] = _Kept(key, state if state is not None else _state(model), dec, graph)
    while made < max_new_tokens:
        if graph is not None:
            graph.replay()
        else:
            dec.step(model)
        made += 1
        if dec.eos is not None and made % sync_every == 0 and bool(dec.done.all()):
            break
    gen = dec.out[:, :max_new_tokens]
    if dec.eos is not None:
        # as model.generate: stop at the token where the last row ended
        hit = torch.isin(gen, dec.eos)
        ended = hit.any(1)
        if bool(ended.all()):
            first = torch.where(hit, torch.arange(gen.shape[1], device=device), gen.shape[1]).amin(1)
            gen = gen[:, :int(first.max()) + 1]
        else:
            gen = gen[:, :made]
    return torch.cat([input_ids, gen], dim=1)
