"""``nvfp4_gemv.generate``: the tokens of ``model.generate(..., cache_implementation="static")`` (greedy), EOS
and padding as it does them, sampling options, bad arguments named; on a GPU the step replayed from one
CUDA graph (no fallback, no sync inside a step)."""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import nvfp4_gemv  # noqa: E402
from nvfp4_gemv import generate, quantize_model  # noqa: E402
from nvfp4_gemv.model.generation import _kept, _state, release  # noqa: E402

VOCAB = 512
gpu = pytest.mark.gpu


def tiny_llama(layers=2, device="cpu", seed=0, dtype=torch.bfloat16):
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype).to(device).eval()


def variant(name, device="cpu"):
    m = tiny_llama(device=device)
    if name == "w4a16":
        quantize_model(m)
    elif name == "w4a16-fused":
        quantize_model(m, fuse=True)
    elif name == "w4a16-fused-packed":
        quantize_model(m, fuse=True, pack=True)
    return m


def prompt(batch, length, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length), generator=g).to(device)


def hf(model, ids, n, **kw):
    return model.generate(ids, max_new_tokens=n, do_sample=False, cache_implementation="static",
                          disable_compile=True, **kw)


@pytest.mark.parametrize("name", ["bf16", "w4a16", "w4a16-fused"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_tokens_are_model_generates(name, batch):
    m = variant(name)
    ids = prompt(batch, 7)
    want = hf(m, ids, 10)
    got = generate(m, ids, 10)
    assert got.dtype == torch.long and got.shape == want.shape == (batch, 17)
    assert torch.equal(got, want)


def test_rows_after_their_eos_are_padded_and_the_result_stops_where_the_last_row_ended():
    m = variant("w4a16")
    ids = prompt(3, 5)
    free = hf(m, ids, 12)
    eos = int(free[0, 5 + 2])  # row 0 emits it at its third new token; other rows later or never
    want = hf(m, ids, 12, eos_token_id=eos, pad_token_id=7)
    got = generate(m, ids, 12, eos_token_id=eos, pad_token_id=7, sync_every=2)
    assert torch.equal(got, want)
    assert (got[0, 5 + 3:] == 7).all()


def test_all_rows_ending_early_shortens_the_result_as_generate_does():
    m = variant("bf16")
    ids = prompt(2, 4)
    free = hf(m, ids, 12)
    eos = [int(free[0, 4 + 1]), int(free[1, 4 + 3])]
    want = hf(m, ids, 12, eos_token_id=eos, pad_token_id=0)
    got = generate(m, ids, 12, eos_token_id=eos, pad_token_id=0, sync_every=3)
    assert got.shape[1] < 4 + 12 and torch.equal(got, want)


def test_eos_from_the_generation_config_is_used_when_none_is_given():
    m = variant("bf16")
    ids = prompt(1, 4)
    eos = int(hf(m, ids, 8)[0, 4 + 2])
    m.generation_config.eos_token_id = eos
    got = generate(m, ids, 8)
    assert got.shape[1] == 4 + 3 and int(got[0, -1]) == eos


def test_zero_new_tokens_returns_the_prompt():
    m = variant("bf16")
    ids = prompt(2, 3)
    assert torch.equal(generate(m, ids, 0), ids)


def test_sampling_is_reproducible_under_a_seed_and_varies_without_one():
    m = variant("w4a16")
    ids = prompt(2, 4)
    kw = dict(do_sample=True, temperature=1.5, top_k=50, top_p=0.95)
    torch.manual_seed(3)
    a = generate(m, ids, 12, **kw)
    torch.manual_seed(3)
    b = generate(m, ids, 12, **kw)
    torch.manual_seed(4)
    c = generate(m, ids, 12, **kw)
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)])
def test_sampling_that_leaves_one_token_is_greedy(kw):
    m = tiny_llama(dtype=torch.float32)  # (bf16 logits tie often enough that top-k 1 keeps two)
    ids = prompt(2, 4)
    assert torch.equal(generate(m, ids, 8, do_sample=True, **kw), generate(m, ids, 8))


