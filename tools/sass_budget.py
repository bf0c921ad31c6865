"""Instruction budget per FP4 value of a compiled kernel's main loop, from its SASS (docs/b200-model.md).

    python tools/sass_budget.py KERNEL.sass VALUES_PER_LANE_PER_ITERATION

Finds the innermost loops (a backward branch to a label), takes the one with the most IDP (dp4a), counts
its instructions by opcode and by pipe, and divides by the FP4 values a lane handles per iteration.
Disassemble with nvdisasm (pip install nvidia-cuda-nvdisasm): ``nvdisasm -c kernel.cubin > KERNEL.sass``.
"""

import re
import sys
from collections import Counter

# lane results per clock per SM (sm_90 / sm_100 CUDA core counts; the conversion and shuffle units are
# the narrow ones)
PIPES = {"fp32": 128, "int (IMAD, IDP)": 64, "alu (LOP3, SHF, PRMT, IADD3, ...)": 64, "fp64": 64,
         "conversion (F2F, I2F, F2I)": 16, "shuffle": 32, "memory (LD*, ST*, bulk)": 32, "other": 64}


def pipe(op):
    if op in ("FFMA", "FMUL", "FADD", "FSETP", "FMNMX", "FSEL"):
        return "fp32"
    if op.startswith("IMAD") or op.startswith("IDP"):
        return "int (IMAD, IDP)"
    if op in ("DADD", "DFMA", "DMUL", "DSETP"):
        return "fp64"
    if op in ("F2F", "I2F", "F2I", "I2FP", "F2FP", "F2IP"):
        return "conversion (F2F, I2F, F2I)"
    if op == "SHFL":
        return "shuffle"
    if op.startswith(("LD", "ST", "UBLKCP", "SYNCS", "RED", "ATOM")):
        return "memory (LD*, ST*, bulk)"
    if op in ("LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "MOV", "LEA", "IABS", "VIADD", "IMNMX", "PLOP3",
              "P2R", "R2P", "LEA.HI", "SGXT", "BMSK", "POPC", "FLO", "BREV", "VIMNMX"):
        return "alu (LOP3, SHF, PRMT, IADD3, ...)"
    return "other"


def loops(lines):
    labels = {}
    instr = []
    for line in lines:
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instr)
            continue
        m = re.match(r"^\s+/\*([0-9a-f]{4})\*/\s+(.*?);", line)
        if m:
            instr.append(m.group(2))
    found = []
    for i, text in enumerate(instr):
        m = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", text)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            found.append(instr[labels[m.group(1)]:i + 1])
    return found


def opcode(text):
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    return t.split()[0].split(".")[0]


def main():
    path, values = sys.argv[1], int(sys.argv[2])
    with open(path) as f:
        body = max(loops(f.readlines()), key=lambda b: sum(opcode(t) == "IDP" for t in b))
    ops = Counter(opcode(t) for t in body)
    by_pipe = Counter()
    for op, n in ops.items():
        by_pipe[pipe(op)] += n
    print(f"loop body: {len(body)} instructions for {values} values a lane: {len(body) / values:.3f} a value")
    print("top opcodes: " + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)))
    for p, n in sorted(by_pipe.items(), key=lambda kv: -kv[1]):
        print(f"  {p:36s} {n:4d}  {n / values:.3f} a value  -> {PIPES[p] * values / n:7.1f} values/clk/SM")
    print(f"  {'issue (4 warp instructions a clock)':36s} {len(body):4d}  -> {128 * values / len(body):7.1f} values/clk/SM")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):  # the docstring, and nothing run
        sys.exit(print(__doc__) or 0)
    main()
