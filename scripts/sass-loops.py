#!/usr/bin/env python3
"""Instruction counts of kernels' innermost loops, without a GPU.

Compiles a kernel source with NVRTC for sm_90 (the options kiln's registry uses), disassembles
the cubin with nvdisasm and, for each kernel named, prints the size and instruction mix of its
smallest loop that holds a dp4a (or the opcode --holding names), so that a change to a decode
path can be weighed by the instructions it removes before it is timed on the device.

    python3 scripts/sass-loops.py matvec_kquant NTOK=1,ROWS_PER_WARP=4 matvec_q4_k matvec_iq4_xs
    python3 scripts/sass-loops.py --print matvec_legacy NTOK=1,ROWS_PER_WARP=8 matvec_q1_0
    python3 scripts/sass-loops.py --holding HMMA paged_attention HEAD_DIM=128,GROUP=4,K_TYPE=1,V_TYPE=1 paged_attention_split_mma

Needs libnvrtc (scripts/nvrtc-env.sh finds it) and nvdisasm (`pip install nvidia-cuda-nvdisasm`,
or a CUDA toolkit's bin/ on PATH). Register counts and spills come from ptxas's report.
"""
import argparse
import collections
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "crates", "kiln-cuda", "kernels")


def find_library(pattern):
    dirs = os.environ.get("LD_LIBRARY_PATH", "").split(":") + glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "lib"))
    for d in filter(None, dirs):
        hits = sorted(glob.glob(os.path.join(d, pattern)))
        if hits:
            return hits[0]
    sys.exit(f"sass-loops: {pattern} not found on LD_LIBRARY_PATH or in the nvidia pip wheels (eval \"$(scripts/nvrtc-env.sh)\")")


def find_nvdisasm():
    found = shutil.which("nvdisasm") or next(iter(glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu*", "bin", "nvdisasm"))), None)
    if not found:
        sys.exit("sass-loops: nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    return found


def compile_cubin(source, defines):
    lib_path = find_library("libnvrtc.so*")
    # libnvrtc dlopen()s its builtins by name: loaded first, they are found whatever the path.
    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(lib_path), "libnvrtc-builtins.so*"))):
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
    nvrtc = ctypes.CDLL(lib_path)
    path = os.path.join(KERNELS, source + ".cu")
    if not os.path.isfile(path):
        stems = sorted(f[:-3] for f in os.listdir(KERNELS) if f.endswith(".cu"))
        sys.exit(f"sass-loops: no kernel source {source!r}; the sources are: {' '.join(stems)}")
    code = open(path, "rb").read()
    program = ctypes.c_void_p()
    if nvrtc.nvrtcCreateProgram(ctypes.byref(program), code, (source + ".cu").encode(), 0, None, None):
        sys.exit("sass-loops: nvrtcCreateProgram failed")
    options = ["--gpu-architecture=sm_90", "-default-device", "--std=c++17", "--ptxas-options=-v", "--include-path=" + KERNELS]
    options += ["-D" + d for d in defines]
    raw = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    status = nvrtc.nvrtcCompileProgram(program, len(options), raw)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    log = log.value.decode(errors="replace")
    if status:
        sys.exit(f"sass-loops: {source} does not compile:\n{log}")
    nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetCUBIN(program, cubin)
    return cubin.raw, log


def registers(log, kernel):
    """ptxas's register count and spill line for `kernel`."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if f"'{kernel}'" in line and "Compiling" in line:
            for follow in lines[i + 1:i + 6]:
                used = re.search(r"Used (\d+) registers", follow)
                if used:
                    return int(used.group(1))
    return None


def instructions(sass, kernel):
    """(address, opcode) of every instruction of `kernel`, and its branch labels' addresses."""
    body = re.search(r"\.text\.%s:\n(.*?)(?=\n\s*//-----|\Z)" % re.escape(kernel), sass, re.S)
    if not body:
        return None, None
    code, labels, pending = [], {}, []
    for line in body.group(1).splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", line)
        if ins:
            address = int(ins.group(1), 16)
            code.append((address, ins.group(3), ins.group(4).strip()))
            labels.update((name, address) for name in pending)
            pending = []
    return code, labels


def smallest_loop(code, labels, holding):
    best = None
    for address, op, args in code:
        target = re.search(r"(\.L_x_\d+)", args) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), address + 1) <= address:
            body = [c for c in code if labels[target.group(1)] <= c[0] <= address]
            if holding and not any(c[1].startswith(holding) for c in body):
                continue
            if best is None or len(body) < len(best):
                best = body
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holding", default="IDP", metavar="OPCODE", help="the smallest loop holding this opcode (default IDP, dp4a; HMMA for tensor cores; '' for any loop)")
    parser.add_argument("--print", action="store_true", help="print the loop's instructions")
    parser.add_argument("source", help="kernel file stem, e.g. matvec_kquant")
    parser.add_argument("defines", help="comma-separated NAME=VALUE, e.g. NTOK=1,ROWS_PER_WARP=4")
    parser.add_argument("kernels", nargs="+")
    args = parser.parse_args()
    cubin, log = compile_cubin(args.source, [d for d in args.defines.split(",") if d])
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([find_nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    for kernel in args.kernels:
        code, labels = instructions(sass, kernel)
        if code is None:
            print(f"{kernel}: not in {args.source} with {args.defines}")
            continue
        loop = smallest_loop(code, labels, args.holding)
        regs = registers(log, kernel)
        if loop is None:
            print(f"{kernel}: {len(code)} instructions, no loop found; {regs} registers")
            continue
        mix = collections.Counter(op.split(".")[0] for _, op, _ in loop)
        print(f"{kernel}: loop of {len(loop)} instructions, {mix.get('IDP', 0)} dp4a, {regs} registers | " + " ".join(f"{k} {v}" for k, v in mix.most_common(12)))
        if args.print:
            for address, op, operands in loop:
                print(f"    {address:05x}  {op} {operands}")


if __name__ == "__main__":
    main()