def test_top_k_and_top_p_keep_the_tokens_generate_keeps():
    from nvfp4_gemv.model.generation import _select

    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    probs = logits.softmax(-1)
    for _ in range(20):
        tok = _select(logits, True, 1.0, 5, None)
        assert (tok[:, None] == logits.topk(5, -1).indices).any(-1).all()
        tok = _select(logits, True, 1.0, None, 0.5)
        srt = probs.sort(-1, descending=True)
        need = (srt.values.cumsum(-1) < 0.5).sum(-1) + 1  # the smallest set reaching 0.5
        rank = (srt.indices == tok[:, None]).float().argmax(-1)
        assert (rank < need).all()


@pytest.mark.parametrize("kw, arg", [
    (dict(input_ids=torch.ones(2, 3)), "input_ids"),
    (dict(input_ids=torch.ones(3, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.ones(2, 0, dtype=torch.long)), "input_ids"),
    (dict(input_ids=[[1, 2]]), "input_ids"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(eos_token_id="2"), "eos_token_id"),
    (dict(eos_token_id=[1, -1]), "eos_token_id"),
    (dict(pad_token_id=-3), "pad_token_id"),
    (dict(sync_every=0), "sync_every"),
    (dict(do_sample="yes"), "do_sample"),
    (dict(max_cache_len=4), "max_cache_len"),  # prompt 3 + 2 new tokens need 5
    (dict(max_cache_len=True), "max_cache_len"),
    (dict(compile_prefill="yes"), "compile_prefill"),
])
def test_bad_arguments_are_named(kw, arg):
    m = variant("bf16")
    args = dict(input_ids=prompt(1, 3), max_new_tokens=2)
    args.update(kw)
    with pytest.raises((TypeError, ValueError), match=f"generate: '{arg}'"):
        generate(m, args.pop("input_ids"), args.pop("max_new_tokens"), **args)


def test_a_model_that_is_not_a_module_is_named():
    with pytest.raises(TypeError, match="generate: 'model'"):
        generate(object(), prompt(1, 3), 2)


def test_compiled_step_gives_the_same_tokens():
    m = tiny_llama(layers=1)
    quantize_model(m, fuse=True)
    ids = prompt(2, 5)
    assert torch.equal(generate(m, ids, 6, compile=True), hf(m, ids, 6))


def prefill_graphs():
    """Graphs dynamo has compiled of the prefill's code object (``_Decoder.prefill``) so far."""
    from nvfp4_gemv.model.generation import _Decoder

    code = _Decoder.prefill.__code__
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(code))


def prefilled(m, lengths, compiled, batch=1, cap=32):
    """The last logits of each prompt length's prefill through ``_prefill`` on one decoder whose cache already
    has its tensors (as a kept capture's decoder has them: an eager prefill first, then ``restart``)."""
    from nvfp4_gemv.model.generation import _Decoder, _prefill

    dec = _Decoder(m, batch, cap, torch.device("cpu"), [], 0, None)
    assert not dec.cache_ready()
    out = []
    with torch.no_grad():  # (as generate runs)
        _prefill(dec, m, prompt(batch, 3), compiled)  # a fresh cache: eager, whatever ``compiled`` says
        assert dec.cache_ready()
        for length in lengths:
            dec.restart()
            ids = prompt(batch, length, seed=length)
            out.append(_prefill(dec, m, ids, compiled))
            assert not hasattr(ids, "_dynamo_weak_dynamic_indices")  # (a copy carries the mark, not the caller's)
    return out


def test_compiled_prefill_matches_the_eager_one_and_one_entry_serves_every_prompt_length():
    """fp32 (no near-ties between the eager and the compiled rounding): on a cache that has its tensors the
    compiled prefill's logits are the eager one's to fp32 rounding and pick the same tokens; prompt lengths
    share one compiled entry; a fresh cache's prefill never reaches the compiled code."""
    m = tiny_llama(layers=2, dtype=torch.float32)
    torch._dynamo.reset()
    got = prefilled(m, (5, 9, 6), True)
    want = prefilled(m, (5, 9, 6), False)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))
    assert prefill_graphs() == 1


