// refusion's web page: a chat over /v1/chat/completions that draws the decode live from the
// server's `refusion.step` events. Plain JavaScript, no dependencies, nothing fetched from
// another host. Every user and model text is written with textContent (never parsed as HTML).
'use strict';

(() => {
  const $ = (id) => document.getElementById(id);
  const STORE = 'refusion.conversations';
  const SETTINGS = 'refusion.settings';
  const KEY = 'refusion.apiKey';
  const FIELDS = ['system', 'max_tokens', 'slot_size', 'serial_blocks', 'slot_threshold', 'token_threshold', 'strategy'];
  const COLORS = {
    masked: '#e2e8f0', given: '#94a3b8', planned: '#fde68a', drafted: '#fdba74',
    verified: '#86efac', committed: '#60a5fa', infilled: '#c084fc',
  };
  const GAP = /\{\{gap(?::\d+)?\}\}/g;

  const state = {
    conversations: validConversations(load(localStorage, STORE, [])),
    current: null,
    busy: null, // the AbortController of the answer being decoded
    defaults: {},
    trace: null, // {length, steps: [[[index, state, text], ...], ...]}
    deleted: new Set(), // ids deleted here (not brought back from another tab's copy)
  };

  function load(store, key, fallback) {
    try {
      const v = JSON.parse(store.getItem(key));
      return v === null || v === undefined ? fallback : v;
    } catch (_) {
      return fallback;
    }
  }

  // Conversations as kept by this page (anything else in the store is dropped, not trusted).
  function validConversations(v) {
    if (!Array.isArray(v)) return [];
    return v.filter((c) => c && typeof c.id === 'string' && typeof c.title === 'string' &&
      Array.isArray(c.messages) &&
      c.messages.every((m) => m && typeof m.role === 'string' && typeof (m.content || '') === 'string'));
  }

  // Keeps this tab's conversations, and those another tab saved meanwhile (by id; this tab's
  // version of one it also holds wins).
  function save() {
    const others = validConversations(load(localStorage, STORE, []));
    const mine = new Set(state.conversations.map((c) => c.id));
    for (const c of others) {
      if (!mine.has(c.id) && !state.deleted.has(c.id)) state.conversations.push(c);
    }
    try {
      localStorage.setItem(STORE, JSON.stringify(state.conversations));
    } catch (e) {
      status('could not keep the conversation: ' + e.message);
    }
  }

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }

  function status(text) {
    $('status').textContent = text || '';
  }

  // ---- the API, with the key when the server asks for one ----

  async function api(path, body, signal) {
    for (;;) {
      const headers = {};
      if (body) headers['Content-Type'] = 'application/json';
      const key = sessionStorage.getItem(KEY);
      if (key) headers.Authorization = 'Bearer ' + key;
      const res = await fetch(path, {
        method: body ? 'POST' : 'GET', headers, signal,
        body: body ? JSON.stringify(body) : undefined,
      });
      if (res.status !== 401) return res;
      await askKey(key ? 'That key was refused.' : '');
    }
  }

  // The key, asked once for every caller waiting; Escape gives up (the calls fail).
  let keyAsked = null;
  function askKey(error) {
    if (keyAsked) return keyAsked;
    const dialog = $('key-dialog');
    $('key-error').textContent = error;
    $('key-input').value = '';
    keyAsked = new Promise((resolve, reject) => {
      $('key-form').onsubmit = (e) => {
        e.preventDefault();
        const key = $('key-input').value.trim();
        if (!key) return;
        sessionStorage.setItem(KEY, key);
        keyAsked = null;
        dialog.close();
        resolve();
      };
      dialog.oncancel = () => {
        keyAsked = null;
        reject(new Error('this server needs an API key'));
      };
    });
    if (!dialog.open) dialog.showModal();
    return keyAsked;
  }

  // ---- markdown, built as elements ----

  const FENCE = /^\s*```(.*)$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const BULLET = /^\s*[-*+]\s+/;
  const NUMBERED = /^\s*\d+[.)]\s+/;

  function markdown(src, into) {
    into.replaceChildren();
    const lines = src.split('\n');
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      const fence = line.match(FENCE);
      if (fence) {
        const code = [];
        for (i++; i < lines.length && !/^\s*```\s*$/.test(lines[i]); i++) code.push(lines[i]);
        i++;
        const pre = el('pre');
        pre.append(el('code', null, code.join('\n')));
        into.append(pre);
      } else if (HEADING.test(line)) {
        const m = line.match(HEADING);
        const h = el('h' + Math.min(6, m[1].length + 2));
        inline(m[2], h);
        into.append(h);
        i++;
      } else if (BULLET.test(line) || NUMBERED.test(line)) {
        const marker = BULLET.test(line) ? BULLET : NUMBERED;
        const list = el(marker === BULLET ? 'ul' : 'ol');
        for (; i < lines.length && marker.test(lines[i]); i++) {
          const li = el('li');
          inline(lines[i].replace(marker, ''), li);
          list.append(li);
        }
        into.append(list);
      } else if (!line.trim()) {
        i++;
      } else {
        const p = el('p');
        for (let first = true; i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) &&
             !HEADING.test(lines[i]) && !BULLET.test(lines[i]) && !NUMBERED.test(lines[i]); i++) {
          if (!first) p.append(el('br'));
          inline(lines[i], p);
          first = false;
        }
        into.append(p);
      }
    }
  }

  function inline(text, into) {
    const re = /(`[^`]+`)|(\*\*[^*]+\*\*)|(\*[^*\s][^*]*\*)/g;
    let last = 0;
    for (let m = re.exec(text); m; m = re.exec(text)) {
      if (m.index > last) into.append(document.createTextNode(text.slice(last, m.index)));
      if (m[1]) into.append(el('code', null, m[0].slice(1, -1)));
      else if (m[2]) into.append(el('strong', null, m[0].slice(2, -2)));
      else into.append(el('em', null, m[0].slice(1, -1)));
      last = re.lastIndex;
    }
    if (last < text.length) into.append(document.createTextNode(text.slice(last)));
  }

  // ---- conversations ----

  function conversation() {
    return state.conversations.find((c) => c.id === state.current);
  }

  function newConversation() {
    if (state.busy) return;
    state.current = null;
    state.trace = null;
    $('decode').hidden = true;
    renderAll();
    $('prompt').focus();
  }

  function renderList() {
    const ul = $('conversations');
    ul.replaceChildren();
    for (const c of state.conversations) {
      const li = el('li', c.id === state.current ? 'current' : '');
      const open = el('button', 'open', c.title);
      open.type = 'button';
      open.title = c.title;
      open.onclick = () => {
        if (state.busy) return;
        state.current = c.id;
        renderAll();
      };
      const del = el('button', 'delete', '×');
      del.type = 'button';
      del.setAttribute('aria-label', 'Delete this conversation');
      del.onclick = () => {
        if (state.busy && c.id === state.current) return;
        state.conversations = state.conversations.filter((x) => x !== c);
        state.deleted.add(c.id);
        save();
        if (state.current === c.id) {
          state.current = null;
          renderAll();
        } else {
          renderList(); // the answer being written keeps its place
        }
      };
      li.append(open, del);
      ul.append(li);
    }
  }

  function renderMessage(m, node) {
    const box = node || el('div', 'msg ' + m.role);
    box.replaceChildren();
    box.append(el('div', 'role', m.role === 'user' ? 'You' : 'refusion'));
    const body = el('div', 'body');
    if (m.template) {
      templated(m, body);
    } else {
      markdown(m.content || (m.role === 'assistant' && !m.done ? '…' : ''), body);
    }
    box.append(body);
    if (m.error) box.append(el('div', 'error', m.error));
    if (m.stopped) box.append(el('div', 'stats', 'stopped'));
    if (m.stats) box.append(el('div', 'stats', statsLine(m.stats)));
    return box;
  }

  // A template's text with each gap's fill (or a placeholder) in place.
  function templated(m, body) {
    const p = el('p');
    const parts = m.template.split(GAP);
    parts.forEach((text, i) => {
      p.append(document.createTextNode(text));
      if (i < parts.length - 1) {
        const fill = (m.fills || [])[i] || '';
        p.append(el('span', fill ? 'gap' : 'gap empty', fill || '…'));
      }
    });
    body.append(p);
  }

  function statsLine(s) {
    const parts = [];
    if (s.tpf !== null && s.tpf !== undefined) parts.push('TPF ' + s.tpf.toFixed(2));
    parts.push(s.tokensPerSecond.toFixed(1) + ' tokens/s');
    parts.push(s.forwardCalls + ' forward calls');
    parts.push(s.tokens + ' tokens');
    if (s.firstTokenMs !== null) parts.push('first token ' + Math.round(s.firstTokenMs) + ' ms');
    return parts.join(' · ');
  }

  function renderAll() {
    renderList();
    const box = $('messages');
    box.replaceChildren();
    const c = conversation();
    if (c) for (const m of c.messages) box.append(renderMessage(m));
    box.scrollTop = box.scrollHeight;
  }

  // ---- settings ----

  function readSettings() {
    const saved = load(localStorage, SETTINGS, {});
    for (const f of FIELDS) {
      const input = $('set-' + f);
      if (saved[f] !== undefined) input.value = saved[f];
      input.onchange = () => {
        const all = {};
        for (const g of FIELDS) all[g] = $('set-' + g).value;
        localStorage.setItem(SETTINGS, JSON.stringify(all));
      };
    }
  }

  function requestFields() {
    const out = {};
    for (const f of ['max_tokens', 'slot_size', 'serial_blocks']) {
      const v = $('set-' + f).value.trim();
      if (v) out[f] = parseInt(v, 10);
    }
    for (const f of ['slot_threshold', 'token_threshold']) {
      const v = $('set-' + f).value.trim();
      if (v) out[f] = parseFloat(v);
    }
    if ($('set-strategy').value) out.strategy = $('set-strategy').value;
    return out;
  }

  async function loadServerInfo() {
    try {
      const models = await (await api('/v1/models')).json();
      $('model').textContent = (models.data && models.data[0] && models.data[0].id) || '';
      const props = await (await api('/props')).json();
      const p = (props.default_generation_settings || {}).params || {};
      state.defaults = p;
      const placeholders = {
        max_tokens: p.n_predict, slot_size: p.slot_size, serial_blocks: p.serial_blocks,
        slot_threshold: p.slot_threshold, token_threshold: p.token_threshold,
      };
      for (const [f, v] of Object.entries(placeholders)) {
        if (v !== undefined) $('set-' + f).placeholder = String(v);
      }
    } catch (e) {
      status('cannot reach the server: ' + e.message);
    }
  }

  // ---- the decode, drawn ----

  function legend() {
    const box = $('legend');
    for (const [name, color] of Object.entries(COLORS)) {
      const swatch = el('span', 'swatch');
      swatch.style.background = color; // one palette, the canvas's
      box.append(swatch, document.createTextNode(name));
    }
  }

  function startTrace() {
    state.trace = { length: 0, steps: [], slot: 0, runs: [] };
    const slider = $('replay');
    slider.disabled = true;
    slider.max = 0;
    slider.value = 0;
  }

  function addStep(step) {
    const t = state.trace;
    if (!t) return;
    t.length = step.length;
    if (step.step === 0) {
      t.slot = step.slot_size || 0;
      t.runs = step.slot_runs || [];
    }
    t.steps.push(step.cells);
    if (step.final) t.final = true;
    $('decode').hidden = false;
    const slider = $('replay');
    slider.max = t.steps.length - 1;
    slider.value = t.steps.length - 1;
    scheduleDraw();
  }

  const scheduleDraw = throttled(() => drawStep(parseInt($('replay').value, 10)));

  // The cells after step `n` (each [state, text]).
  function cellsAt(n) {
    const cells = [];
    const steps = state.trace.steps;
    for (let k = 0; k <= n && k < steps.length; k++) {
      for (const [i, s, text] of steps[k]) cells[i] = [s, text];
    }
    return cells;
  }

  function drawStep(n) {
    const t = state.trace;
    if (!t) return;
    const cells = cellsAt(n);
    const canvas = $('canvas');
    const ctx = canvas.getContext('2d');
    const slot = Math.max(1, t.slot);
    const cols = slot * Math.max(1, Math.floor(32 / slot));
    const marks = new Set();
    for (const [first, slots] of t.runs) {
      for (let k = 0; k < slots && t.slot > 0; k++) marks.add(first + k * t.slot);
    }
    let last = 0;
    cells.forEach((c, i) => { if (c && c[0] !== 'masked') last = i; });
    const shown = Math.min(t.length, (Math.floor(last / cols) + 2) * cols);
    const rows = Math.max(1, Math.ceil(shown / cols));
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 640;
    const cw = width / cols;
    const ch = 22;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(rows * ch * ratio);
    canvas.style.height = rows * ch + 'px';
    ctx.scale(ratio, ratio);
    ctx.font = '11px ui-monospace, monospace';
    ctx.textBaseline = 'middle';
    let committed = 0;
    for (let i = 0; i < shown; i++) {
      const [s, text] = cells[i] || ['masked', ''];
      if (s === 'committed' || s === 'infilled') committed++;
      const x = (i % cols) * cw;
      const y = Math.floor(i / cols) * ch;
      ctx.fillStyle = COLORS[s] || COLORS.masked;
      ctx.fillRect(x + 1, y + 1, cw - 2, ch - 2);
      if (text) {
        ctx.fillStyle = '#0f172a';
        ctx.save();
        ctx.beginPath();
        ctx.rect(x + 1, y + 1, cw - 2, ch - 2);
        ctx.clip();
        ctx.fillText(text.replace(/\n/g, '⏎'), x + 2, y + ch / 2);
        ctx.restore();
      }
      if (marks.has(i)) {
        ctx.fillStyle = '#475569';
        ctx.fillRect(x, y + 1, 1, ch - 2);
      }
    }
    canvas.dataset.steps = String(t.steps.length);
    canvas.dataset.shownStep = String(n);
    canvas.dataset.committed = String(committed);
    const forwards = t.steps.length - 1 - (t.final ? 1 : 0);
    $('step-label').textContent = t.final && n === t.steps.length - 1
      ? 'the answer (after ' + forwards + ' forwards)'
      : 'step ' + n + ' of ' + forwards;
  }

  // ---- asking ----

  // Server-sent events from a fetch response: calls on(event, data) for each.
  async function readEvents(res, on) {
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, '\n');
      for (let i = buf.indexOf('\n\n'); i >= 0; i = buf.indexOf('\n\n')) {
        const block = buf.slice(0, i);
        buf = buf.slice(i + 2);
        let event = 'message';
        const data = [];
        for (const line of block.split('\n')) {
          if (line.startsWith('event:')) event = line.slice(6).trim();
          else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
        }
        if (data.length) on(event, data.join('\n'));
      }
    }
  }

  function apiMessages(c, template) {
    const out = [];
    const system = $('set-system').value.trim();
    if (system) out.push({ role: 'system', content: system });
    for (const m of c.messages) {
      if (m.role === 'assistant' && !m.done) continue;
      const content = m.template ? stitch(m) : m.content;
      out.push({ role: m.role, content });
    }
    if (template) out.push({ role: 'assistant', content: template });
    return out;
  }

  function stitch(m) {
    const parts = m.template.split(GAP);
    return parts.map((t, i) => t + (i < parts.length - 1 ? ((m.fills || [])[i] || '') : '')).join('');
  }

  // The conversation to ask in (a new one when none is open).
  function currentOrNew(title) {
    let c = conversation();
    if (!c) {
      c = { id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: title.slice(0, 60), messages: [] };
      state.conversations.unshift(c);
      state.current = c.id;
    }
    return c;
  }

  function setBusy(controller) {
    state.busy = controller;
    $('send').disabled = !!controller;
    $('stop').hidden = !controller;
    status(controller ? 'decoding…' : '');
  }

  async function send(e) {
    e.preventDefault();
    if (state.busy) return;
    const started = performance.now();
    const text = $('prompt').value.trim();
    if (!text) return;
    const template = $('template').value;
    const hasGap = template.split(GAP).length > 1;
    if (template.trim() && !hasGap) {
      status('the answer template has no {{gap}}: add one (Insert gap) or clear it');
      return;
    }
    const c = currentOrNew(text);
    c.messages.push({ role: 'user', content: text });
    const answer = { role: 'assistant', content: '', done: false };
    if (hasGap) {
      answer.template = template;
      answer.fills = [];
    }
    const body = Object.assign({ messages: apiMessages(c, hasGap ? template : null), stream: true, decode_events: true }, requestFields());
    if (hasGap) body.infill = true;
    c.messages.push(answer);
    const controller = new AbortController();
    setBusy(controller);
    startTrace();
    // The request goes out first; the page is drawn while the server decodes.
    const response = api('/v1/chat/completions', body, controller.signal);
    response.catch(() => {}); // handled below
    $('prompt').value = '';
    save();
    renderAll();
    const node = $('messages').lastChild;
    const redraw = throttled(() => {
      renderMessage(answer, node);
      $('messages').scrollTop = $('messages').scrollHeight;
    });
    try {
      const res = await response;
      if (!res.ok) {
        const err = await res.json().catch(() => ({}));
        throw new Error((err.error && err.error.message) || res.status + ' ' + res.statusText);
      }
      await readEvents(res, (event, data) => onAnswerEvent(answer, event, data, started, redraw));
    } catch (err) {
      if (err.name === 'AbortError') answer.stopped = true;
      else answer.error = err.message;
    } finally {
      controller.abort(); // a failure mid-stream closes the connection: the server stops
      finishAnswer(answer, node);
    }
  }

  // One server-sent event of an answer: a decode step, or an OpenAI chunk.
  function onAnswerEvent(answer, event, data, started, redraw) {
    if (event === 'refusion.step') {
      addStep(JSON.parse(data));
      return;
    }
    if (data === '[DONE]') return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message || 'the server failed');
    const choice = (chunk.choices || [])[0];
    const delta = (choice && choice.delta) || {};
    if (delta.content) {
      if (answer.firstTokenMs === undefined) answer.firstTokenMs = performance.now() - started;
      if (typeof delta.gap === 'number' && answer.fills) {
        answer.fills[delta.gap] = (answer.fills[delta.gap] || '') + delta.content;
      } else {
        answer.content += delta.content;
      }
      redraw();
    }
    if (chunk.timings) {
      const t = chunk.timings;
      answer.stats = {
        tpf: t.tpf, tokensPerSecond: t.predicted_per_second, forwardCalls: t.forward_calls,
        tokens: t.predicted_n, firstTokenMs: answer.firstTokenMs ?? null,
      };
    }
  }

  function finishAnswer(answer, node) {
    if (answer.template) answer.content = stitch(answer);
    delete answer.firstTokenMs;
    answer.done = true;
    setBusy(null);
    save();
    renderMessage(answer, node);
    const t = state.trace;
    $('replay').disabled = !t || t.steps.length < 2;
    if (t && t.steps.length) scheduleDraw();
    else $('decode').hidden = true;
  }

  // f, at most once per animation frame.
  function throttled(f) {
    let queued = false;
    return () => {
      if (queued) return;
      queued = true;
      requestAnimationFrame(() => {
        queued = false;
        f();
      });
    };
  }

  function insertGap() {
    const t = $('template');
    const at = t.selectionStart ?? t.value.length;
    const gap = '{{gap:16}}';
    t.value = t.value.slice(0, at) + gap + t.value.slice(t.selectionEnd ?? at);
    t.focus();
    t.selectionStart = t.selectionEnd = at + gap.length;
  }

  function init() {
    legend();
    readSettings();
    $('composer').onsubmit = send;
    $('prompt').onkeydown = (e) => {
      if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $('composer').requestSubmit();
      }
    };
    $('stop').onclick = () => state.busy && state.busy.abort();
    $('new-chat').onclick = newConversation;
    $('insert-gap').onclick = insertGap;
    $('replay').oninput = () => drawStep(parseInt($('replay').value, 10));
    $('settings-toggle').onclick = () => {
      const s = $('settings');
      s.hidden = !s.hidden;
      $('settings-toggle').setAttribute('aria-expanded', String(!s.hidden));
    };
    window.addEventListener('resize', scheduleDraw);
    // Another tab saved: take its conversations (unless this one is answering).
    window.addEventListener('storage', (e) => {
      if (e.key !== STORE || state.busy) return;
      state.conversations = validConversations(load(localStorage, STORE, []));
      renderList();
    });
    renderAll();
    loadServerInfo();
  }

  init();
})();
