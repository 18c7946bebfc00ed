#!/usr/bin/env python3
"""Checks the machine code of the sm_90a FP8 GEMM kernels in a built library, without a GPU.

Every instantiation of sm90_fp8_gemm_kernel (dense and grouped, every tile) must
  - use no stack or local memory (a register spill in the mainloop costs the Tensor Cores),
  - read and write shared memory with LDS/STS: no generic LD/ST (their 64-bit address arithmetic
    and the run-time address-space check once cost the Wgrad mainloop ~50 instructions per K block),
  - contain FP8 WGMMAs (QGMMA), issued in batches: four per commit group (one 128-wide K block),
    so one in four carries the group's scoreboard (gsb0). ptxas serialises them (a wait after
    every WGMMA, its message C7514 is only "info") when it cannot prove that no other instruction
    touches an accumulator in flight: then every QGMMA carries gsb0,
  - for every 1d2d mainloop (pipelined and plain) and the 128x128 Wgrad: not read SR_CgaCtaId
    inside the K loop (ptxas re-derived the ring's shared addresses from it before every
    full-barrier wait, a long-latency S2UR on the path from one K block's WGMMAs to the next: the
    pipelined loop computes them once, measured 2-5% on the H200; the plain 1d2d loop carries them
    from K block to block, measured 0.8-2.6%). The other 1d1d instantiations still do; they are
    counted (carried addresses measured 3-6% slower on the Wgrad, docs/PERF-log.md).
The SASS comes from cuobjdump (which runs nvdisasm): the CUDA toolkit's, or those of NVIDIA's
`nvidia-cuda-cuobjdump` and `nvidia-cuda-nvdisasm` wheels that scripts/setup.sh installs into
build/tools when the toolkit has none. Without them the check is skipped (exit code 77, which
CTest reports as skipped).

Usage: scripts/sass_check.py <libfp8moe_cuda.a or object files...> [--cuobjdump PATH] [--tools DIR]
       scripts/sass_check.py --self-test   (the K-loop rule on hand-written listings; no tools needed)
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

KERNEL = "sm90_fp8_gemm_kernel"
SKIP = 77


def find_tool(name, explicit, tools):
    """The CUDA tool `name`: explicit, on PATH, beside nvcc, in /usr/local/cuda, or from a wheel in tools."""
    if explicit:
        return explicit
    found = shutil.which(name)
    if found:
        return found
    nvcc = shutil.which("nvcc")
    beside_nvcc = [os.path.join(os.path.dirname(nvcc), name)] if nvcc else []
    wheel = sorted(glob.glob(os.path.join(tools, "nvidia", "*", "bin", name)))
    for cand in beside_nvcc + ["/usr/local/cuda/bin/" + name] + wheel:
        if os.access(cand, os.X_OK):
            return cand
    return None


def run(tool, args, nvdisasm):
    # cuobjdump -sass runs nvdisasm, which it looks for on PATH.
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    return subprocess.run([tool] + args, check=True, capture_output=True, text=True, env=env).stdout


def kernel_lines(text, header):
    """(function, line) for the lines of `text` under a header (regex `header`, the name in group 1)
    that names a GEMM kernel."""
    func = None
    for line in text.splitlines():
        m = re.search(header, line)
        if m:
            func = m.group(1) if KERNEL in m.group(1) else None
        elif func:
            yield func, line


def resource_usage(tool, nvdisasm, files):
    """{function: (reg, stack, local)} of the GEMM kernels."""
    usage = {}
    text = run(tool, ["--dump-resource-usage"] + files, nvdisasm)
    for func, line in kernel_lines(text, r"Function ([^\s:]+):"):
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if m:
            usage[func] = tuple(int(g) for g in m.groups())
    return usage


def loops_reading_cta_id(code):
    """The innermost loops with QGMMAs (the K loops; backward branches of [(address, instruction)])
    that read SR_CgaCtaId. Outer loops (the tile loop, with its epilogue) may read it once per tile."""
    loops = []
    for addr, text in code:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            top = int(m.group(1), 16)
            body = [t for a, t in code if top <= a <= addr]
            # NOTES: a barrier wait's retry block sits after the kernel's EXIT and branches back
            # into the loop; its address range is no loop.
            if any("QGMMA" in t for t in body) and not any(t.startswith("EXIT") or " EXIT" in t for t in body):
                loops.append((top, addr))
    inner = [l for l in loops if not any(o != l and l[0] <= o[0] and o[1] <= l[1] for o in loops)]
    return [l for l in inner if any("SR_CgaCtaId" in t for a, t in code if l[0] <= a <= l[1])]


def guarded_k_loop(func):
    """The instantiations whose K loop must not read SR_CgaCtaId: every 1d2d one (the pipelined
    mainloop is 1d2d only) and the 128x128 Wgrad (template <BLOCK_M, BLOCK_N, kB1x128,
    kTmaEpilogue, kMC, kPipe, kG, kF32Stg>)."""
    m = re.search(r"kernelILi(\d+)ELi(\d+)ELb([01])ELb[01]ELi(\d+)E", func)
    if not m:
        return False
    bm, bn, b1x128, mc = m.groups()
    return b1x128 == "0" or (bm == bn == "128" and mc == "1")


def sass_counts(tool, nvdisasm, files):
    """{function: (generic loads/stores, QGMMAs, QGMMAs carrying gsb0, WGMMA loops reading SR_CgaCtaId)}
    of the GEMM kernels."""
    code = {}
    for func, line in kernel_lines(run(tool, ["-sass"] + files, nvdisasm), r"Function\s*:\s*(\S+)"):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;", line)
        if m:
            code.setdefault(func, []).append((int(m.group(1), 16), m.group(2)))
    generic = re.compile(r"(^|\s)(LD|ST)(\.E|\.64|\.128|\.U8|\.U16|\.S8|\.S16)*\s")
    return {
        f: (sum(1 for _, t in c if generic.search(t)), sum(1 for _, t in c if "QGMMA" in t),
            sum(1 for _, t in c if "QGMMA" in t and "gsb0" in t), loops_reading_cta_id(c))
        for f, c in code.items()
    }


def self_test():
    """loops_reading_cta_id on listings shaped like ptxas output: a K loop inside a tile loop whose
    epilogue reads SR_CgaCtaId, and a barrier-retry block after EXIT that branches back."""
    def listing(k_loop_reads):
        return [(0x100, "S2UR UR5, SR_CgaCtaId"),                                   # setup
                (0x150, "IMAD R2, R3, R4, RZ"),                                     # tile loop top
                (0x200, "S2UR UR9, SR_CgaCtaId" if k_loop_reads else "UIADD3 UR9, UR9, 0x1, URZ"),
                (0x210, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR28+0x31000], R24"),
                (0x220, "@!P0 BRA 0x900"),
                (0x230, "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR16], RZ, !UPT"),
                (0x240, "@!P0 BRA 0x200"),                                          # K loop
                (0x250, "S2R R141, SR_CgaCtaId"),                                   # epilogue
                (0x260, "@P1 BRA 0x150"),                                           # tile loop
                (0x270, "EXIT"),
                (0x900, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR28+0x31000], R24"),
                (0x910, "@!P0 BRA 0x900"),
                (0x920, "BRA 0x230")]
    bad = loops_reading_cta_id(listing(True))
    good = loops_reading_cta_id(listing(False))
    ok = bad == [(0x200, 0x240)] and good == []
    show = lambda loops: [f"{a:#x}..{b:#x}" for a, b in loops]
    print(f"sass_check self-test: K loop reading SR_CgaCtaId -> {show(bad)}, clean K loop -> {show(good)}: "
          f"{'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--tools", default=os.path.join(os.path.dirname(__file__), "..", "build", "tools"))
    a = ap.parse_args()
    tool = find_tool("cuobjdump", a.cuobjdump, a.tools)
    nvdisasm = find_tool("nvdisasm", None, a.tools)
    if not tool or not nvdisasm:
        print("sass_check: no cuobjdump/nvdisasm (CUDA toolkit or NVIDIA's wheels, scripts/setup.sh): skipped")
        return SKIP
    usage = resource_usage(tool, nvdisasm, a.files)
    counts = sass_counts(tool, nvdisasm, a.files)
    if not usage or not counts:
        print(f"sass_check: no {KERNEL} instantiation found in {' '.join(a.files)}")
        return 1
    failures = []
    unguarded = 0
    for func in sorted(set(usage) | set(counts)):
        reg, stack, local = usage.get(func, (0, 0, 0))
        generic, qgmma, gsb, loops = counts.get(func, (0, 0, 0, []))
        problems = []
        if stack or local:
            problems.append(f"stack {stack} B, local {local} B (register spills)")
        if generic:
            problems.append(f"{generic} generic LD/ST (shared memory reached through a generic pointer)")
        if not qgmma:
            problems.append("no QGMMA (FP8 WGMMA)")
        elif 2 * gsb > qgmma:
            problems.append(f"{gsb} of {qgmma} QGMMAs wait for themselves (WGMMAs serialised, ptxas C7514)")
        if loops and guarded_k_loop(func):
            top, end = loops[0]
            problems.append(f"SR_CgaCtaId read in the K loop {top:#x}..{end:#x} (shared addresses re-derived per K block)")
        elif loops:
            unguarded += 1
        if problems:
            failures.append(f"{func}: " + "; ".join(problems))
    print(f"sass_check: {len(usage)} {KERNEL} instantiations, cuobjdump {tool}")
    for f in failures:
        print("  FAIL " + f)
    print(f"{len(usage) - len(failures)} passed, {len(failures)} failed; "
          f"{unguarded} other instantiations read SR_CgaCtaId in their K loop")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
