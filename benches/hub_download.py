"""Download speed from a Hub on loopback: `refusion -hf` against Python's huggingface_hub, the
same file from the same server into fresh Hugging Face caches.

The server answers as the Hub does for an LFS file (`/api/models/...` listing, `resolve` with
X-Repo-Commit / X-Linked-Etag / X-Linked-Size / Content-Range, Range requests) and sends the
body with sendfile, so the client is what is measured.

refusion's time is that of `refusion bench -hf REPO:QUANT -p 1 -n 0 -r 1` with an empty cache
minus the same command with the file cached (load and one forward); Python's likewise, a
cold `hf_hub_download` minus a cached one (interpreter start and import); medians of --runs.

usage: python3 benches/hub_download.py --refusion target/release/refusion --file MODEL.gguf
       [--runs 3]   (needs huggingface_hub: pip install huggingface_hub==0.36.2)
"""

import argparse
import hashlib
import http.server
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = "bench-org/bench-GGUF"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def make_handler(path, name, etag):
    size = os.path.getsize(path)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def send_file(self, with_body):
            rng = self.headers.get("Range")
            start, end = 0, size
            if rng and rng.startswith("bytes="):
                a, _, b = rng[6:].partition("-")
                start = int(a)
                end = int(b) + 1 if b else size
            self.send_response(206 if rng else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", '"%s"' % etag[:40])
            self.send_header("X-Linked-Etag", '"%s"' % etag)
            self.send_header("X-Linked-Size", str(size))
            self.send_header("Accept-Ranges", "bytes")
            if rng:
                self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end - 1, size))
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if with_body:
                with open(path, "rb") as f:
                    os.sendfile(self.connection.fileno(), f.fileno(), start, end - start)

        def do_HEAD(self):
            self.send_file(False)

        def do_GET(self):
            if self.path.startswith("/api/models/"):
                body = json.dumps({"id": REPO, "sha": COMMIT,
                                   "siblings": [{"rfilename": name}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_file(True)

    return Handler


def timed(cmd, env):
    t = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--refusion", required=True)
    ap.add_argument("--file", required=True, help="a GGUF whose name holds its quant, e.g. x-Q4_K_M.gguf")
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    name = os.path.basename(a.file)
    quant = name.rsplit("-", 1)[-1].removesuffix(".gguf")
    etag = hashlib.sha256(name.encode() + str(os.path.getsize(a.file)).encode()).hexdigest()
    class Server(http.server.ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            pass  # a client closing a kept-alive connection at its exit

    server = Server(("127.0.0.1", 0), make_handler(a.file, name, etag))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = "http://127.0.0.1:%d" % server.server_address[1]
    size = os.path.getsize(a.file)
    ours, theirs = [], []
    for _ in range(a.runs):
        with tempfile.TemporaryDirectory() as home:
            env = dict(os.environ, HF_HOME=home, HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1")
            cmd = [a.refusion, "bench", "-hf", "%s:%s" % (REPO, quant), "-p", "1", "-n", "0", "-r", "1", "-t", "2"]
            cold = timed(cmd, env)
            warm = timed(cmd, env)
            ours.append(cold - warm)
        with tempfile.TemporaryDirectory() as home:
            env = dict(os.environ, HF_HOME=home, HF_ENDPOINT=url, HF_HUB_DISABLE_XET="1",
                       HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
            code = "from huggingface_hub import hf_hub_download as d; d(%r, %r)" % (REPO, name)
            cold = timed([sys.executable, "-c", code], env)
            warm = timed([sys.executable, "-c", code], env)
            theirs.append(cold - warm)
    server.shutdown()
    mb = size / 1e6
    o, p = statistics.median(ours), statistics.median(theirs)
    print("file: %s (%.1f MB), %d runs, medians" % (name, mb, a.runs))
    print("| client | seconds | MB/s |")
    print("| --- | ---: | ---: |")
    print("| refusion -hf (hf-hub) | %.2f | %.0f |" % (o, mb / o))
    print("| Python huggingface_hub %s | %.2f | %.0f |" % (__import__("huggingface_hub").__version__, p, mb / p))


if __name__ == "__main__":
    main()
