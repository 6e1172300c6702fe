#!/usr/bin/env python3
"""Issue 47's CPU goals on the machine you are on, in one command: the files made, every
measurement run with interleaved rounds, and one table of verdicts for benches/README.md.

    python3 benches/cpu_goals.py [--files bench-data] [--out bench-data/cpu-goals] [--rounds 7] [--e2e-rounds 3]
        [--e2e-8b-rounds 1] [--no-8b] [--resume] [--llama-dir ~/.cache/llama-bench]

A session that finds itself on a Zen 4 or Intel machine has a few hours; this spends them on
measuring, not on setting up. What it runs, in order (each stage's raw output kept in --out,
so `--resume` picks up after an interruption without redoing a finished stage):

1. The machine: vendor, family and model from /proc/cpuinfo, named (Zen 3, Zen 4, Intel with
   its AVX-512/AMX), caches from `lscpu`. The goals are the issue's for Zen 4 and Intel; on any
   other family the figures are measured and shown against them, labelled as not that family's.
2. The files, made once in --files if missing: the synthetic 0.6B Q4_K_M and Q8_0 and 8B Q4_K_M
   (`refusion convert --synthetic`), and the trained tiny model grown to the same shapes
   (`--grow-from models/refusion-tiny`). The 8B pair needs about 10 GB of disk.
3. One-token forwards against llama.cpp's best (`cpu_paths.py -p 1 --paths native`, both sides
   interleaved over --rounds rounds): goal pp1 >= 1.10x on each file.
4. The products at 16 and 128 rows (`kquants::tests::timing`, 7 interleaved rounds inside the
   test): goal Q4_K and Q6_K at 128 rows >= their 16-row rate, on every path the CPU runs.
5. End to end at the card's and GSM8K's settings against llama-bench tg128 (`grown_decode.py
   --no-greedy`, --e2e-rounds rounds for the 0.6B files, --e2e-8b-rounds for the 8B): goals
   card >= 2.5x on Zen 4 (Intel keeps its 3x), GSM8K >= 1.0x.

llama-bench comes from ../shared/tools/build-llama-bench.sh (native, or native without AMX on
AMX CPUs), which this script does not run: it says so and stops before any heavy work when the
binary is missing. Hours on 2 cores with the 8B; `--no-8b` leaves the 8B files out (about 40
minutes). Not run in CI.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
HERE = os.path.dirname(os.path.abspath(__file__))

SYNTHETIC = [("syn-0.6b-q4_k_m.gguf", "0.6b", "q4_k_m"), ("syn-0.6b-q8_0.gguf", "0.6b", "q8_0"),
             ("syn-8b-q4_k_m.gguf", "8b", "q4_k_m")]
GROWN = [("grown-0.6b-q4_k_m.gguf", "0.6b", "q4_k_m", 24),
         ("grown-0.6b-q8_0.gguf", "0.6b", "q8_0", 24),
         ("grown-8b-q4_k_m.gguf", "8b", "q4_k_m", 12)]


def amd_family(family, model):
    """AMD's core generation from /proc/cpuinfo's family and model (AMD's published ranges)."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen/Zen+"
    if family == 0x19:
        if model <= 0x0F or 0x20 <= model <= 0x5F:
            return "Zen 3"
        if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF:
            return "Zen 4"
    if family == 0x1A:
        return "Zen 5"
    return f"AMD family {family} model {model}"


def cpu_info(text):
    """The first processor's fields of a /proc/cpuinfo text, and the machine's name for it."""
    fields = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id", "?")
    family, model = int(fields.get("cpu family", "0")), int(fields.get("model", "0"))
    if vendor == "AuthenticAMD":
        name = amd_family(family, model)
    elif vendor == "GenuineIntel":
        name = "Intel"
    else:
        name = vendor
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    return {"vendor": vendor, "family": family, "model": model, "name": name,
            "model_name": fields.get("model name", "?"), "isa": isa}


def issue_family(name):
    """The issue's family this CPU is (its goals hold there), or None."""
    if name == "Zen 4":
        return "Zen 4"
    if name == "Intel":
        return "Intel"
    return None


def caches_line():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    keep = [line.split(":", 1) for line in out.splitlines()
            if re.match(r"(L1d|L2|L3) cache:", line)]
    return ", ".join(f"{k.split()[0]} {v.strip()}" for k, v in keep)


def run(cmd, log, env=None):
    """Run a stage's command, its output to the console and to `log`; stop on failure."""
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=ROOT, env={**os.environ, **(env or {})})
        for line in p.stdout:
            sys.stdout.write(line)
            f.write(line)
        if p.wait() != 0:
            sys.exit(f"cpu_goals: `{cmd[0]} ...` failed (exit {p.returncode}); its output: {log}")


