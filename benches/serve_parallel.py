#!/usr/bin/env python3
"""Aggregate throughput of `refusion serve` with many clients at once, at several --parallel.

    python3 benches/serve_parallel.py --bin target/release/refusion -m FILE.gguf
        [--parallel 1,8] [--clients 8] [--requests 4] [--max-tokens 32] [-t 2] [--rounds R]
        [--rss] [--max-id N] [-- EXTRA SERVE FLAGS]

For each --parallel value: starts the server, lets CLIENTS threads send REQUESTS completions
each (distinct prompts of 24 token ids, max_tokens as given, temperature 0), and reports the
aggregate completion tokens/s (the answers' tokens over the wall time), p50/p95 latency per
request, and from /metrics the forwards the scheduler ran and their mean size in tokens.
With --rounds R, the --parallel list runs R times over, interleaved (1, 8, 1, 8, ...), and the
summary gives each setting's median and the median of the ratios of neighbouring runs: on a
shared machine whose speed drifts by tens of percent, a ratio of two runs minutes apart is
mostly noise. The table also reports, from /metrics, the logit rows per forward and the
milliseconds per forward and per feed (the decoders reading the logits).
With --rss, the server's RSS is sampled every second and its value after the first minute
and at the end are printed (a flat RSS under load). Standard library only.
"""
import argparse
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None


def start(args, parallel):
    cmd = [args.bin, "serve", "-m", args.model, "--port", "0", "-t", str(args.threads),
           "--parallel", str(parallel), "--queue", str(max(64, args.clients * 2)), *args.extra]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    while True:
        line = p.stderr.readline()
        if not line:
            raise SystemExit("server exited before listening")
        if "listening on" in line:
            port = int(line.split("listening on http://")[1].split()[0].rsplit(":", 1)[1])
            threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
            return p, port


def post(port, path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data)


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return {k: float(v) for k, v in (l.split(" ", 1) for l in text.splitlines() if l and not l.startswith("#"))}


def run(args, parallel):
    p, port = start(args, parallel)
    lat, tokens, failures = [], [], []
    lock = threading.Lock()
    samples = []
    stop = False

    def sampler():
        t0 = time.time()
        while not stop:
            r = rss_kib(p.pid)
            if r:
                samples.append((time.time() - t0, r))
            time.sleep(1)

    def client(i):
        for j in range(args.requests):
            ids = [(i * 7919 + j * 104729 + k * 31) % args.max_id + 1 for k in range(24)]
            body = {"prompt": ids, "max_tokens": args.max_tokens, "temperature": 0,
                    "slot_size": 4, "serial_blocks": max(1, args.max_tokens // 16)}
            t = time.time()
            try:
                s, b = post(port, "/v1/completions", body)
                ok = s == 200
            except OSError as e:
                ok, b = False, repr(e)
            with lock:
                if ok:
                    lat.append(time.time() - t)
                    tokens.append(b["usage"]["completion_tokens"])
                else:
                    failures.append(b)

    if args.rss:
        threading.Thread(target=sampler, daemon=True).start()
    t0 = time.time()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    stop = True
    m = metrics(port)
    p.terminate()
    p.wait(timeout=60)
    lat.sort()
    q = lambda f: lat[min(len(lat) - 1, int(f * len(lat)))] if lat else 0.0
    fwd = m.get("refusion_forwards_total", 0)
    row = {
        "parallel": parallel,
        "requests": len(lat),
        "failures": len(failures),
        "tokens": sum(tokens),
        "wall_s": wall,
        "tokens_per_s": sum(tokens) / wall,
        "p50_s": q(0.5),
        "p95_s": q(0.95),
        "forwards": int(fwd),
        "mean_forward_tokens": m.get("refusion_forward_tokens_total", 0) / max(fwd, 1),
        "mean_forward_logit_rows": m.get("refusion_forward_logit_rows_total", 0) / max(fwd, 1),
        "mean_forward_ms": 1e3 * m.get("refusion_forward_seconds_total", 0) / max(fwd, 1),
        "mean_feed_ms": 1e3 * m.get("refusion_feed_seconds_total", 0) / max(fwd, 1),
    }
    if args.rss and samples:
        after_minute = [r for t, r in samples if t >= 60]
        row["rss_mib_at_60s"] = (after_minute[0] if after_minute else samples[-1][1]) / 1024
        row["rss_mib_end"] = samples[-1][1] / 1024
        row["rss_mib_peak"] = max(r for _, r in samples) / 1024
    if failures:
        row["first_failure"] = str(failures[0])[:200]
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--parallel", default="1,8")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--rss", action="store_true")
    ap.add_argument("--max-id", type=int, default=5000, help="prompt token ids are below this (the vocabulary)")
    ap.add_argument("extra", nargs="*")
    args = ap.parse_args()
    settings = [int(n) for n in args.parallel.split(",")]
    rows = [run(args, n) for _ in range(args.rounds) for n in settings]
    print(json.dumps(rows, indent=1), file=sys.stderr)
    print("| --parallel | requests | failures | tokens/s | p50 s | p95 s | forwards | tokens / forward "
          "| logit rows / forward | ms / forward | feed ms / forward |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['parallel']} | {r['requests']} | {r['failures']} | {r['tokens_per_s']:.1f} | {r['p50_s']:.2f} "
              f"| {r['p95_s']:.2f} | {r['forwards']} | {r['mean_forward_tokens']:.1f} "
              f"| {r['mean_forward_logit_rows']:.1f} | {r['mean_forward_ms']:.1f} | {r['mean_feed_ms']:.1f} |")
    if len(settings) > 1:
        first, last = settings[0], settings[-1]
        speed = {n: [r["tokens_per_s"] for r in rows if r["parallel"] == n] for n in settings}
        ratios = [rows[i + len(settings) - 1]["tokens_per_s"] / max(rows[i]["tokens_per_s"], 1e-9)
                  for i in range(0, len(rows), len(settings))]
        print()
        for n in settings:
            print(f"--parallel {n}: median {statistics.median(speed[n]):.1f} tokens/s over {len(speed[n])} runs")
        print(f"ratio --parallel {last} / {first}: median {statistics.median(ratios):.2f}x "
              f"(each round: {', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