def test_compiled_prefill_of_quantized_layers_serves_every_prompt_length_with_one_entry():
    """Fused W4A16 layers (our ops under a symbolic token count) on an initialized cache: two prompt lengths,
    one entry, the eager prefill's first tokens."""
    m = tiny_llama(layers=1)
    quantize_model(m, fuse=True)
    torch._dynamo.reset()
    got = prefilled(m, (4, 7), True)
    want = prefilled(m, (4, 7), False)
    assert all(torch.equal(g.argmax(-1), w.argmax(-1)) for g, w in zip(got, want))
    assert prefill_graphs() == 1


def test_compiled_prefill_past_the_recompile_limit_runs_eagerly_instead_of_raising():
    """A second cache length is a guard failure of the prefill's entry; with dynamo's recompile limit at 1 the
    prefill then runs eagerly (the eager logits, exactly), not raising as a fullgraph compile would."""
    m = tiny_llama(layers=1, dtype=torch.float32)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        prefilled(m, (5,), True, cap=32)
        got = prefilled(m, (6,), True, cap=40)
    assert torch.equal(got[0], prefilled(m, (6,), False, cap=40)[0])
    assert prefill_graphs() == 1


def test_compile_prefill_keeps_model_generates_tokens_where_no_capture_is_kept():
    """Without a kept capture (the CPU; ``cuda_graph=False``) every call's cache is fresh, so its prefill is
    eager: the tokens are model.generate's, bf16 included."""
    m = variant("w4a16-fused")
    ids = prompt(2, 5)
    assert torch.equal(generate(m, ids, 6, compile=True, compile_prefill=True), hf(m, ids, 6))


def test_it_is_exported():
    assert nvfp4_gemv.generate is generate and "generate" in nvfp4_gemv.__all__
    assert nvfp4_gemv.model.generation.release is release


def test_a_longer_cache_gives_generates_tokens():
    m = variant("w4a16-fused")
    ids = prompt(2, 6)
    assert torch.equal(generate(m, ids, 9, max_cache_len=40), hf(m, ids, 9))


def test_a_restarted_decoder_has_no_tokens_and_keeps_its_addresses():
    """A kept capture reads the decoder's buffers by address: ``restart`` empties them in place (a stale ``done``
    would pad every row of the next call, a stale ``col`` write its tokens after the last call's)."""
    from nvfp4_gemv.model.generation import _Decoder

    m = variant("bf16")
    dec = _Decoder(m, 2, 12, torch.device("cpu"), [7], 3, lambda logits: logits.argmax(-1))
    dec.forward(m, prompt(2, 4), torch.arange(4))  # fills the cache
    dec.accept(torch.tensor([7, 5]))  # row 0 ends
    dec.accept(torch.tensor([1, 2]))
    ptrs = [t.data_ptr() for t in (dec.out, dec.done, dec.col, dec.tok)]
    assert dec.done.tolist() == [True, False] and dec.col.item() == 2
    dec.restart()
    assert dec.done.tolist() == [False, False] and dec.col.item() == 0
    assert torch.equal(dec.out, torch.full((2, 12), 3))
    assert all(not layer.keys.any() and not layer.values.any() for layer in dec.cache.layers)
    assert ptrs == [t.data_ptr() for t in (dec.out, dec.done, dec.col, dec.tok)]


def test_the_model_state_a_kept_graph_checks_sees_replaced_tensors_and_switched_modes():
    m = variant("w4a16")
    s0 = _state(m)
    assert _state(m) == s0
    with torch.no_grad():
        m.model.norm.weight.mul_(2)  # in place: the graph reads the new values at the same address
    assert _state(m) == s0
    m.model.norm.weight = torch.nn.Parameter(m.model.norm.weight.detach().clone())
    s1 = _state(m)
    assert s1 != s0
    lin = next(x for x in m.modules() if isinstance(x, nvfp4_gemv.NVFP4Linear))
    lin.mode = "w4a4"
    assert _state(m) != s1


