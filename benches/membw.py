#!/usr/bin/env python3
"""What this machine's memory delivers, STREAM-style, to set the one-token figures against.

    python3 benches/membw.py [-t 2] [--mib 1024] [-r 5]
        [-m 0.6b-q4_k_m.gguf --tps 40.5 ...]

One token's forward reads every weight once, so its speed is bounded by how fast the cores
can stream memory. This measures, with `-t` threads each on its own slice of a buffer far
larger than the caches (numpy releases the GIL in both loops):
  - copy: STREAM's Copy, `b[:] = a` (bytes read + bytes written per second, STREAM's count);
  - read: a maximum over the buffer as u64 (bytes read per second), the access a
    matrix-vector product makes; numpy's fastest reduction here, but still partly bound by
    compute on some CPUs, so a lower bound of what reads can reach (the copy is the anchor).
Best of -r runs, in GB/s (10^9). With `-m FILE --tps T` pairs (a file and the one-token
tokens/s measured on it, e.g. by `refusion bench -p 1`) it also prints the effective weight
bandwidth, file bytes x T, as a fraction of the read figure. Not run in CI.
"""
import argparse
import os
import threading
import time

import numpy as np


def timed(threads, work):
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1024, help="buffer size per array")
    ap.add_argument("-r", "--reps", type=int, default=5)
    ap.add_argument("-m", "--model", action="append", default=[])
    ap.add_argument("--tps", type=float, action="append", default=[])
    a = ap.parse_args()
    n = a.mib * (1 << 20) // 8
    src = np.ones(n, dtype=np.uint64)
    dst = np.zeros(n, dtype=np.uint64)
    step = n // a.threads
    parts = [slice(i * step, n if i == a.threads - 1 else (i + 1) * step) for i in range(a.threads)]

    def copy(i):
        np.copyto(dst[parts[i]], src[parts[i]])

    maxima = [0] * a.threads

    def read(i):
        maxima[i] = int(src[parts[i]].max())

    nbytes = n * 8
    copy_gbs = max(2 * nbytes / timed(a.threads, copy) for _ in range(a.reps)) / 1e9
    read_gbs = max(nbytes / timed(a.threads, read) for _ in range(a.reps)) / 1e9
    assert maxima == [1] * a.threads
    print(f"threads {a.threads}, {a.mib} MiB per array")
    print(f"copy: {copy_gbs:.1f} GB/s (read + write)")
    print(f"read: {read_gbs:.1f} GB/s")
    for model, tps in zip(a.model, a.tps):
        size = os.path.getsize(model)
        eff = size * tps / 1e9
        print(f"{os.path.basename(model)}: {size / 2**20:.0f} MiB x {tps} t/s = {eff:.1f} GB/s, "
              f"{eff / read_gbs:.0%} of read, {eff / copy_gbs:.0%} of copy")


if __name__ == "__main__":
    main()