def make_files(a, files, stages):
    """The files the chosen stages read: synthetic ones for pp1, grown ones end to end."""
    if "pp1" in stages:
        for name, shape, ty in SYNTHETIC:
            if not (shape == "8b" and a.no_8b):
                make(a, files, name, ["--synthetic", shape, "--outtype", ty])
    tiny = os.path.join(ROOT, "models/refusion-tiny")
    if "e2e" in stages:
        for name, shape, ty, _ in GROWN:
            if not (shape == "8b" and a.no_8b):
                make(a, files, name, ["--synthetic", shape, "--grow-from", tiny, "--outtype", ty])


def make(a, files, name, args):
    path = os.path.join(files, name)
    if os.path.exists(path):
        return
    run([a.refusion, "convert", "-q", *args, "-o", path], os.path.join(a.out, f"convert-{name}.log"))


def stage_pp1(a, files, llama):
    out = os.path.join(a.out, "pp1.json")
    if not (a.resume and os.path.exists(out)):
        models = [os.path.join(files, n) for n, s, _ in SYNTHETIC if not (s == "8b" and a.no_8b)]
        cmd = [sys.executable, os.path.join(HERE, "cpu_paths.py"), "--refusion", a.refusion,
               "--llama-native", llama, "-p", "1", "--rounds", str(a.rounds), "-r", "3",
               "--paths", "native", "--json", out]
        for m in models:
            cmd += ["-m", m]
        run(cmd, os.path.join(a.out, "pp1.log"))
    res = json.load(open(out))
    rows = []
    for model, f in res["files"].items():
        rs = f["paths"]["native"]["rounds"]
        ratios = [r["ours"]["1"] / r["theirs"]["1"] for r in rs]
        rows.append(verdict("pp1 >= 1.10x llama.cpp's best", os.path.basename(model), ratios,
                            1.10, f"{len(rs)} rounds"))
    return rows


TIMING = re.compile(r"^(q4_K|q6_K|q8_0) m (\d+) (\w+): (\d+) GMAC/s \(median of (\d+), (\d+)-(\d+)\)")


def parse_timing(text):
    """{(type, path): {rows: (median, lo, hi)}} from the timing test's output."""
    rates = {}
    for line in text.splitlines():
        m = TIMING.match(line.strip())
        if m:
            ty, rows, path = m.group(1), int(m.group(2)), m.group(3)
            rates.setdefault((ty, path), {})[rows] = tuple(int(m.group(i)) for i in (4, 6, 7))
    return rates


def stage_products(a):
    log = os.path.join(a.out, "products.log")
    if not (a.resume and os.path.exists(log) and parse_timing(open(log).read())):
        run(["cargo", "test", "--release", "-q", "-p", "refusion-engine", "--lib",
             "kquants::tests::timing", "--", "--ignored", "--nocapture"], log)
    rates = parse_timing(open(log).read())
    if not rates:
        sys.exit(f"cpu_goals: no GMAC/s lines in {log}")
    rows = []
    for (ty, path), by in sorted(rates.items()):
        if ty == "q8_0" or 16 not in by or 128 not in by:
            continue
        m16, m128 = by[16][0], by[128][0]
        rows.append({"goal": "128-row rate >= 16-row rate", "subject": f"{ty} {path}",
                     "measured": f"{m128} vs {m16} GMAC/s ({m128 / m16:.2f})",
                     "detail": "medians of 7 rounds", "met": m128 >= m16})
    return rows


def stage_e2e(a, files, llama):
    runs = []
    groups = [("e2e-0.6b", a.e2e_rounds, [g for g in GROWN if g[1] != "8b"])]
    if not a.no_8b:
        groups.append(("e2e-8b", a.e2e_8b_rounds, [g for g in GROWN if g[1] == "8b"]))
    for tag, rounds, grown in groups:
        out = os.path.join(a.out, f"{tag}.json")
        if not (a.resume and os.path.exists(out)):
            cmd = [sys.executable, os.path.join(HERE, "grown_decode.py"), "--refusion", a.refusion,
                   "--llama-build", os.path.dirname(llama), "--rounds", str(rounds),
                   "--no-greedy", "--out", out]
            for name, _, _, n in grown:
                cmd += ["--file", f"{n}:{os.path.join(files, name)}"]
            run(cmd, os.path.join(a.out, f"{tag}.log"))
        runs += json.load(open(out))["runs"]
    return runs


