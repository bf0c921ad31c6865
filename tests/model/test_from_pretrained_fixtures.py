"""nvfp4_gemv.from_pretrained on the real producers' tiny checkpoints (tests/fixtures/checkpoints/, made by
tools/make_fixtures.py with NVIDIA ModelOpt and llm-compressor), on the CPU, against the references stored
beside them (reference.safetensors, described in each fixture.json): W4A16 logits within bf16 rounding of
the producer-side float32 reference and greedy tokens equal to its bf16 ones; mode "w4a4" loads and runs
(its logits are not compared: on these random tiny models a bf16-versus-exact rounding of an activation
moves logits by O(1), in our own fake-quant reference too). transformers' door gives the same bits."""

import os
import shutil
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

from nvfp4_gemv import NVFP4Linear, PreScaledNVFP4Linear, from_pretrained  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "checkpoints")
NAMES = sorted(n for n in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, n))) if os.path.isdir(ROOT) else []
pytestmark = pytest.mark.skipif(not NAMES, reason="no fixtures (tools/make_fixtures.py)")


def checkpoint(name, tmp_path):
    """The fixture's checkpoint alone (reference.safetensors left out: a loader takes every .safetensors of a
    folder without an index, and an index names what it holds)."""
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(ROOT, name), dst, ignore=shutil.ignore_patterns("reference.safetensors"))
    return dst, load_file(os.path.join(ROOT, name, "reference.safetensors"))


@pytest.mark.parametrize("name", NAMES)
def test_w4a16_logits_within_bf16_rounding_and_greedy_tokens_of_the_producers_reference(name, tmp_path):
    path, ref = checkpoint(name, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (fp8kv: its KV-cache scales are ignored, said so)
        model = from_pretrained(path, device="cpu")
    assert sum(isinstance(m, NVFP4Linear) for m in model.modules()) >= 13
    assert not any(isinstance(m, PreScaledNVFP4Linear) for m in model.modules()) or "awq" in name
    ids = ref["input_ids"]
    with torch.no_grad():
        got = model(ids).logits.float()
    want = ref["logits_w4a16_fp32"]
    assert (got - want).abs().max() <= 0.02 * want.abs().max()
    out = model.generate(ids, max_new_tokens=ref["greedy_tokens_bf16"].shape[1] - ids.shape[1], do_sample=False,
                         cache_implementation="static")
    assert torch.equal(out, ref["greedy_tokens_bf16"])


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith(("nvfp4", "awq", "fp8kv", "sharded"))])
def test_w4a4_loads_and_generates(name, tmp_path):
    path, ref = checkpoint(name, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = from_pretrained(path, mode="w4a4", device="cpu")
    assert all(m.mode == "w4a4" and m.input_scale is not None for m in model.modules() if isinstance(m, NVFP4Linear))
    out = model.generate(ref["input_ids"], max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert out.shape == (2, ref["input_ids"].shape[1] + 4)


def test_the_fp8_kv_cache_fixture_warns_that_its_scales_are_ignored(tmp_path):
    if "modelopt-nvfp4-fp8kv" not in NAMES:
        pytest.skip("no fp8kv fixture")
    path, _ = checkpoint("modelopt-nvfp4-fp8kv", tmp_path)
    with pytest.warns(RuntimeWarning, match="KV-cache scales \\(FP8\\) ignored"):
        from_pretrained(path, device="cpu")


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("modelopt")])
def test_transformers_door_on_the_modelopt_fixtures(name, tmp_path):
    path, ref = checkpoint(name, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        ours = from_pretrained(path, device="cpu")
    with torch.no_grad():
        assert torch.equal(model(ref["input_ids"]).logits, ours(ref["input_ids"]).logits)
