"""The ModelOpt fixtures: run by tools/make_fixtures.py in a venv with nvidia-modelopt[hf] (not ours; see there).

    python tools/fixtures_modelopt.py OUT_DIR [--only NAME ...]

For each variant: the tiny random Llama of tools/fixtures_common.py (bfloat16), ``mtq.quantize`` with the
variant's preset config calibrated on 4 random sequences, ``export_hf_checkpoint`` to OUT_DIR/NAME, then the
references from the exported tensors (fixtures_common.write_references) and fixture.json.

All on the CPU. ModelOpt's max calibration and export run there as they are. Its NVFP4 fake-quant forward
doesn't: the op needs CUDA (``AssertionError: amax must be a CUDA tensor for dynamic block quantization``). So
awq_lite, whose search runs the quantized forward, runs with that op (``tensor_quant.dynamic_block_quantize_op``)
swapped for fixtures_common.act_qdq_modelopt's torch port of ModelOpt's own GPU kernel. The checkpoint's format is
the real exporter's; the AWQ scales it chose may differ in the last bits from a GPU run.

Cross-checks in fixture.json's ``checks``: ModelOpt's own quantized model in memory (float32, the op ported)
against the references computed from the export (``max_abs_modelopt_forward_minus_...``), and for W4A4 the
activation fake-quant by ModelOpt's own CPU code, NVFP4QTensor.quantize + dequantize (the export's weight
path), against the port (``max_abs_logits_w4a4_nvfp4qtensor_minus_reference``).
"""

import argparse
import contextlib
import copy
import json
import os
import shutil
import sys
import tempfile
import warnings

import torch

import fixtures_common as fc

VARIANTS = {
    # name: (ModelOpt preset, KV-cache preset added to it, export's max_shard_size)
    "modelopt-nvfp4": ("NVFP4_DEFAULT_CFG", None, None),
    "modelopt-w4a16": ("W4A16_NVFP4_CFG", None, None),
    "modelopt-nvfp4-awq": ("NVFP4_AWQ_LITE_CFG", None, None),
    "modelopt-nvfp4-fp8kv": ("NVFP4_DEFAULT_CFG", "FP8_KV_CFG", None),
    "modelopt-nvfp4-sharded": ("NVFP4_DEFAULT_CFG", None, "100KB"),
}