# ----------------------------------------------------------------------------------------------------
# GPU: the step in one CUDA graph
# ----------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.parametrize("name", ["bf16", "w4a16-fused-packed", "w4a16"])
@pytest.mark.parametrize("batch", [1, 4])
def test_gpu_greedy_from_a_graph_is_model_generates(name, batch):
    m = variant(name, "cuda")
    ids = prompt(batch, 9, "cuda")
    want = hf(m, ids, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the capture's fallback warns: it must not happen
        got = generate(m, ids, 16)
    assert torch.equal(got, want)


@gpu
def test_gpu_tokens_after_the_second_are_graph_replays_with_no_sync_between():
    m = variant("w4a16-fused-packed", "cuda")
    ids = prompt(2, 5, "cuda")
    replays, syncs = [], []
    orig_replay, orig_all = torch.cuda.CUDAGraph.replay, torch.Tensor.all
    torch.cuda.CUDAGraph.replay = lambda self: replays.append(1) or orig_replay(self)
    torch.Tensor.all = lambda self, *a, **k: syncs.append(1) or orig_all(self, *a, **k)  # the EOS check
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no eager fallback: a sync inside the step would fail its capture
            out = generate(m, ids, 12, eos_token_id=[9999 % VOCAB], sync_every=5)
    finally:
        torch.cuda.CUDAGraph.replay, torch.Tensor.all = orig_replay, orig_all
    # prefill (token 1) and one eager step (token 2), then 10 replays; the host looked twice (after 5, 10)
    assert len(replays) == 10 and len(syncs) <= 3 and out.shape[1] <= 5 + 12


class _Count:
    """Counts graph captures and replays while in a ``with``."""

    def __enter__(self):
        self.captures, self.replays = 0, 0
        self._begin, self._replay = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.replay
        begin, replay = self._begin, self._replay

        def counted_begin(g, *a, **k):
            self.captures += 1
            return begin(g, *a, **k)

        def counted_replay(g):
            self.replays += 1
            return replay(g)

        torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.replay = counted_begin, counted_replay
        return self

    def __exit__(self, *exc):
        torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.replay = self._begin, self._replay


@gpu
def test_gpu_a_second_call_replays_the_kept_step_without_capturing():
    m = variant("w4a16-fused-packed", "cuda")
    ids = prompt(2, 5, "cuda")
    with _Count() as first:
        a = generate(m, ids, 12)
    with _Count() as second:
        b = generate(m, ids, 12)
    assert (first.captures, first.replays) == (1, 10)
    assert (second.captures, second.replays) == (0, 11)  # token 1 from the prefill, 2..12 replays
    assert torch.equal(a, b) and torch.equal(a, hf(m, ids, 12))
    # another prompt and length in the same cache length: the same graph, the eager step's tokens
    other = prompt(2, 8, "cuda", seed=4)
    with _Count() as third:
        c = generate(m, other, 20, max_cache_len=32)
        d = generate(m, ids, 12, max_cache_len=32)
    assert (third.captures, third.replays) == (1, 18 + 11)
    assert torch.equal(c, generate(m, other, 20, max_cache_len=32, cuda_graph=False))
    assert torch.equal(d, generate(m, ids, 12, max_cache_len=32, cuda_graph=False))
    release(m)
    assert m not in _kept


@gpu
def test_gpu_compiled_prefill_in_front_of_the_kept_graph_serves_prompt_lengths_with_one_entry():
    """On the GPU, fused and packed W4A16 layers: the first call captures (its prefill eager); later calls
    replay the kept capture after the compiled prefill, whose first new token is the eager prefill's, and
    prompts of other lengths take the prefill's one entry (the cache's length fixed)."""
    m = variant("w4a16-fused-packed", "cuda")
    torch._dynamo.reset()
    generate(m, prompt(1, 4, "cuda"), 8, compile=True, compile_prefill=True, max_cache_len=48)  # captures
    assert prefill_graphs() == 0
    for length in (6, 11, 9):
        ids = prompt(1, length, "cuda", seed=length)
        got = generate(m, ids, 8, compile=True, compile_prefill=True, max_cache_len=48)
        want = generate(m, ids, 8, compile=True, max_cache_len=48)
        assert got.shape == want.shape and torch.equal(got[:, :length + 1], want[:, :length + 1]), length
    assert prefill_graphs() == 1
    release(m)


@gpu
def test_gpu_a_model_changed_since_its_capture_is_captured_anew():
    m = variant("bf16", "cuda")
    ids = prompt(2, 5, "cuda")
    generate(m, ids, 8)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach() * -1)  # a new address
    with _Count() as n:
        got = generate(m, ids, 8)
    assert n.captures == 1 and torch.equal(got, hf(m, ids, 8))
    quantize_model(m, fuse=True, pack=True)  # modules replaced in place
    with _Count() as n:
        got = generate(m, ids, 8)
    assert n.captures == 1 and torch.equal(got, hf(m, ids, 8))


