#!/usr/bin/env python3
"""`fp8moe eplb` against an independent pure-Python port of DeepSeek's EPLB (rebalance_experts:
hierarchical when the groups divide by the nodes, global otherwise), on lognormal loads of 256
experts, 288 slots, 4 nodes x 8 GPUs: fp8moe's max / mean tokens per GPU must be no worse than the
reference's, layer by layer and overall. Also the README example's map and the exit code of bad
input. Pure Python (no torch, no numpy), so it runs everywhere the command is built."""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile


def pack(weights, packs):
    """Each pack gets len(weights) / packs items: heaviest first to the lightest open pack."""
    n = len(weights)
    per = n // packs
    if per == 1:
        return list(range(n)), [0] * n
    where, pos = [0] * n, [0] * n
    load, count = [0.0] * packs, [0] * packs
    for item in sorted(range(n), key=lambda i: -weights[i]):  # sorted() is stable
        open_packs = [p for p in range(packs) if count[p] < per]
        p = min(open_packs, key=lambda q: load[q])
        where[item], pos[item] = p, count[p]
        count[p] += 1
        load[p] += weights[item]
    return where, pos


def replicate(weights, total):
    n = len(weights)
    owner, copies = list(range(n)), [1] * n
    for _ in range(n, total):
        e = max(range(n), key=lambda i: weights[i] / copies[i])
        owner.append(e)
        copies[e] += 1
    return owner, copies


def hierarchical(w, slots, groups, nodes, gpus):
    """Physical-to-logical map of one layer."""
    E = len(w)
    gsize, gpn = E // groups, groups // nodes
    per_node, spn, gpus_pn, spg = E // nodes, slots // nodes, gpus // nodes, slots // gpus
    gw = [sum(w[g * gsize:(g + 1) * gsize]) for g in range(groups)]
    gnode, grank = pack(gw, nodes)
    mlog2log = [0] * E
    for e in range(E):
        g = e // gsize
        mlog2log[(gnode[g] * gpn + grank[g]) * gsize + e % gsize] = e
    out = [-1] * slots
    for node in range(nodes):
        nw = [w[mlog2log[node * per_node + j]] for j in range(per_node)]
        owner, copies = replicate(nw, spn)
        cw = [nw[owner[p]] / copies[owner[p]] for p in range(spn)]
        gpu, rank = pack(cw, gpus_pn)
        for p in range(spn):
            out[node * spn + gpu[p] * spg + rank[p]] = mlog2log[node * per_node + owner[p]]
    return out


def rebalance(loads, slots, groups, nodes, gpus):
    if groups % nodes == 0:
        return [hierarchical(w, slots, groups, nodes, gpus) for w in loads]
    return [hierarchical(w, slots, 1, 1, gpus) for w in loads]


def balance(loads, maps, gpus):
    mx, mn = [], []
    for w, m in zip(loads, maps):
        copies = [m.count(e) for e in range(len(w))]
        per = [0.0] * gpus
        for s, e in enumerate(m):
            per[s * gpus // len(m)] += w[e] / copies[e]
        mx.append(max(per))
        mn.append(sum(per) / gpus)
    return [a / b for a, b in zip(mx, mn)], sum(mx) / sum(mn)


def run_eplb(exe, loads, slots, nodes, gpus, groups, extra=()):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(loads, f)
        path = f.name
    try:
        r = subprocess.run([exe, "eplb", "--loads", path, "--slots", str(slots), "--nodes", str(nodes), "--gpus",
                            str(gpus), "--groups", str(groups), "--json", *extra], capture_output=True, text=True)
    finally:
        os.unlink(path)
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fp8moe", required=True)
    ap.add_argument("--layers", type=int, default=8)
    args = ap.parse_args()
    if not os.path.exists(args.fp8moe):
        print("SKIPPED: no", args.fp8moe)
        return 0
    failures = 0

    readme = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
              [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    want = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1], [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    assert rebalance(readme, 16, 4, 2, 8) == want, "the Python port does not reproduce the README example"
    r = run_eplb(args.fp8moe, readme, 16, 2, 8, 4)
    got = json.loads(r.stdout)["phy_to_log"] if r.returncode == 0 else r.stderr
    print("README example:", "same map" if got == want else "DIFFERENT: %s" % got)
    failures += got != want

    rng = random.Random(20)
    for sigma in (0.5, 1.0, 1.5):
        loads = [[rng.lognormvariate(0.0, sigma) * 1000 for _ in range(256)] for _ in range(args.layers)]
        for groups in (8, 1):  # 8 groups on 4 nodes: hierarchical; 1 group: global
            r = run_eplb(args.fp8moe, loads, 288, 4, 32, groups)
            if r.returncode != 0:
                print("fp8moe eplb failed:", r.stderr)
                failures += 1
                continue
            ours = json.loads(r.stdout)
            ref_layers, ref_all = balance(loads, rebalance(loads, 288, groups, 4, 32), 32)
            our_layers = [x["ratio"] for x in ours["after"]["per_layer"]]
            ok = ours["after"]["overall"] <= ref_all * (1 + 1e-9) and all(
                a <= b * (1 + 1e-9) for a, b in zip(our_layers, ref_layers))
            print("lognormal sigma %.1f, %d groups (%s): before %.4f, fp8moe %.4f, reference %.4f  %s" % (
                sigma, groups, ours["policy"], ours["before"]["overall"], ours["after"]["overall"], ref_all,
                "ok" if ok else "WORSE"))
            failures += not ok

    for bad, words in (([[1, 2, 3], [1, 2]], "experts"),):
        r = run_eplb(args.fp8moe, bad, 4, 1, 2, 1)
        ok = r.returncode == 2 and words in r.stderr
        print("bad loads: exit %d, %s" % (r.returncode, r.stderr.strip()))
        failures += not ok
    for slots, nodes, gpus, groups in ((10, 2, 2, 4), (16, 2, 6, 4), (18, 3, 6, 4)):
        r = run_eplb(args.fp8moe, readme, slots, nodes, gpus, groups)
        if (slots, nodes) == (18, 3):  # auto: global, fine
            ok = r.returncode == 0
        else:
            ok = r.returncode == 2
        print("slots %d nodes %d gpus %d groups %d: exit %d %s" % (slots, nodes, gpus, groups, r.returncode,
                                                                  r.stderr.strip()))
        failures += not ok
    r = run_eplb(args.fp8moe, readme, 18, 3, 6, 4, ("--policy", "hierarchical"))
    print("hierarchical, 4 groups on 3 nodes: exit %d %s" % (r.returncode, r.stderr.strip()))
    failures += r.returncode != 2 or "divisible by the 3 nodes" not in r.stderr
    print("FAILED" if failures else "PASSED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
