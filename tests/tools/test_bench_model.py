"""tools/bench_model.py's CPU-safe parts: argument parsing, the step's shapes and bytes, and a tiny run of
both benchmarks on the CPU (eager; graphs and compile need CUDA and say so)."""

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import bench_model  # noqa: E402


def test_defaults_and_quick():
    a = bench_model.parse_args([])
    assert a.step and not a.hf and a.n == [1, 4, 16] and a.batches == [1, 4, 16] and a.reps == 100
    assert a.variants == ["bf16", "w4a16", "w4a4", "torchao"] and a.modes == ["eager", "graph", "compile"]
    q = bench_model.parse_args(["--hf", "--quick"])
    assert q.hf and not q.step and q.n == [1, 16] and q.batches == [1, 16] and q.reps == 20 and q.tokens == 16
    assert bench_model.parse_args(["--n", "2,8", "--modes", "graph"]).n == [2, 8]
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--variants", "fp8"])


def test_the_step_has_llama3_8b_linears_and_their_fp4_bytes():
    step = bench_model.build_step(8, bench_model.LLAMA3_8B, "meta")
    shapes = {(m.out_features, m.in_features) for m in step.modules() if isinstance(m, torch.nn.Linear)}
    assert shapes == {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    per_layer = sum(m * k for m, k in shapes) * (1 / 2 + 1 / 16)
    assert bench_model.fp4_bytes(step) == 8 * per_layer


def test_tiny_cpu_run_writes_the_tables_and_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "r.json"
    bench_model.main(["--device", "cpu", "--tiny", "--step", "--hf", "--layers", "1", "--n", "2", "--reps", "1",
                      "--variants", "bf16,w4a16,w4a4", "--batches", "1", "--tokens", "1",
                      "--hf-variants", "bf16,w4a16", "--json", str(out)])
    text = capsys.readouterr().out
    assert "| w4a4 | 2 |" in text and "n/a (needs CUDA)" in text and "| w4a16 | 1 |" in text
    r = json.loads(out.read_text())
    rows = {x["variant"]: x for x in r["step"]["rows"]}
    assert set(rows) == {"bf16", "w4a16", "w4a4"} and all(x["eager"] > 0 for x in rows.values())
    hf = {x["variant"]: x for x in r["hf"]["rows"]}
    assert hf["w4a16"]["weight_GB"] < hf["bf16"]["weight_GB"] and hf["w4a16"]["ms_per_token"] > 0


def test_hf_profile_lists_where_a_token_goes(capsys):
    pytest.importorskip("transformers")
    r = bench_model.bench_hf(bench_model.parse_args(["--hf", "--device", "cpu", "--tiny", "--batches", "1",
                                                      "--tokens", "1", "--hf-variants", "w4a16", "--hf-fuse",
                                                      "--hf-profile", "2"]), torch.device("cpu"))
    row = r["rows"][0]
    assert row["fused"] and row["profile"]["steps"] == 2 and row["profile"]["top"]
    assert any("nvfp4" in t["name"] for t in row["profile"]["top"])
    assert "profile of w4a16 fused batch 1" in capsys.readouterr().out


def test_hf_pack_runs_packed_layers_and_refuses_w4a4(capsys):
    pytest.importorskip("transformers")
    args = bench_model.parse_args(["--hf", "--device", "cpu", "--tiny", "--batches", "1", "--tokens", "1",
                                   "--hf-variants", "w4a16", "--hf-fuse", "--hf-pack"])
    r = bench_model.bench_hf(args, torch.device("cpu"))
    row = r["rows"][0]
    assert row["fused"] and row["packed"] and row["ms_per_token"] > 0 and r["meta"]["pack"]
    assert "w4a16  fused packed batch  1:" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="w4a16 only"):
        bench_model.bench_hf(bench_model.parse_args(["--hf", "--device", "cpu", "--tiny", "--hf-variants", "w4a4",
                                                     "--hf-pack"]), torch.device("cpu"))


