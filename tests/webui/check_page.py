#!/usr/bin/env python3
"""Drives `refusion serve`'s web page in headless Chromium (Selenium), and checks its HTTP
side (CORS, CSP, the key) with plain requests.

    check_page.py BASE_URL MODE [ARG]
MODE: "page" (loads clean, answers, draws, fills a gap, keeps conversations, renders HTML as
text; ARG: where to save a screenshot), "key" (the API-key prompt; ARG: the key), "stop"
(the stop button cancels a long answer), "http" (headers, CORS, preflight; ARG: an origin
the server was started to allow). Prints OK (and a JSON line of figures) and exits 0, or
raises."""
import json
import os
import sys
import time
import urllib.error
import urllib.request

base = ""  # set by main


def request(path, method="GET", body=None, headers=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def check_http(allowed_origin):
    status, h, body = request("/")
    assert status == 200 and b"<canvas" in body, status
    csp = h.get("Content-Security-Policy", "")
    assert "default-src 'none'" in csp and "script-src 'self'" in csp, csp
    assert "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp, csp
    assert h.get("X-Content-Type-Options") == "nosniff", h
    for path, kind in [("/webui/app.js", "javascript"), ("/webui/app.css", "css"), ("/webui/icon.svg", "svg")]:
        status, h, _ = request(path)
        assert status == 200 and kind in h["Content-Type"], (path, status, h)
    # A loopback origin may call the API; the answer names it.
    status, h, _ = request("/v1/models", headers={"Origin": "http://localhost:3000"})
    assert status == 200 and h.get("Access-Control-Allow-Origin") == "http://localhost:3000", h
    # Another origin is refused before anything runs.
    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}
    status, h, body = request("/v1/chat/completions", "POST", chat, {"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert status == 403 and b"--cors-origin" in body, (status, body)
    assert "Access-Control-Allow-Origin" not in h, h
    # The origin named with --cors-origin, and its preflight (answered before any key check).
    status, h, _ = request("/v1/chat/completions", "OPTIONS", headers={
        "Origin": allowed_origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204, status
    assert h.get("Access-Control-Allow-Origin") == allowed_origin, h
    assert "POST" in h.get("Access-Control-Allow-Methods", ""), h
    assert "authorization" in h.get("Access-Control-Allow-Headers", ""), h
    status, h, _ = request("/v1/chat/completions", "OPTIONS", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert status == 403, status
    # DNS rebinding: a loopback server answers to loopback names and addresses only.
    status, _, body = request("/v1/models", headers={"Host": "evil.example:8080"})
    assert status == 403 and b"host" in body, (status, body)
    status, _, _ = request("/v1/models", headers={"Host": "localhost:8080"})
    assert status == 200, status
    # The decode's steps, streamed beside the chunks; the figures in the last chunk.
    status, _, body = request("/v1/chat/completions", "POST", dict(chat, stream=True, decode_events=True), {"Content-Type": "application/json"})
    text = body.decode()
    assert status == 200 and "event: refusion.step" in text, text[:500]
    steps = [json.loads(b.split("data: ", 1)[1]) for b in text.split("\n\n") if b.startswith("event: refusion.step")]
    assert steps[0]["step"] == 0 and len(steps) >= 3 and all(s["length"] > 0 for s in steps), steps[:2]
    assert steps[0]["slot_size"] > 0 and steps[0]["slot_runs"][0][0] == 0, steps[0]
    assert any(c[1] == "committed" for s in steps for c in s["cells"]), steps
    # The last is the answer's end (not a forward): what was drafted past the EOS is masked.
    assert steps[-1].get("final") and not any(s.get("final") for s in steps[:-1]), steps[-1]
    assert all(c[1] == "masked" for c in steps[-1]["cells"]), steps[-1]
    chunks = [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]
    timings = chunks[-1]["timings"]
    assert timings["forward_calls"] == len(steps) - 2 and timings["tpf"] > 0, (timings, len(steps))
    status, _, body = request("/v1/chat/completions", "POST", dict(chat, decode_events=True), {"Content-Type": "application/json"})
    assert status == 400 and b"stream" in body, (status, body)


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    o = Options()
    o.binary_location = os.environ.get("REFUSION_CHROMIUM", "/usr/bin/chromium")
    for a in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,900", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-default-apps",
              "--disable-features=OptimizationHints,MediaRouter,Translate"]:
        o.add_argument(a)
    o.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    service = Service(os.environ.get("REFUSION_CHROMEDRIVER", "/usr/bin/chromedriver"))
    return webdriver.Chrome(service=service, options=o)


def wait(d, what, timeout=60):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(d, timeout, poll_frequency=0.05).until(lambda _: d.execute_script("return " + what))


def ask(d, text, template=None):
    """Types a question (and a template) and sends it; returns once the answer is done."""
    from selenium.webdriver.common.by import By

    before = d.execute_script("return document.querySelectorAll('.msg.assistant').length")
    if template is not None:
        if not d.execute_script("return document.getElementById('template-box').open"):
            d.find_element(By.CSS_SELECTOR, "#template-box summary").click()
        box = d.find_element(By.ID, "template")
        box.clear()
        box.send_keys(template)
    else:
        d.execute_script("document.getElementById('template').value = ''")
    d.find_element(By.ID, "prompt").send_keys(text)
    d.find_element(By.ID, "send").click()
    wait(d, f"document.querySelectorAll('.msg.assistant').length > {before} && !document.getElementById('send').disabled")
    return d.execute_script("const m = document.querySelectorAll('.msg.assistant'); return m[m.length - 1].innerText")


def console_errors(d):
    return [e for e in d.get_log("browser") if e["level"] == "SEVERE"]


def requested_urls(d):
    urls = []
    for entry in d.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def canvas_pixels(d, rgb):
    return d.execute_script("""
        const c = document.getElementById('canvas');
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0;
        for (let i = 0; i < px.length; i += 4)
            if (px[i] === arguments[0] && px[i + 1] === arguments[1] && px[i + 2] === arguments[2]) n++;
        return n;""", *rgb)


def check_page(screenshot):
    from selenium.webdriver.common.by import By

    d = browser()
    try:
        t0 = time.time()
        d.get(base + "/")
        wait(d, "document.getElementById('model').textContent.length > 0")
        load_s = time.time() - t0
        # A question gets the worked sum, streamed, with the answer's figures.
        text = ask(d, "What is 47 + 38?")
        assert "85" in text and "Ones: 7 + 8 = 15" in text, text
        assert "TPF" in text and "tokens/s" in text and "forward calls" in text, text
        stats = d.execute_script("return JSON.parse(localStorage.getItem('refusion.conversations'))[0].messages[1].stats")
        # The canvas: the steps drawn, committed slots in their colour; the slider replays.
        steps = int(wait(d, "document.getElementById('canvas').dataset.steps"))
        committed = int(d.find_element(By.ID, "canvas").get_attribute("data-committed"))
        assert steps >= 3 and committed >= 64, (steps, committed)
        assert canvas_pixels(d, (0x60, 0xA5, 0xFA)) > 1000
        slider = d.find_element(By.ID, "replay")
        assert slider.is_enabled()
        d.execute_script("const s = arguments[0]; s.value = 1; s.dispatchEvent(new Event('input'))", slider)
        early = int(d.find_element(By.ID, "canvas").get_attribute("data-committed"))
        assert early < committed and d.find_element(By.ID, "step-label").text.startswith("step 1 of"), early
        d.execute_script("const s = arguments[0]; s.value = s.max; s.dispatchEvent(new Event('input'))", slider)
        # A gap fills: the template typed, the gap inserted with the button (a new chat: the
        # tiny model answers single questions).
        d.find_element(By.ID, "new-chat").click()
        d.find_element(By.CSS_SELECTOR, "#template-box summary").click()
        box = d.find_element(By.ID, "template")
        box.send_keys("We add 23 and 16 column by column.\n")
        d.find_element(By.ID, "insert-gap").click()
        box.send_keys("Tens: 2 + 1 = 3, write 3.")
        d.find_element(By.ID, "prompt").send_keys("What is 23 + 16?")
        d.find_element(By.ID, "send").click()
        wait(d, "!document.getElementById('send').disabled && document.querySelectorAll('.msg.assistant').length == 1")
        gap = d.execute_script("const g = document.querySelectorAll('.gap'); return g[g.length - 1].textContent")
        assert "9" in gap and "Ones" in gap, gap
        if screenshot:
            # The gap half-way: the template's text given, the gap's slots being infilled.
            d.execute_script("const s = arguments[0]; s.value = Math.floor(s.max / 2); s.dispatchEvent(new Event('input'))", slider)
            d.save_screenshot(screenshot)
        # HTML in a prompt, a template (so in the answer) and a conversation's name stays text.
        d.find_element(By.ID, "new-chat").click()
        payload = '<img src=x onerror="window.pwned=1"><b>bold</b>'
        text = ask(d, payload + " What is 2 + 2?", template=payload + " {{gap:8}}")
        assert "<img src=x" in text, text
        assert d.execute_script("return window.pwned") is None
        html_nodes = d.execute_script("return document.querySelectorAll('#messages img, #messages b, #conversations img').length")
        assert html_nodes == 0, html_nodes
        title = d.execute_script("return document.querySelector('#conversations .open').textContent")
        assert title.startswith("<img src=x"), title
        # Conversations are kept: after a reload, the first one opens with its answer.
        d.refresh()
        wait(d, "document.querySelectorAll('#conversations li').length === 3")
        d.find_elements(By.CSS_SELECTOR, "#conversations .open")[2].click()
        assert "85" in d.find_element(By.ID, "messages").text
        # Two tabs: what one saves, the other shows and keeps when it saves in turn.
        first_tab = d.current_window_handle
        d.switch_to.new_window("tab")
        d.get(base + "/")
        wait(d, "document.querySelectorAll('#conversations li').length === 3")
        ask(d, "What is 12 + 34?")
        d.switch_to.window(first_tab)
        wait(d, "document.querySelectorAll('#conversations li').length === 4")
        d.find_element(By.ID, "new-chat").click()
        ask(d, "What is 47 + 38?")
        kept = d.execute_script("return JSON.parse(localStorage.getItem('refusion.conversations')).length")
        assert kept == 5, kept
        # Nothing went wrong, and nothing was asked of another host.
        errors = console_errors(d)
        assert not errors, errors
        urls = requested_urls(d)
        foreign = [u for u in urls if not (u.startswith(base + "/") or u.startswith("data:"))]
        assert urls and not foreign, foreign
        print(json.dumps({"page_load_s": round(load_s, 3), "first_token_ms": stats["firstTokenMs"],
                          "tokens_per_s": stats["tokensPerSecond"], "steps": steps}))
    finally:
        d.quit()


def check_key(key):
    from selenium.webdriver.common.by import By

    d = browser()
    try:
        from selenium.webdriver.common.keys import Keys

        d.get(base + "/")
        wait(d, "document.getElementById('key-dialog').open")
        # Escape gives up: the page says why instead of hanging; a reload asks again.
        d.find_element(By.ID, "key-input").send_keys(Keys.ESCAPE)
        wait(d, "document.getElementById('status').textContent.includes('needs an API key')")
        d.refresh()
        wait(d, "document.getElementById('key-dialog').open")
        field = d.find_element(By.ID, "key-input")
        field.send_keys("wrong")
        d.find_element(By.ID, "key-submit").click()
        wait(d, "document.getElementById('key-error').textContent.includes('refused')")
        field.send_keys(key)
        d.find_element(By.ID, "key-submit").click()
        wait(d, "document.getElementById('model').textContent.length > 0")
        assert "85" in ask(d, "What is 47 + 38?")
        assert d.execute_script("return sessionStorage.getItem('refusion.apiKey')") == key
        stored = d.execute_script("return JSON.stringify(localStorage)")
        assert key not in stored, stored
        assert not [u for u in requested_urls(d) if key in u or "wrong" in u]
    finally:
        d.quit()


def check_stop():
    from selenium.webdriver.common.by import By

    d = browser()
    try:
        d.get(base + "/")
        wait(d, "document.getElementById('model').textContent.length > 0")
        d.find_element(By.ID, "prompt").send_keys("Say something long.")
        d.find_element(By.ID, "send").click()
        wait(d, "!document.getElementById('stop').hidden")
        # Let it decode a while (the canvas shows steps), then stop it.
        wait(d, "Number(document.getElementById('canvas').dataset.steps || 0) >= 2")
        d.find_element(By.ID, "stop").click()
        wait(d, "!document.getElementById('send').disabled", timeout=10)
        text = d.execute_script("return document.querySelector('.msg.assistant').innerText")
        assert "stopped" in text, text
    finally:
        d.quit()


def main():
    global base
    base, mode = sys.argv[1], sys.argv[2]
    arg = sys.argv[3] if len(sys.argv) > 3 else None
    if mode == "http":
        check_http(arg)
    elif mode == "page":
        check_page(arg)
    elif mode == "key":
        check_key(arg)
    elif mode == "stop":
        check_stop()
    else:
        raise SystemExit(f"unknown mode {mode}")
    print("OK")


if __name__ == "__main__":
    main()