@contextlib.contextmanager
def cpu_fake_quant():
    """Within: ModelOpt's NVFP4 fake-quant op (e2m1 values, e4m3 block scales) routed to the torch port; every
    other format goes to the original op."""
    import modelopt.torch.quantization.tensor_quant as tq

    original = tq.dynamic_block_quantize_op

    def op(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits):
        nvfp4 = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits, block_size) == (4, 2, 8, 4, 16)
        if not nvfp4 or amax is None:
            return original(inputs, block_size, amax, num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        # the kernel takes the global amax; input_scale = amax / (6 * 448)
        return fc.act_qdq_modelopt(inputs, amax.float().amax() / (6.0 * 448.0)).to(inputs.dtype)

    tq.dynamic_block_quantize_op = op
    try:
        yield
    finally:
        tq.dynamic_block_quantize_op = original


def qtensor_act(x, layer_act):
    """An activation fake-quant by ModelOpt's own CPU code: NVFP4QTensor.quantize then dequantize (the code that
    quantizes weights at export) with weights_scaling_factor_2 = input_scale."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    q, scale, scale_2 = NVFP4QTensor.quantize(x.float().clone(), 16, weights_scaling_factor_2=layer_act["input_scale"])
    return q.dequantize(dtype=torch.float32, scale=scale, double_scale=scale_2, block_sizes={-1: 16}).to(x.dtype)


def producer_forward(model):
    """float32 logits of the reference prompt by ModelOpt's own quantized model (a copy, before export): the
    fused layers' scales unified as export unifies them (its requantize_resmooth_fused_llm_layers), the KV-cache
    quantizers off (the references leave the cache alone), the CUDA-only op ported. None (with the reason
    printed) if that internal API moved."""
    from modelopt.torch.quantization import disable_quantizer

    try:
        from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

        m = copy.deepcopy(model)
        with cpu_fake_quant(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            requantize_resmooth_fused_llm_layers(m)
            disable_quantizer(m, "*bmm_quantizer*")
            with torch.no_grad():
                return m.float()(input_ids=fc.prompt_tokens()).logits
    except Exception as e:  # a cross-check only
        print(f"   no producer forward cross-check: {type(e).__name__}: {e}", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*", help="variant names (default: all)")
    args = ap.parse_args()

    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    vers = fc.versions("nvidia-modelopt")
    calib = fc.calib_tokens()

    def forward_loop(model):
        with torch.no_grad():
            for row in calib:
                model(input_ids=row[None])

    for name, (preset, kv, shard) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        print(f"== {name}", flush=True)
        cfg = copy.deepcopy(getattr(mtq, preset))
        if kv:
            cfg["quant_cfg"] = list(cfg["quant_cfg"]) + list(copy.deepcopy(getattr(mtq, kv))["quant_cfg"])
        notes = []
        path = os.path.join(args.out, name)
        shutil.rmtree(path, ignore_errors=True)
        with tempfile.TemporaryDirectory() as dense:
            if cfg.get("algorithm") in (None, "max"):  # calibration only collects amax: no fake-quant forward
                model = mtq.quantize(fc.dense_model(dense), cfg, forward_loop)
            else:
                with cpu_fake_quant():
                    model = mtq.quantize(fc.dense_model(dense), cfg, forward_loop)
                notes.append(f"algorithm {cfg['algorithm']!r} ran on the CPU with ModelOpt's NVFP4 fake-quant op "
                             "(CUDA-only) replaced by a torch port of its GPU kernel "
                             "(fixtures_common.act_qdq_modelopt)")
            forward = producer_forward(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                export_hf_checkpoint(model, export_dir=path, **({"max_shard_size": shard} if shard else {}))
        with open(os.path.join(path, "hf_quant_config.json")) as f:
            algo = json.load(f)["quantization"]["quant_algo"]
        w4a4 = algo in ("NVFP4", "NVFP4_AWQ")
        info = dict(
            name=name, producer=dict(name="nvidia-modelopt", version=vers["nvidia-modelopt"], packages=vers),
            scheme=algo,
            config=dict(preset=f"mtq.{preset}" + (f" + mtq.{kv}" if kv else ""),
                        algorithm=cfg.get("algorithm"), quant_cfg=cfg["quant_cfg"],
                        export="export_hf_checkpoint(model, export_dir"
                               + (f", max_shard_size={shard!r})" if shard else ")")),
            notes=notes + ([f"KV cache FP8: the references do not apply k_scale / v_scale (the cache stays in "
                            "the model's dtype)"] if kv else []),
        )
        if w4a4:
            info["w4a4_description"] = (
                "float32 [2, 8, vocab]: as logits_w4a16_fp32, and each quantized linear's input x (times "
                "pre_quant_scale where present) fake-quantized with its input_scale by ModelOpt's semantics "
                "(its GPU kernel fp4_fake_quant_block, restated in torch: ModelOpt has no CPU path): gs = "
                "input_scale; per 16 consecutive values s = float(e4m3(min(amax16 / (6 * gs), 448))) * gs, s = 1 "
                "where s < 1e-5; x_q = sign(x) * e2m1_round(|x| / s) * s, nearest with ties to even, saturating at 6")
        # W4A4: the port of ModelOpt's GPU kernel against ModelOpt's own torch quantize/dequantize (its export path)
        fc.write_references(path, "modelopt", w4a4, info, producer_logits={"modelopt_forward": forward},
                            crosscheck_acts={"nvfp4qtensor": qtensor_act} if w4a4 else None)
        print(f"   wrote {path}: {sorted(os.listdir(path))}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
