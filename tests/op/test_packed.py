"""The packed weight layout (``nvfp4_gemv.packed``) and its users: ``pack_weight`` / ``unpack_weight``,
the op ``gemv_packed`` (``torch.ops.nvfp4.gemv_packed``), ``NVFP4Linear.pack`` and the ``pack=`` of
``quantize_model`` and ``load_modelopt``.

The contract: the layout is the documented one byte for byte and unpacks exactly; ``gemv_packed`` gives
``gemv(x, None, w, w_scale, ...)``'s result bit for bit (the same kernel, only its loads' addresses differ),
on the CPU (exact reference) and on the GPU (and within the W4A16 float64 bound there); a packed layer's
state_dict is the unpacked layer's, key for key and byte for byte; bad input raises naming the argument."""

import copy

import pytest
import torch

from nvfp4_gemv import NVFP4Linear, fuse_linears, gemv, gemv_packed, pack_weight, quantize_model, unpack_weight
from w4a16_inputs import w4a16_exact, w4a16_inputs, w4a16_violations
from sync_free import no_syncs

cuda = pytest.mark.gpu


def weight(m, k, seed=0, device="cpu"):
    _, _, w, ws, a = w4a16_inputs(1, m, k, seed, device=device)
    return w, ws, a


# ----------------------------------------------------------------------------------------------------
# The layout
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m,k", [(128, 128), (256, 384), (384, 1024), (128, 32768)])
def test_the_layout_is_the_documented_one_byte_for_byte(m, k):
    """Group i (8 rows), slice s (128 values): 576 bytes at (i * K/128 + s) * 576, row r's 64 bytes of w at
    r * 64, its 8 scale bytes at 512 + r * 8."""
    w, ws, _ = weight(m, k, seed=m + k)
    flat = pack_weight(w, ws).reshape(-1)
    assert flat.numel() == m * 9 * k // 16
    slices = k // 128
    i, s, r, b = torch.meshgrid(torch.arange(m // 8), torch.arange(slices), torch.arange(8), torch.arange(64),
                                indexing="ij")
    at = (i * slices + s) * 576 + r * 64 + b
    assert torch.equal(flat[at], w[8 * i + r, 64 * s + b])
    i, s, r, j = torch.meshgrid(torch.arange(m // 8), torch.arange(slices), torch.arange(8), torch.arange(8),
                                indexing="ij")
    at = (i * slices + s) * 576 + 512 + r * 8 + j
    assert torch.equal(flat[at], ws.view(torch.uint8)[8 * i + r, 8 * s + j])


@pytest.mark.parametrize("m,k", [(256, 128), (640, 2048)])
def test_unpack_inverts_pack_exactly_and_row_groups_stay_valid(m, k):
    w, ws, _ = weight(m, k, seed=3)
    p = pack_weight(w, ws)
    w2, ws2 = unpack_weight(p)
    assert w2.dtype == torch.uint8 and ws2.dtype == torch.float8_e4m3fn
    assert torch.equal(w2, w) and torch.equal(ws2.view(torch.uint8), ws.view(torch.uint8))
    # rows 128a .. 128b of the packed weight are the packed rows of the weight (fused groups slice rows)
    assert torch.equal(p[128:m], pack_weight(w[128:m], ws[128:m]))
    assert torch.equal(pack_weight(w.view(torch.float4_e2m1fn_x2), ws.view(torch.uint8)), p)


PACK_ERRORS = [
    ("w not a tensor", lambda w, ws: (w.tolist(), ws), TypeError, "'w'"),
    ("w of another dtype", lambda w, ws: (w.to(torch.int16), ws), TypeError, "'w'.*uint8"),
    ("K not a multiple of 128", lambda w, ws: (w[:, :96], ws[:, :12]), ValueError, "'w'.*K % 128"),
    ("M not a multiple of 128", lambda w, ws: (w[:64], ws[:64]), ValueError, "'w'.*M % 128"),
    ("w_scale mis-shaped", lambda w, ws: (w, ws[:, :8]), ValueError, "'w_scale'.*\\(128, 16\\)"),
    ("w_scale of another dtype", lambda w, ws: (w, ws.float()), ValueError, "'w_scale'.*float8_e4m3fn"),
    ("w_scale on another device", lambda w, ws: (w, ws.to("meta")), ValueError, "'w_scale'.*on cpu"),
]


@pytest.mark.parametrize("what, edit, exc, match", PACK_ERRORS, ids=[e[0] for e in PACK_ERRORS])
def test_pack_weight_refuses_bad_input_naming_the_argument(what, edit, exc, match):
    w, ws, _ = weight(128, 256)
    with pytest.raises(exc, match=match):
        pack_weight(*edit(w, ws))


# ----------------------------------------------------------------------------------------------------
# The op
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alpha", [True, False])
def test_gemv_packed_equals_gemv_bit_for_bit_on_the_cpu(n, dtype, out_dtype, alpha):
    x, _, w, ws, a = w4a16_inputs(n, 256, 512, seed=n + 7, dtype=dtype, device="cpu", alpha=alpha)
    want = gemv(x, None, w, ws, a, out_dtype=out_dtype)
    p = pack_weight(w, ws)
    assert torch.equal(gemv_packed(x, p, a, out_dtype=out_dtype), want)
    assert torch.equal(torch.ops.nvfp4.gemv_packed(x, p, a, out_dtype), want)
    out = torch.full((n, 256), float("nan"), dtype=out_dtype)
    assert gemv_packed(x, p, a, out=out) is out and torch.equal(out, want)


def test_the_ops_pass_opcheck():
    x, _, w, ws, a = w4a16_inputs(2, 128, 256, seed=1, device="cpu")
    p = pack_weight(w, ws)
    torch.library.opcheck(torch.ops.nvfp4.gemv_packed.default, (x, p, a, torch.bfloat16))
    torch.library.opcheck(torch.ops.nvfp4.gemv_packed_out.default, (x, p, a, torch.empty(2, 128, dtype=torch.bfloat16)))


def test_compiles_fullgraph_to_the_op():
    x, _, w, ws, a = w4a16_inputs(2, 128, 256, seed=2, device="cpu")
    p = pack_weight(w, ws)
    graphs = []

    def backend(gm, _inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    f = torch.compile(lambda x: gemv_packed(x, p, a), fullgraph=True, backend=backend)
    assert torch.equal(f(x), gemv(x, None, w, ws, a))
    assert any("nvfp4.gemv_packed" in str(nd.target) for nd in graphs[0].graph.nodes)


def _op_args():
    x, _, w, ws, a = w4a16_inputs(2, 128, 256, seed=5, device="cpu")
    return dict(x=x, w_packed=pack_weight(w, ws), alpha=a, out_dtype=torch.bfloat16, out=None)


OP_ERRORS = [
    ("x of fp32", dict(x=lambda d: d["x"].float()), TypeError, "'x'.*bfloat16"),
    ("x of another K", dict(x=lambda d: d["x"][:, :128]), ValueError, "'x'.*K = 256"),
    ("x of no rows", dict(x=lambda d: d["x"][:0]), ValueError, "'x'.*N"),
    ("w_packed unpacked", dict(w_packed=lambda d: unpack_weight(d["w_packed"])[0]), ValueError, "'w_packed'.*9K/16"),
    ("w_packed of fp16", dict(w_packed=lambda d: d["w_packed"].half()), TypeError, "'w_packed'.*uint8"),
    ("alpha of fp16", dict(alpha=lambda d: d["alpha"].half()), TypeError, "'alpha'.*float32"),
    ("alpha a float", dict(alpha=lambda d: 0.5), TypeError, "'alpha'"),
    ("out mis-shaped", dict(out=lambda d: torch.empty(2, 256, dtype=torch.bfloat16)), ValueError, "'out'.*\\[2, 128\\]"),
    ("out of fp32", dict(out=lambda d: torch.empty(2, 128)), TypeError, "'out'"),
    ("out_dtype fp32", dict(out_dtype=lambda d: torch.float32), TypeError, "'out_dtype'"),
]


@pytest.mark.parametrize("what, edits, exc, match", OP_ERRORS, ids=[e[0] for e in OP_ERRORS])
def test_gemv_packed_refuses_bad_input_naming_the_argument(what, edits, exc, match):
    args = _op_args()
    for k, f in edits.items():
        args[k] = f(args)
    with pytest.raises(exc, match=match):
        gemv_packed(**args)


# ----------------------------------------------------------------------------------------------------
# NVFP4Linear.pack and the model-level pack=
# ----------------------------------------------------------------------------------------------------


def layer(in_f=256, out_f=384, bias=True, mode="w4a16", seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16)
    return NVFP4Linear.from_linear(lin, mode=mode, input_scale=0.01 if mode == "w4a4" else None)


def state_bytes(mod):
    return {k: (v.dtype, tuple(v.shape), v.reshape(-1).view(torch.uint8).clone() if v.dim() else v.clone())
            for k, v in mod.state_dict().items()}


def same_state(a, b):
    sa, sb = state_bytes(a), state_bytes(b)
    return list(sa) == list(sb) and all(sa[k][:2] == sb[k][:2] and torch.equal(sa[k][2], sb[k][2]) for k in sa)


def test_a_packed_layer_computes_the_same_bits_and_keeps_modelopts_state_dict():
    plain = layer()
    packed = copy.deepcopy(plain).pack()
    assert packed.packed and packed.weight.shape == (384, 9 * 256 // 16) and packed.weight_scale is None
    assert "packed=True" in repr(packed)
    x = torch.randn(2, 5, 256, dtype=torch.bfloat16)
    assert torch.equal(packed(x), plain(x))
    assert same_state(packed, plain)
    assert packed.pack() is packed  # idempotent
    assert packed.to(torch.float16).weight.dtype == torch.uint8  # the format's buffers keep their dtype


def test_a_packed_layer_loads_modelopts_state_dict():
    plain = layer(seed=1)
    fresh = NVFP4Linear(256, 384, bias=True).pack()
    fresh.load_state_dict(plain.state_dict())
    assert fresh.packed and same_state(fresh, plain)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), plain(x))


def test_a_packed_layers_load_reports_a_missing_or_mis_shaped_scale_by_name():
    sd = layer(seed=2).state_dict()
    fresh = NVFP4Linear(256, 384, bias=True).pack()
    with pytest.raises(RuntimeError, match='Missing key\\(s\\) in state_dict: "weight_scale"\\.'):
        fresh.load_state_dict({k: v for k, v in sd.items() if k != "weight_scale"})
    bad = dict(sd, weight_scale=sd["weight_scale"][:, :8])
    with pytest.raises(RuntimeError, match="'weight_scale' float8_e4m3fn \\(384, 16\\)") as e:
        fresh.load_state_dict(bad)
    assert "Missing" not in str(e.value)
    with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "extra"'):
        fresh.load_state_dict(dict(sd, extra=torch.zeros(1)))


def test_a_partial_non_strict_load_keeps_the_other_half():
    old, new = layer(seed=5), layer(seed=6)
    packed = copy.deepcopy(old).pack()
    res = packed.load_state_dict({"weight_scale": new.weight_scale}, strict=False)
    assert res.missing_keys == ["weight", "weight_scale_2", "bias"]
    want = copy.deepcopy(old)
    want.load_state_dict({"weight_scale": new.weight_scale}, strict=False)
    assert same_state(packed, want)
    res = packed.load_state_dict({"weight": new.weight}, strict=False)
    assert "weight_scale" in res.missing_keys and res.missing_keys.count("weight") == 0
    want.load_state_dict({"weight": new.weight}, strict=False)
    assert same_state(packed, want)


def test_rows_of_a_packed_weight_must_start_at_an_eight_row_group():
    x, _, w, ws, a = w4a16_inputs(1, 256, 256, seed=8, device="cpu")
    p = pack_weight(w, ws)
    assert torch.equal(gemv_packed(x, p[128:256], a), gemv(x, None, w[128:], ws[128:], a))
    with pytest.raises(ValueError, match="'w_packed'.*multiple of 8 rows"):
        gemv_packed(x, torch.cat([p, p])[4:132], a)
    with pytest.raises(ValueError, match="'w_packed'.*contiguous"):
        gemv_packed(x, torch.cat([p, p], dim=1)[:, :144], a)


@pytest.mark.parametrize("in_f, mode, match", [(192, "w4a16", "in_features % 128"), (256, "w4a4", "mode 'w4a16' only")])
def test_pack_refuses_what_the_layout_cannot_run(in_f, mode, match):
    mod = layer(in_f=in_f, mode=mode)
    with pytest.raises(ValueError, match=match):
        mod.pack()
    assert not mod.packed and mod.weight_scale is not None


def test_a_packed_layer_switched_to_w4a4_refuses_to_run():
    mod = layer().pack()
    mod.input_scale = torch.tensor(0.01)
    mod.mode = "w4a4"
    with pytest.raises(ValueError, match="packed weight runs mode 'w4a16' only"):
        mod(torch.randn(1, 256, dtype=torch.bfloat16))


class Block(torch.nn.Module):
    def __init__(self, odd=False):
        super().__init__()
        torch.manual_seed(4)
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False, dtype=torch.bfloat16)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(256, 256), lin(256, 128), lin(256, 128)
        self.o_proj = lin(256, 256)
        self.odd = lin(192, 128) if odd else None  # in_features % 128 == 64: not packable

    def forward(self, x):
        y = self.o_proj(self.q_proj(x) + torch.cat([self.k_proj(x), self.v_proj(x)], -1))
        return y if self.odd is None else (y, self.odd(x[..., :192]))


def test_quantize_model_packs_what_it_can_and_fuses_packed_groups():
    base = Block(odd=True)
    plain = quantize_model(copy.deepcopy(base), skip=(), fuse=True)
    packed = quantize_model(copy.deepcopy(base), skip=(), fuse=True, pack=True)
    assert [m.packed for m in (packed.q_proj, packed.k_proj, packed.v_proj, packed.o_proj)] == [True] * 4
    assert not packed.odd.packed
    assert packed.q_proj._siblings is not None and packed.q_proj._siblings.active
    assert packed.k_proj.weight.data_ptr() == packed.q_proj._fused_weight.data_ptr() + 256 * 144
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    got, want = packed(x), plain(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert same_state(packed, plain)
    with pytest.raises(ValueError, match="'pack'.*w4a16"):
        quantize_model(copy.deepcopy(base), mode="w4a4", pack=True, input_scales={})


def test_packing_one_part_of_a_fused_group_packs_the_group():
    base = Block()
    ref = quantize_model(copy.deepcopy(base), skip=(), fuse=True)
    model = quantize_model(copy.deepcopy(base), skip=(), fuse=True)
    model.k_proj.pack()
    assert model.q_proj.packed and model.v_proj.packed and not model.o_proj.packed
    assert model.q_proj._siblings.active and model.q_proj._fused_weight_scale is None
    assert model.q_proj.weight.data_ptr() == model.q_proj._fused_weight.data_ptr()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    assert torch.equal(model(x), ref(x))
    assert same_state(model, ref)


def test_packing_a_group_whose_part_was_replaced_dissolves_it_and_stays_right():
    base = Block()
    model = quantize_model(copy.deepcopy(base), skip=(), fuse=True)
    with pytest.warns(UserWarning, match="was replaced"):  # noticed at the assignment: the group ends
        model.k_proj.weight_scale_2 = model.k_proj.weight_scale_2 * 2
    ref = copy.deepcopy(model)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    want = ref(x)  # each part alone
    model.k_proj.pack()
    assert not model.q_proj._siblings.active and model.k_proj.packed and not model.q_proj.packed
    assert torch.equal(model(x), want)


def test_packing_a_group_whose_part_was_replaced_behind_setattr_dissolves_it():
    # torch.func.functional_call writes a module's buffer dict directly: pack() compares the parts' buffers
    model = quantize_model(Block(), skip=(), fuse=True)
    model.k_proj._buffers["weight_scale_2"] = model.k_proj.weight_scale_2 * 2
    ref = copy.deepcopy(model)
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="was replaced"):
        want = ref(x)  # the eager call notices, and each part computes alone
    with pytest.warns(UserWarning, match="was replaced"):
        model.k_proj.pack()
    assert not model.q_proj._siblings.active and model.k_proj.packed and not model.q_proj.packed
    assert torch.equal(model(x), want)


def test_packed_and_unpacked_siblings_are_not_fused():
    model = quantize_model(Block(), skip=())
    model.q_proj.weight_scale_2 = model.k_proj.weight_scale_2 = model.v_proj.weight_scale_2
    model.q_proj.pack()
    assert fuse_linears(model) == []
    model.k_proj.pack()
    model.v_proj.pack()
    assert len(fuse_linears(model)) == 1


# ----------------------------------------------------------------------------------------------------
# On the GPU
# ----------------------------------------------------------------------------------------------------


GPU_CASES = [(n, 512, 1024) for n in (1, 2, 3, 4, 8, 9, 16, 17, 32, 33)] + \
    [(1, 6144, 4096), (1, 4096, 14336), (4, 7168, 16384), (16, 28672, 4096), (2, 4352, 28672), (1, 128, 32768),
     (1, 4352, 4096), (129, 256, 2048)]


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,m,k", GPU_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gemv_packed_equals_gemv_bit_for_bit_and_float64_within_the_bound(n, m, k, dtype):
    x, _, w, ws, a = w4a16_inputs(n, m, k, seed=n + m + k, dtype=dtype)
    p = pack_weight(w, ws)
    out = torch.full((n, m), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert gemv_packed(x, p, a, out=out) is out
    want = gemv(x, None, w, ws, a)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    exact, terms = w4a16_exact(x, w, ws, a)
    bad, msg = w4a16_violations(out, exact, terms, slack=2.0 ** -12 if n >= 129 else 2.0 ** -13)
    assert bad == 0, msg


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("cancel", [False, True])
def test_gpu_cancelling_sums_and_fp16_out_without_alpha(cancel):
    x, _, w, ws, a = w4a16_inputs(5, 1024, 8192, seed=9, cancel=cancel, alpha=False)
    got = gemv_packed(x, pack_weight(w, ws), a, out_dtype=torch.float16)
    exact, terms = w4a16_exact(x, w, ws, a)
    assert w4a16_violations(got, exact, terms)[0] == 0


@cuda
@pytest.mark.gpu
def test_gpu_a_cuda_graph_replays_the_packed_kernel_and_validation_never_syncs():
    x, _, w, ws, a = w4a16_inputs(4, 512, 2048, 2)
    p = pack_weight(w, ws)
    out = torch.empty(4, 512, dtype=torch.bfloat16, device="cuda")
    gemv_packed(x, p, a, out=out)
    with no_syncs():
        gemv_packed(x, p, a, out=out)
        gemv_packed(x, p[128:256], a)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv_packed(x, p, a, out=out)
    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    exact, terms = w4a16_exact(x, w, ws, a)
    assert w4a16_violations(out, exact, terms)[0] == 0


@cuda
@pytest.mark.gpu
def test_gpu_compiled_fullgraph_runs_the_packed_op():
    x, _, w, ws, a = w4a16_inputs(3, 256, 512, 4)
    p = pack_weight(w, ws)
    torch._dynamo.reset()
    f = torch.compile(lambda x: gemv_packed(x, p, a), fullgraph=True)
    assert torch.equal(f(x), gemv(x, None, w, ws, a))


@cuda
@pytest.mark.gpu
def test_gpu_a_misaligned_packed_view_is_refused():
    x, _, w, ws, a = w4a16_inputs(1, 256, 512, 6)
    p = pack_weight(w, ws)
    bad = p.reshape(-1)[8:8 + 128 * 288].view(128, 288)  # contiguous, 8 bytes into an 8-row group
    with pytest.raises(ValueError, match="nvfp4_gemv.gemv_packed: argument 'w_packed'.*multiple of 8 rows"):
        gemv_packed(x, bad, a)
    assert torch.equal(gemv_packed(x, p[:128], a), gemv(x, None, w[:128], ws[:128], a))  # this metadata's plan
    # the same metadata at a base address 8 bytes off a 16-byte boundary (a storage that starts there):
    # the cached plan's per-call address check refuses it
    base = torch.empty(0, dtype=torch.uint8, device=p.device).set_(p.untyped_storage()[8:], 0, (128, 288))
    assert base.storage_offset() == 0 and base.data_ptr() % 16 == 8
    with pytest.raises(ValueError, match="nvfp4_gemv.gemv_packed: argument 'w_packed'.*16-byte aligned"):
        gemv_packed(x, base, a)
