#!/usr/bin/env python3
"""Load, fault and hostile-input test of `refusion serve` over loopback; prints one report.

    python3 benches/serve_load.py --bin target/release/refusion -m FILE.gguf [--clients 16]
        [--requests 400] [--disconnects 400] [--idle 1000] [-- EXTRA SERVE FLAGS]

Starts the server, then, in phases:
  load         CLIENTS threads x REQUESTS chat completions (every 4th streamed), latencies timed;
  disconnects  streamed requests abandoned after their first event (each cancels a generation);
  idle         IDLE connections opened and left silent while a client keeps using the API;
  hostile      malformed JSON, oversized bodies, half-sent headers, short bodies, wrong methods;
then SIGTERM, and checks the process exits 0. RSS of the server is sampled every 50 ms.
Standard library only; bounded in count and time; loopback only. Not run in CI (tests/serve*.rs
check each behaviour; this gives the figures).
"""
import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

KNOBS = {"slot_size": 4, "serial_blocks": 2}


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.peak, self.last, self.stop = pid, 0, 0, False

    def run(self):
        while not self.stop:
            r = rss_kib(self.pid)
            if r is None:
                return
            self.peak, self.last = max(self.peak, r), r
            time.sleep(0.05)


def start(args):
    cmd = [args.bin, "serve", "-m", args.model, "--port", "0", "-t", str(args.threads), *args.extra]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    log = []
    while True:
        line = p.stderr.readline()
        if not line:
            sys.exit("the server did not start:\n" + "".join(log))
        log.append(line)
        if "listening on http://" in line:
            host, port = line.split("http://")[1].split()[0].rsplit(":", 1)
            break
    threading.Thread(target=lambda: log.extend(p.stderr), daemon=True).start()
    return p, host, int(port), log


def chat(host, port, stream, max_tokens=8, content="hello"):
    c = http.client.HTTPConnection(host, port, timeout=120)
    body = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "stream": stream, **KNOBS})
    c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def phase_load(host, port, clients, requests):
    lat, errors, lock = [], [], threading.Lock()

    def worker(i):
        for j in range(requests):
            t = time.perf_counter()
            try:
                status, data = chat(host, port, stream=(j % 4 == 3), content=f"client {i} request {j}")
                ok = status == 200 and (b"[DONE]" in data or b"choices" in data)
            except Exception as e:  # noqa: BLE001
                ok, data = False, repr(e).encode()
            with lock:
                (lat if ok else errors).append(time.perf_counter() - t if ok else data[:200])

    t = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return lat, errors, time.perf_counter() - t


def phase_disconnects(host, port, n):
    done = 0
    for _ in range(n):
        s = socket.create_connection((host, port), timeout=60)
        body = json.dumps({"messages": [{"role": "user", "content": "long"}], "max_tokens": 256, "stream": True,
                           **KNOBS}).encode()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        seen = b""
        while b"data: " not in seen:
            chunk = s.recv(4096)
            if not chunk:
                break
            seen += chunk
        s.close()
        done += b"data: " in seen
    return done


def phase_idle(host, port, n):
    held, refused = [], 0
    for _ in range(n):
        try:
            held.append(socket.create_connection((host, port), timeout=5))
        except OSError:
            refused += 1
    time.sleep(0.5)
    t = time.perf_counter()
    status, _ = chat(host, port, stream=False)
    served = time.perf_counter() - t
    c = http.client.HTTPConnection(host, port, timeout=30)
    c.request("GET", "/health")
    health = c.getresponse().status
    for s in held:
        s.close()
    return status, health, served, refused


def phase_hostile(host, port):
    results = {}

    def raw(payload, wait=True):
        s = socket.create_connection((host, port), timeout=60)
        s.sendall(payload)
        if not wait:
            return s
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
        s.close()
        return data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else "closed"

    hdr = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
    results["malformed JSON"] = raw(hdr % 9 + b"{not json")
    big = b"x" * (2 << 20)
    results["2 MiB body"] = raw(hdr % len(big) + big)
    results["GET on POST route"] = raw(b"GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    t = time.perf_counter()
    results["half-sent headers"] = raw(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n") + \
        f" after {time.perf_counter() - t:.1f} s"
    t = time.perf_counter()
    results["short body"] = raw(hdr % 100 + b"{") + f" after {time.perf_counter() - t:.1f} s"
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/refusion")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--disconnects", type=int, default=400)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("extra", nargs="*", help="more `refusion serve` flags (after --)")
    args = ap.parse_args()

    p, host, port, log = start(args)
    rss_start = rss_kib(p.pid)
    sampler = Sampler(p.pid)
    sampler.start()

    lat, errors, wall = phase_load(host, port, args.clients, args.requests)
    n = len(lat) + len(errors)
    print(f"load: {n} requests from {args.clients} clients in {wall:.1f} s = {n / wall:.1f} req/s; "
          f"latency p50 {pct(lat, .5) * 1e3:.0f} ms, p95 {pct(lat, .95) * 1e3:.0f} ms, "
          f"p99 {pct(lat, .99) * 1e3:.0f} ms, mean {statistics.fmean(lat) * 1e3:.0f} ms; {len(errors)} failed")
    for e in errors[:3]:
        print("  failure:", e)
    d = phase_disconnects(host, port, args.disconnects)
    cancelled = sum("cancelled" in line for line in log)
    print(f"disconnects: {d}/{args.disconnects} streams abandoned after their first event; "
          f"{cancelled} cancellations logged")
    status, health, served, refused = phase_idle(host, port, args.idle)
    print(f"idle: {args.idle} silent connections open ({refused} refused by the OS); a chat request "
          f"answered {status} in {served * 1e3:.0f} ms, /health {health}")
    for k, v in phase_hostile(host, port).items():
        print(f"hostile: {k}: {v}")
    rss_end = rss_kib(p.pid)
    sampler.stop = True
    print(f"RSS: start {rss_start / 1024:.0f} MiB, peak {sampler.peak / 1024:.0f} MiB, "
          f"end {rss_end / 1024:.0f} MiB")
    t = time.perf_counter()
    p.terminate()
    code = p.wait(timeout=60)
    print(f"SIGTERM: exit code {code} after {time.perf_counter() - t:.2f} s")
    sys.exit(0 if not errors and code == 0 else 1)


if __name__ == "__main__":
    main()
