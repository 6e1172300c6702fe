#!/usr/bin/env python3
"""The web page's weight and its time to first token against a plain HTTP client.

    python3 benches/webui_ttft.py BASE_URL [--rounds 10] [--question "What is 47 + 38?"]

BASE_URL is a running `refusion serve` (e.g. on the trained tiny model). Both sides ask the
same question as a streamed chat completion, one at a time, alternating. The plain client's
time runs from sending the request to the first chunk with text (curl -N would see the same
bytes); the page's from the Send click's handler to the first text shown (performance.now(),
the `first token` figure under each answer, which includes the page's fetch and its parsing
of the stream). Needs Selenium and Debian's chromium/chromium-driver, as tests/webui.rs.
Prints a JSON object."""
import argparse
import http.client
import json
import statistics
import time
import urllib.parse
import urllib.request

from selenium.webdriver.common.by import By


def page_weight(base):
    total = {}
    for path in ["/", "/webui/app.js", "/webui/app.css", "/webui/icon.svg"]:
        with urllib.request.urlopen(base + path) as r:
            total[path] = len(r.read())
    return total


def client_ttft(base, question):
    u = urllib.parse.urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    body = json.dumps({"messages": [{"role": "user", "content": question}], "stream": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    first = None
    buf = b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            block, buf = buf.split(b"\n\n", 1)
            if first is None and block.startswith(b"data: {"):
                delta = json.loads(block[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = (time.perf_counter() - t0) * 1e3
    conn.close()
    return first


def page_ttft(d, question):
    d.find_element(By.ID, "new-chat").click()
    d.find_element(By.ID, "prompt").send_keys(question)
    d.find_element(By.ID, "send").click()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(d, 60, poll_frequency=0.02).until(
        lambda _: d.execute_script("return !document.getElementById('send').disabled"))
    return d.execute_script(
        "return JSON.parse(localStorage.getItem('refusion.conversations'))[0].messages[1].stats.firstTokenMs")


# A bare fetch from the page's origin, timed to the first text (no page code involved).
RAW_FETCH = """
const done = arguments[arguments.length - 1];
const t0 = performance.now();
fetch('/v1/chat/completions', {method: 'POST', headers: {'Content-Type': 'application/json'},
  body: JSON.stringify({messages: [{role: 'user', content: arguments[0]}], stream: true,
                        decode_events: arguments[1]})})
.then(async (res) => {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = '';
  for (;;) {
    const {value, done: end} = await reader.read();
    if (end) break;
    buf += decoder.decode(value, {stream: true});
    if (/"delta":\\{"content":"[^"]/.test(buf)) { reader.cancel(); return done(performance.now() - t0); }
  }
  done(null);
});
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--question", default="What is 47 + 38?")
    a = ap.parse_args()
    import sys
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "webui"))
    from check_page import browser, wait  # noqa: E402

    d = browser()
    try:
        t0 = time.perf_counter()
        d.get(a.base + "/")
        wait(d, "document.getElementById('model').textContent.length > 0")
        load_ms = (time.perf_counter() - t0) * 1e3
        client, page, fetch, fetch_events = [], [], [], []
        for _ in range(a.rounds):
            client.append(client_ttft(a.base, a.question))
            page.append(page_ttft(d, a.question))
            fetch.append(d.execute_async_script(RAW_FETCH, a.question, False))
            fetch_events.append(d.execute_async_script(RAW_FETCH, a.question, True))
    finally:
        d.quit()
    weight = page_weight(a.base)
    print(json.dumps({
        "page_bytes": weight, "page_bytes_total": sum(weight.values()),
        "page_load_ms": round(load_ms, 1),
        "ttft_ms_client_median": round(statistics.median(client), 1),
        "ttft_ms_page_median": round(statistics.median(page), 1),
        "ttft_ms_browser_fetch_median": round(statistics.median(fetch), 1),
        "ttft_ms_browser_fetch_with_steps_median": round(statistics.median(fetch_events), 1),
        "ttft_ms_client": [round(x, 1) for x in client],
        "ttft_ms_page": [round(x, 1) for x in page],
    }, indent=1))


if __name__ == "__main__":
    main()