def e2e_verdicts(runs, family):
    card_goal = {"Zen 4": 2.5, "Intel": 3.0}.get(family, 2.5)
    rows = []
    for r in runs:
        for i, row in enumerate(r["rounds"][0]["refusion"]):
            ratios = [x["refusion"][i]["tokens_per_s"] / x["llama_bench"]["best"]
                      for x in r["rounds"]]
            setting = row["test"].split()[1] if row["test"].startswith("decode ") else row["test"]
            goal = card_goal if setting == "card" else 1.0
            rows.append(verdict(f"{setting} >= {goal:g}x llama-bench tg128", r["file"], ratios,
                                goal, f"{len(ratios)} round(s), TPF {row['tpf']:.2f}, "
                                      f"accuracy {100 * row['accuracy']:.0f}%"))
    return rows


def verdict(goal, subject, ratios, target, detail):
    med = statistics.median(ratios)
    return {"goal": goal, "subject": subject,
            "measured": f"{med:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
            "detail": detail, "met": med >= target}


def table(cpu, family, caches, rows, started):
    head = (f"{cpu['model_name']}: **{cpu['name']}** (vendor {cpu['vendor']}, family "
            f"{cpu['family']} model {cpu['model']}; {' '.join(cpu['isa'])}; {caches}), "
            f"{os.cpu_count()} CPUs, started {started}.")
    if family is None:
        head += (f"\nNot one of the issue's families (Zen 4, Intel): the verdicts below are "
                 f"against their goals, for comparison only.")
    lines = [head, "", "| goal | file or kernel | measured: median (range) | rounds, notes | met |",
             "| --- | --- | ---: | --- | :---: |"]
    for r in rows:
        lines.append(f"| {r['goal']} | {r['subject']} | {r['measured']} | {r['detail']} | "
                     f"{'yes' if r['met'] else '**no**'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--refusion", default=os.path.join(ROOT, "target/release/refusion"))
    ap.add_argument("--files", default=os.path.join(ROOT, "bench-data"),
                    help="where the GGUF files are made (once) and read")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-data", "cpu-goals"))
    ap.add_argument("--llama-dir", default=os.path.expanduser("~/.cache/llama-bench"))
    ap.add_argument("--rounds", type=int, default=7, help="rounds of the one-token forwards")
    ap.add_argument("--e2e-rounds", type=int, default=3, help="rounds end to end, 0.6B files")
    ap.add_argument("--e2e-8b-rounds", type=int, default=1, help="rounds end to end, the 8B")
    ap.add_argument("--no-8b", action="store_true", help="leave the 8B files out")
    ap.add_argument("--resume", action="store_true", help="reuse the stages already in --out")
    ap.add_argument("--stages", default="pp1,products,e2e")
    a = ap.parse_args()
    stages = set(a.stages.split(","))
    if stages - {"pp1", "products", "e2e"} or not stages:
        ap.error("--stages: a comma-separated subset of pp1,products,e2e")
    if min(a.rounds, a.e2e_rounds, a.e2e_8b_rounds) < 1:
        ap.error("every --*rounds must be at least 1")
    cpu = cpu_info(open("/proc/cpuinfo").read())
    family = issue_family(cpu["name"])
    build = "build-native-noamx" if "amx_int8" in cpu["isa"] else "build-native"
    llama = os.path.join(a.llama_dir, build, "bin", "llama-bench")
    if not os.access(a.refusion, os.X_OK):
        sys.exit(f"cpu_goals: no refusion binary at {a.refusion} (cargo build --release)")
    if stages & {"pp1", "e2e"} and not os.access(llama, os.X_OK):
        sys.exit(f"cpu_goals: no llama-bench at {llama} (bash ../shared/tools/build-llama-bench.sh"
                 f" builds it, ~10 minutes; or --llama-dir)")
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(a.files, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"cpu_goals: {cpu['model_name']}: {cpu['name']} ({' '.join(cpu['isa'])})", flush=True)
    make_files(a, a.files, stages)
    rows = []
    if "pp1" in stages:
        rows += stage_pp1(a, a.files, llama)
    if "products" in stages:
        rows += stage_products(a)
    if "e2e" in stages:
        rows += e2e_verdicts(stage_e2e(a, a.files, llama), family)
    md = table(cpu, family, caches_line(), rows, started)
    with open(os.path.join(a.out, "goals.md"), "w") as f:
        f.write(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