@gpu
def test_gpu_eos_and_sampling_in_the_graph():
    m = variant("w4a16-fused-packed", "cuda")
    ids = prompt(3, 5, "cuda")
    free = hf(m, ids, 14)
    eos = int(free[1, 5 + 4])
    want = hf(m, ids, 14, eos_token_id=eos, pad_token_id=3)
    for _ in range(2):  # the second call replays the kept capture: its rows start again from not ended
        assert torch.equal(generate(m, ids, 14, eos_token_id=eos, pad_token_id=3, sync_every=4), want)
    torch.manual_seed(5)
    a = generate(m, ids, 10, do_sample=True, top_k=40, top_p=0.9, temperature=0.8)
    torch.manual_seed(5)
    b = generate(m, ids, 10, do_sample=True, top_k=40, top_p=0.9, temperature=0.8)
    assert torch.equal(a, b)


@gpu
def test_gpu_compiled_step_in_the_graph_gives_the_same_tokens():
    m = variant("w4a16-fused-packed", "cuda")
    ids = prompt(2, 5, "cuda")
    assert torch.equal(generate(m, ids, 10, compile=True), hf(m, ids, 10))


@gpu
def test_gpu_a_kept_step_replays_right_after_another_models_capture_is_released():
    """Each kept graph owns its matmuls' cuBLAS workspace. Two models' steps are captured on the one stream
    ``torch.cuda.graph`` captures on; releasing the first, dropping torch's cached workspaces (what torch 2.12
    and later do for that stream when the first graph dies; done here so that 2.11 meets it too) and emptying
    the cache (unmapping what was freed) leaves the second replaying right. In a child process: a replay into
    unmapped memory ends the CUDA context."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{os.path.dirname(os.path.dirname(here))!r}, {here!r}]
        import torch
        from test_generate import hf, prompt, tiny_llama
        from nvfp4_gemv import generate
        from nvfp4_gemv.model.generation import _kept, release
        a, b = tiny_llama(device="cuda", seed=1), tiny_llama(device="cuda", seed=2)
        ids = prompt(4, 5, "cuda")
        generate(a, ids, 8)
        want = hf(b, ids, 8)
        assert torch.equal(generate(b, ids, 8), want)
        assert a in _kept and b in _kept
        release(a)
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        got = generate(b, ids, 8)  # replays b's kept step
        torch.cuda.synchronize()
        assert torch.equal(got, want), (got, want)
        print("replayed ok", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "replayed ok" in r.stdout, r.stdout + r.stderr[-3000:]


@gpu
def test_gpu_a_step_that_cannot_be_captured_runs_eagerly_warns_once_and_keeps_nothing():
    from nvfp4_gemv import launch

    m = variant("w4a16-fused-packed", "cuda")
    ids = prompt(2, 5, "cuda")
    want = hf(m, ids, 10)

    def refuse(mod, args):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("not capturable (test)")
    hook = m.model.layers[0].register_forward_pre_hook(refuse)
    launch._warned.discard(("generate capture", type(m)))
    try:
        with pytest.warns(RuntimeWarning, match="could not be captured.*not capturable"):
            got = generate(m, ids, 10)
        assert m not in _kept
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once a process for the model's type
            again = generate(m, ids, 10)
    finally:
        hook.remove()
    assert torch.equal(got, want) and torch.equal(again, want)
