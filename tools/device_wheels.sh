#!/usr/bin/env bash
# Packs what the GPU machine lacks into .whlz/ (git-excluded) for one carry: nvidia-cutlass-dsl 4.3.5 (the
# leaderboard's; its 56 MB wheel holds one 140 MB library, repacked here with xz to about 40 MB so that a
# call can also carry another tree) and apache-tvm-ffi (the fast launch path). The machine has torch,
# transformers and pytest but no registry. Usage, here (needs network for pip; about 2 minutes):
#     tools/device_wheels.sh
# then in a device call: carry [".whlz"] and begin the command with `sh .whlz/install.sh || exit 1;`
# (it rebuilds the wheel from the unpacked files, installs both, and does nothing where the DSL is there).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[[ ${1:-} == -h || ${1:-} == --help ]] && { sed -n '2,8p' "$0" | cut -c3-; exit 0; }
DSL=nvidia_cutlass_dsl-4.3.5-cp312-cp312-manylinux_2_28_x86_64.whl
grep -qx "/.whlz/" .git/info/exclude 2>/dev/null || echo "/.whlz/" >> .git/info/exclude
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp" "$@" 2> >(grep -v "is ignored" >&2); }
dl "nvidia-cutlass-dsl==4.3.5" "apache-tvm-ffi>=0.1.11,<0.2"
rm -rf .whlz && mkdir -p .whlz "$tmp/dsl"
(cd "$tmp/dsl" && python3 -m zipfile -e "$tmp/$DSL" .)
tar -C "$tmp" -cf - dsl | xz -T0 -9 > .whlz/dsl.tar.xz
cp "$tmp"/apache_tvm_ffi-*.whl .whlz/
cat > .whlz/install.sh <<SH
# DSL 4.3.5 (unpacked, xz-packed to fit a carry) and apache-tvm-ffi: rebuilds the wheel, installs both
set -e
here="\$(cd "\$(dirname "\$0")" && pwd)"
python3 -c "import cutlass.cute" 2>/dev/null && { echo "DSL already installed"; exit 0; }
rm -rf /tmp/dslw && mkdir -p /tmp/dslw && cd /tmp/dslw && xz -dc "\$here/dsl.tar.xz" | tar -xf -
python3 -c "
import os, zipfile
with zipfile.ZipFile('/tmp/dslw/$DSL', 'w', zipfile.ZIP_STORED) as z:
    for root, _, files in os.walk('/tmp/dslw/dsl'):
        for f in files:
            z.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), '/tmp/dslw/dsl'))
"
python3 -m pip install -q --no-index --no-deps --no-compile /tmp/dslw/$DSL "\$here"/apache_tvm_ffi*.whl
python3 -c "import importlib.metadata as m, cutlass.cute; print('nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'), 'tvm-ffi', m.version('apache-tvm-ffi'))"
SH
du -sh .whlz
