"""Build the NVFP4 checkpoint fixtures under tests/fixtures/checkpoints/ with the real producers.

What: tiny random Llamas (hidden 128, 2 layers, vocab 256, bfloat16) quantized and exported by NVIDIA ModelOpt
(modelopt-nvfp4, modelopt-w4a16, modelopt-nvfp4-awq, modelopt-nvfp4-fp8kv, modelopt-nvfp4-sharded) and by
llm-compressor in the compressed-tensors format (ct-nvfp4, ct-nvfp4a16), each folder the producer's own export
plus ``reference.safetensors`` (a prompt batch, logits and greedy tokens of the checkpoint's dequantized
model, and for W4A4 checkpoints logits with fake-quantized activations) and ``fixture.json`` (producer,
exact versions, scheme, config, what each reference tensor is, self-checks). About 3 MB in all; committed, so
that tests and loaders check against what the producers really write, with no producer installed.

Why venvs: the producers pin torch and transformers versions other than ours, so each gets its own venv
(default /tmp/fixture-venvs/<producer>, never committed): ``python3 -m venv``, then ``pip install
torch==2.13.0 <producer pin>`` (torch's CPU build comes from local disk). Both run on the CPU. ModelOpt's
NVFP4 fake-quant forward needs CUDA, so: its max calibration and export run as they are; awq_lite (whose
search runs the quantized forward) runs with that one op swapped for a torch port of ModelOpt's own GPU
kernel (tools/fixtures_modelopt.py); and every reference is computed from the exported tensors
(tools/fixtures_common.py says exactly how), never from ModelOpt's in-memory fake-quant model.

How: the producer scripts are tools/fixtures_modelopt.py and tools/fixtures_llmcompressor.py (with
tools/fixtures_common.py, imported by both); this tool makes the venvs and runs them:

    python3 tools/make_fixtures.py                                  # both producers, all fixtures
    python3 tools/make_fixtures.py --producers llmcompressor --only ct-nvfp4
    python3 tools/make_fixtures.py --no-install                     # reuse the venvs as they are

then ``.venv/bin/python -m pytest -q tests/model/test_fixtures.py``. A rerun rewrites each fixture folder whole;
with the same producer versions the checkpoints come out byte-identical. Takes ~5 minutes with empty venvs
(installs), ~1 minute without.
"""

import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH = "torch==2.13.0"
# producer -> its script, its distribution, and the pip requirements to try in order (the pin, then the nearest)
PRODUCERS = {
    "modelopt": dict(script="fixtures_modelopt.py", dist="nvidia-modelopt",
                     tries=["nvidia-modelopt[hf]==0.47.0", "nvidia-modelopt[hf]>=0.40,<0.48"]),
    "llmcompressor": dict(script="fixtures_llmcompressor.py", dist="llmcompressor",
                          tries=["llmcompressor==0.14.0.1", "llmcompressor>=0.14,<0.15"]),
}
BUDGET_BYTES = 3 * 1024 * 1024


def run(cmd, **kw):
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, **kw)


def installed_version(python, dist):
    out = subprocess.run([python, "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def make_venv(path, producer, reinstall):
    """The producer's venv at ``path`` with torch and the producer; returns (python, the producer's version)."""
    spec = PRODUCERS[producer]
    python = os.path.join(path, "bin", "python")
    if reinstall and os.path.isdir(path):
        shutil.rmtree(path)
    if not os.path.exists(python):
        run([sys.executable, "-m", "venv", path], check=True)
    version = installed_version(python, spec["dist"])
    if version is None:
        errors = []
        for req in spec["tries"]:
            r = run([python, "-m", "pip", "install", "-q", TORCH, req], capture_output=True, text=True)
            if r.returncode == 0:
                break
            errors.append(f"pip install {TORCH} {req!r}: exit {r.returncode}\n{r.stderr[-3000:]}")
            print(errors[-1], file=sys.stderr)
        version = installed_version(python, spec["dist"])
        if version is None:
            raise RuntimeError(f"{producer}: no candidate installed:\n" + "\n".join(errors))
    print(f"{producer}: {spec['dist']} {version} in {path}", flush=True)
    return python, version


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "fixtures", "checkpoints"),
                    help="where the fixture folders go (default: %(default)s)")
    ap.add_argument("--producers", nargs="+", choices=sorted(PRODUCERS), default=sorted(PRODUCERS),
                    help="which producers to run (default: all)")
    ap.add_argument("--venvs", default="/tmp/fixture-venvs",
                    help="folder of the producers' venvs, one subfolder each (default: %(default)s)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="only these fixtures (e.g. ct-nvfp4 modelopt-w4a16)")
    ap.add_argument("--no-install", action="store_true", help="use the venvs as they are (fail if missing)")
    ap.add_argument("--reinstall", action="store_true", help="delete and rebuild the venvs first")
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONDONTWRITEBYTECODE="1")
    failed = {}
    for producer in args.producers:
        t0 = time.time()
        spec = PRODUCERS[producer]
        path = os.path.join(args.venvs, producer)
        try:
            if args.no_install:
                python = os.path.join(path, "bin", "python")
                if installed_version(python, spec["dist"]) is None:
                    raise RuntimeError(f"{producer}: no {spec['dist']} in {path} (run without --no-install)")
            else:
                python, _ = make_venv(path, producer, args.reinstall)
            cmd = [python, os.path.join(ROOT, "tools", spec["script"]), args.out]
            if args.only:
                cmd += ["--only", *args.only]
            r = run(cmd, env=env, cwd=ROOT)
            if r.returncode:
                raise RuntimeError(f"{spec['script']} exited {r.returncode} (its traceback is above)")
        except Exception as e:  # report, and go on with the other producer
            failed[producer] = str(e)
            print(f"FAILED {producer}: {e}", file=sys.stderr, flush=True)
        print(f"{producer}: {time.time() - t0:.0f} s", flush=True)

    total = 0
    for name in sorted(os.listdir(args.out)):
        p = os.path.join(args.out, name)
        if os.path.isdir(p):
            n = folder_bytes(p)
            total += n
            print(f"  {name:28s} {n / 1024:7.1f} KiB")
    print(f"  {'total':28s} {total / 1024:7.1f} KiB")
    if total > BUDGET_BYTES:
        print(f"warning: the fixtures are over {BUDGET_BYTES >> 20} MiB", file=sys.stderr)
    for producer, err in failed.items():
        print(f"FAILED {producer}: {err}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