def test_hf_lm_head_quantizes_the_lm_head_too():
    pytest.importorskip("transformers")
    rows = {}
    for extra in ([], ["--hf-lm-head"]):
        args = bench_model.parse_args(["--hf", "--device", "cpu", "--tiny", "--batches", "1", "--tokens", "1",
                                       "--hf-no-step", "--hf-generate", "ours_generate_ms", "--hf-variants", "w4a16", *extra])
        r = bench_model.bench_hf(args, torch.device("cpu"))
        rows[bool(extra)] = r["rows"][0]
        assert r["meta"]["lm_head"] is bool(extra)
    assert rows[True]["lm_head"] and not rows[False]["lm_head"]
    assert rows[True]["weight_GB"] < rows[False]["weight_GB"]  # the lm_head's bf16 bytes replaced by NVFP4


def test_w4a4_via_w4a16_sets_the_route_threshold_for_the_run(monkeypatch):
    import nvfp4_gemv.model.linear as lin

    monkeypatch.setattr(lin, "W4A4_VIA_W4A16_FROM", None)
    r = bench_model.main(["--device", "cpu", "--tiny", "--step", "--layers", "1", "--n", "20", "--reps", "1",
                          "--variants", "w4a4", "--modes", "eager", "--w4a4-via-w4a16", "17"])
    assert lin.W4A4_VIA_W4A16_FROM == 17 and r["args"]["w4a4_via_w4a16"] == 17
    assert r["step"]["rows"][0]["eager"] > 0


def test_hf_qwen3_moe_runs_its_experts_as_nvfp4_experts(capsys):
    """``--arch qwen3-moe``: Qwen3-MoE's model with its routed experts as NVFP4Experts in both modes (the
    experts' input scales calibrated too), the table naming the class."""
    import torch

    from nvfp4_gemv import NVFP4Experts

    seen = []
    real = NVFP4Experts.forward

    def forward(self, *a, **k):
        seen.append(self.mode)
        return real(self, *a, **k)
    NVFP4Experts.forward = forward
    try:
        r = bench_model.bench_hf(bench_model.parse_args(["--hf", "--arch", "qwen3-moe", "--device", "cpu", "--tiny",
                                                          "--batches", "1", "--tokens", "1", "--hf-no-step",
                                                          "--hf-variants", "bf16,w4a16,w4a4",
                                                          "--hf-generate", "generate_ms"]), torch.device("cpu"))
    finally:
        NVFP4Experts.forward = real
    assert r["meta"]["arch"] == "qwen3-moe" and {"w4a16", "w4a4"} <= set(seen)
    assert [row["variant"] for row in r["rows"]] == ["bf16", "w4a16", "w4a4"]
    assert all("generate_ms" in row for row in r["rows"]), r["rows"]
    assert bench_model.hf_table(r).startswith("Qwen3MoeForCausalLM, a tiny config")


def test_hf_routers_runs_our_variants_routers_as_topk_router():
    """``--hf-routers``: the quantized variants' routers are ``TopKRouter`` (bf16 keeps transformers')."""
    import torch

    from nvfp4_gemv import TopKRouter

    calls = []
    real = TopKRouter.forward

    def forward(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k)
    TopKRouter.forward = forward
    try:
        r = bench_model.bench_hf(bench_model.parse_args(["--hf", "--arch", "qwen3-moe", "--device", "cpu", "--tiny",
                                                          "--batches", "1", "--tokens", "1", "--hf-no-step",
                                                          "--hf-variants", "bf16,w4a16", "--hf-routers",
                                                          "--hf-generate", "generate_ms"]), torch.device("cpu"))
    finally:
        TopKRouter.forward = real
    assert calls and [row["routers"] for row in r["rows"]] == [False, True]


def test_hf_times_nvfp4_generate_prefill_alone_keeping_the_step(capsys):
    """``nvfp4_gemv.generate``'s rows carry ``..._prefill_ms`` (a one-token call of the same cache length) and,
    with ``--hf-prefill-profile``, cProfile's text of those calls."""
    import torch

    r = bench_model.bench_hf(bench_model.parse_args(["--hf", "--device", "cpu", "--tiny", "--batches", "1",
                                                      "--tokens", "2", "--hf-no-step", "--hf-variants", "bf16",
                                                      "--hf-generate", "ours_generate_ms",
                                                      "--hf-prefill-profile", "1"]), torch.device("cpu"))
    row = r["rows"][0]
    assert row["ours_generate_prefill_ms"] > 0 and "ncalls" in row["ours_generate_prefill_profile"]
    assert "ours_generate_prefill_profile of bf16" in capsys.readouterr().out
