"""The llm-compressor fixtures (compressed-tensors, format nvfp4-pack-quantized): run by tools/make_fixtures.py in
a venv with llmcompressor (not ours; see there).

    python tools/fixtures_llmcompressor.py OUT_DIR [--only NAME ...]

For each scheme: the tiny random Llama of tools/fixtures_common.py (bfloat16, loaded from a temporary folder
beside a word-level tokenizer of its 256 ids: ``oneshot`` wants a model with a path and a processor),
``oneshot`` with ``QuantizationModifier(targets="Linear", scheme=..., ignore=["lm_head", "re:..."])`` on the
4 calibration sequences, ``save_pretrained(OUT_DIR/NAME, save_compressed=True)``, then the references from the
saved tensors (fixtures_common.write_references) and fixture.json. All on the CPU, as the producer runs there.

W4A4 references: logits_w4a4_fp32 runs compressed-tensors' own CPU fake-quant functions
(``compute_dynamic_scales_and_zp`` + ``fake_quantize`` with the saved ``input_global_scale`` and the config's
input_activations args) on each quantized linear's float32 input. fixture.json's checks record how far
fixtures_common.act_qdq_ct, an independent restatement, lands from it, and how far llm-compressor's own
quantized model in memory (float32) lands from the references computed from the saved tensors.
"""

import argparse
import copy
import os
import shutil
import sys
import tempfile

import torch

import fixtures_common as fc

# one linear inside the model left unquantized by a regex, beside lm_head by name
IGNORE = ["lm_head", r"re:.*layers\.1\.mlp\.down_proj$"]
SCHEMES = {"ct-nvfp4": "NVFP4", "ct-nvfp4a16": "NVFP4A16"}


def tokenizer():
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(fc.TINY["vocab_size"])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t1", pad_token="t0")


def producer_act(config):
    """compressed-tensors' own activation fake-quant, as its quantized forward calls it, for fc.reference_model."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(**config["config_groups"]["group_0"]["input_activations"])

    def act(x, layer_act):
        g = layer_act["input_global_scale"]
        scale, zp = compute_dynamic_scales_and_zp(value=x, args=args, module=None, global_scale=g)
        return fake_quantize(x=x, scale=scale, zero_point=zp, args=args, global_scale=g)

    return act


def producer_forward(model):
    """float32 logits of the reference prompt by llm-compressor's quantized model in memory (a copy, after
    oneshot, before saving: weights and activations fake-quantized by compressed-tensors' forward), or None
    (with the reason printed)."""
    try:
        m = copy.deepcopy(model).float()
        with torch.no_grad():
            return m(input_ids=fc.prompt_tokens()).logits
    except Exception as e:  # a cross-check only
        print(f"   no producer forward cross-check: {type(e).__name__}: {e}", flush=True)
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--only", nargs="*", help="fixture names (default: all)")
    args = ap.parse_args()

    import json

    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    vers = fc.versions("llmcompressor", "compressed-tensors")
    calib = fc.calib_tokens()
    ds = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})

    for name, scheme in SCHEMES.items():
        if args.only and name not in args.only:
            continue
        print(f"== {name}", flush=True)
        with tempfile.TemporaryDirectory() as dense:
            tok = tokenizer()
            model = fc.dense_model(dense)
            tok.save_pretrained(dense)
            recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=IGNORE)
            oneshot(model=model, processor=tok, dataset=ds, recipe=recipe,
                    num_calibration_samples=calib.shape[0], max_seq_length=calib.shape[1])
            forward = producer_forward(model)
            path = os.path.join(args.out, name)
            shutil.rmtree(path, ignore_errors=True)
            model.save_pretrained(path, save_compressed=True)
        with open(os.path.join(path, "config.json")) as f:
            qconfig = json.load(f)["quantization_config"]
        w4a4 = qconfig["config_groups"]["group_0"].get("input_activations") is not None
        info = dict(
            name=name,
            producer=dict(name="llmcompressor", version=vers["llmcompressor"], packages=vers),
            scheme=scheme,
            config=dict(recipe=f"QuantizationModifier(targets='Linear', scheme={scheme!r}, ignore={IGNORE!r})",
                        oneshot=f"oneshot(model, processor, dataset, recipe, num_calibration_samples="
                                f"{calib.shape[0]}, max_seq_length={calib.shape[1]})",
                        save="model.save_pretrained(path, save_compressed=True)",
                        quantization_config=qconfig),
            notes=["weight_global_scale and input_global_scale are [1] float32 tensors, reciprocal to ModelOpt's "
                   "scales (dequantized value = code * scale / weight_global_scale)",
                   "model.layers.1.mlp.down_proj is ignored by the regex and stays bfloat16 (key .weight)"],
        )
        act = None
        if w4a4:
            act = producer_act(qconfig)
            info["w4a4_description"] = (
                "float32 [2, 8, vocab]: as logits_w4a16_fp32, and each quantized linear's input x fake-quantized by "
                "compressed-tensors' own CPU functions (compute_dynamic_scales_and_zp + fake_quantize, the "
                "config's input_activations args, the checkpoint's input_global_scale G): per 16 consecutive "
                "values s = float(e4m3(amax16 / 6 * G)), x_q = e2m1_round(clamp(x / (s / G), -6, 6)) * (s / G), "
                "nearest with ties to even")
        # W4A4: the independent restatement (fixtures_common.act_qdq_ct) against the producer's functions
        fc.write_references(path, "compressed-tensors", w4a4, info, act_override=act,
                            crosscheck_acts={"act_qdq_ct": None} if w4a4 else None,
                            producer_logits={"llmcompressor_forward": forward})
        print(f"   wrote {path}: {sorted(os.listdir(path))}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
