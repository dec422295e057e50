// The playground: stream over WS /v1/stream, score a text's tokens, check determinism. Every error is shown.
import { $, $$, api, ApiError, boot, describeError, el, wsProtocols, wsUrl } from "./common.js";

const tokenText = new Map(); // token id -> text, from /v1/console/tokens
let ws = null;
let stats = null;

const mode = () => $("input[name=mode]:checked").value;

// ---- errors and status --------------------------------------------------------------------------
function showError(text) {
  const e = $("#error");
  e.textContent = text;
  e.hidden = !text;
}
function setStatus(text) { $("#status").textContent = text; }

// ---- the request the controls describe ----------------------------------------------------------
function num(id, { integer = false } = {}) {
  const raw = $("#" + id).value.trim();
  if (raw === "") return undefined;
  const v = Number(raw);
  if (!Number.isFinite(v)) throw new ApiError(400, { error: { message: `${id} must be a number`, param: id } });
  if (integer && !Number.isInteger(v)) throw new ApiError(400, { error: { message: `${id} must be a whole number`, param: id } });
  return v;
}

function stops() {
  const raw = $("#stop").value;
  if (!raw.trim()) return undefined;
  return raw.split(",").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t")).filter((s) => s.length);
}

function buildRequest(top = 5) {
  const req = {
    max_tokens: num("max_tokens", { integer: true }),
    temperature: num("temperature"),
    top_p: num("top_p"),
    top_k: num("top_k", { integer: true }),
    seed: num("seed", { integer: true }),
    stop: stops(),
  };
  if (mode() === "chat") {
    const messages = [];
    const sys = $("#system").value;
    if (sys.trim()) messages.push({ role: "system", content: sys });
    messages.push({ role: "user", content: $("#user").value });
    Object.assign(req, { messages, logprobs: true, top_logprobs: top });
  } else {
    Object.assign(req, { prompt: $("#prompt").value, logprobs: top });
  }
  for (const k of Object.keys(req)) if (req[k] === undefined) delete req[k];
  return req;
}

// ---- token rendering ------------------------------------------------------------------------------
const BUCKETS = [0.9, 0.6, 0.3, 0.1, 0.01]; // p5 … p1; below the last: p0
function shade(logprob) {
  if (logprob === null || logprob === undefined) return "pn";
  const p = Math.exp(logprob);
  for (let i = 0; i < BUCKETS.length; i++) if (p >= BUCKETS[i]) return "p" + (5 - i);
  return "p0";
}

function visible(text) {
  if (text === "") return "∅";
  return text;
}

// info: {text, id?, logprob, top: [[text, logprob, id?]]}
function addToken(info) {
  const box = $("#tokens");
  const i = box.children.length;
  const span = el("span", {
    class: "tok " + shade(info.logprob) + (info.text === "" ? " empty" : ""),
    tabindex: i === 0 ? 0 : -1,
    "data-i": i,
    "data-logprob": info.logprob === null || info.logprob === undefined ? "" : String(info.logprob),
    "data-token-id": info.id,
    text: visible(info.text),
  });
  span._info = info;
  box.append(span);
  return span;
}

function pct(lp) {
  const p = Math.exp(lp) * 100;
  return p >= 10 ? p.toFixed(1) + "%" : p >= 0.01 ? p.toFixed(2) + "%" : p.toExponential(1) + "%";
}

function showTip(span) {
  const info = span._info;
  const tip = $("#tip");
  const rows = (info.top || []).map(([text, lp]) =>
    el("tr", { class: text === info.text ? "chosen" : "" },
      el("td", { class: "mono", text: JSON.stringify(text) }),
      el("td", { class: "num", text: lp.toFixed(4) }),
      el("td", { class: "num", text: pct(lp) })));
  tip.replaceChildren(
    el("div", { class: "tip-head" },
      el("span", { class: "mono", text: JSON.stringify(info.text) }),
      info.id !== undefined ? el("span", { class: "muted", text: ` id ${info.id}` }) : null),
    info.logprob === null || info.logprob === undefined
      ? el("div", { class: "muted", text: "No logprob: the first prompt token has no context." })
      : el("div", { class: "tip-lp", text: `logprob ${info.logprob.toFixed(4)} · p ${pct(info.logprob)}` }),
    rows.length ? el("table", {}, el("caption", { text: "Top alternatives" }),
      el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "token" }), el("th", { scope: "col", text: "logprob" }), el("th", { scope: "col", text: "p" }))),
      el("tbody", {}, ...rows)) : null);
  tip.hidden = false;
  const box = $("#tokens").getBoundingClientRect();
  const r = span.getBoundingClientRect();
  const parent = tip.offsetParent ? tip.offsetParent.getBoundingClientRect() : { left: 0, top: 0 };
  const width = tip.offsetWidth;
  let left = r.left - parent.left;
  left = Math.max(0, Math.min(left, box.right - parent.left - width));
  tip.style.left = left + "px";
  tip.style.top = (r.bottom - parent.top + 4) + "px";
  $$(".tok.active").forEach((t) => t.classList.remove("active"));
  span.classList.add("active");
}
function hideTip() {
  $("#tip").hidden = true;
  $$(".tok.active").forEach((t) => t.classList.remove("active"));
}

function setupTokenNav() {
  const box = $("#tokens");
  box.addEventListener("mouseover", (ev) => { if (ev.target.classList.contains("tok")) showTip(ev.target); });
  box.addEventListener("mouseleave", () => { if (!box.contains(document.activeElement)) hideTip(); });
  box.addEventListener("focusin", (ev) => { if (ev.target.classList.contains("tok")) showTip(ev.target); });
  box.addEventListener("focusout", (ev) => { if (!box.contains(ev.relatedTarget)) hideTip(); });
  box.addEventListener("keydown", (ev) => {
    const cur = ev.target.closest(".tok");
    if (!cur) return;
    const toks = box.children;
    let i = Number(cur.dataset.i);
    if (ev.key === "ArrowRight" || ev.key === "ArrowDown") i = Math.min(toks.length - 1, i + 1);
    else if (ev.key === "ArrowLeft" || ev.key === "ArrowUp") i = Math.max(0, i - 1);
    else if (ev.key === "Home") i = 0;
    else if (ev.key === "End") i = toks.length - 1;
    else if (ev.key === "Escape") { hideTip(); return; }
    else return;
    ev.preventDefault();
    cur.tabIndex = -1;
    toks[i].tabIndex = 0;
    toks[i].focus();
  });
}

function clearOutput() {
  showError("");
  hideTip();
  $("#tokens").replaceChildren();
  $("#summary").replaceChildren();
  setStatus("");
}

async function texts(ids) {
  const missing = [...new Set(ids.filter((i) => !tokenText.has(i)))];
  if (missing.length) {
    const { data } = await api("/v1/console/tokens", { method: "POST", body: { ids: missing } });
    missing.forEach((id, k) => tokenText.set(id, data.tokens[k]));
  }
}

// ---- streaming over the WebSocket ---------------------------------------------------------------
function stream() {
  clearOutput();
  let req;
  try { req = buildRequest(5); } catch (e) { showError(e.message); return; }
  const started = performance.now();
  let firstAt = null, final = null, failed = false, count = 0;
  let chain = Promise.resolve();
  setBusy(true);
  setStatus("Connecting…");
  const sock = new WebSocket(wsUrl("/v1/stream"), wsProtocols());
  ws = sock;
  sock.addEventListener("open", () => { setStatus("Streaming…"); sock.send(JSON.stringify(req)); });
  sock.addEventListener("message", (ev) => {
    let m;
    try { m = JSON.parse(ev.data); } catch { failed = true; showError("The server sent a message that is not JSON."); return; }
    chain = chain.then(() => handle(m)).catch((e) => { failed = true; showError(e.message); });
  });
  sock.addEventListener("close", (ev) => {
    chain = chain.then(() => {
      setBusy(false);
      if (ws === sock) ws = null;
      if (final || failed) return;
      if (ev.code === 1008 && ev.reason) showError(`The server refused the connection: ${ev.reason}`);
      else if (stoppedByUser) setStatus(`Stopped after ${count} tokens.`);
      else showError(`The stream closed without a final message (WebSocket close code ${ev.code}${ev.reason ? ": " + ev.reason : ""}).`);
    });
  });

  async function handle(m) {
    if (m.type === "delta") {
      if (firstAt === null) firstAt = performance.now();
      const lps = m.logprobs || [];
      const ids = [...m.token_ids];
      for (const lp of lps) for (const [id] of lp.top) ids.push(id);
      await texts(ids);
      m.token_ids.forEach((id, k) => {
        const lp = lps[k];
        addToken({ id, text: tokenText.get(id), logprob: lp ? lp.logprob : null,
          top: lp ? lp.top.map(([tid, v]) => [tokenText.get(tid), v, tid]) : [] });
        count++;
      });
      setStatus(`Streaming… ${count} tokens`);
    } else if (m.type === "final") {
      final = m;
      const secs = (performance.now() - started) / 1000;
      setStatus(`Done: ${m.finish_reason} · ${m.usage.prompt_tokens} prompt + ${m.usage.completion_tokens} generated tokens · `
        + `first token after ${firstAt === null ? "–" : ((firstAt - started) / 1000).toFixed(2) + " s"} · ${secs.toFixed(2)} s in all`);
      $("#tokens").dataset.done = String(m.usage.completion_tokens);
      summarize();
    } else if (m.type === "error") {
      failed = true;
      const err = m.error || {};
      // Refusals carry their HTTP status; a bad request (close 1008) is a 400, anything else a server error.
      const status = m.status || (err.type === "invalid_request_error" ? 400 : 500);
      showError(describeError(status, err, m.retry_after));
      setStatus("");
    }
  }
}

let stoppedByUser = false;
function stopStream() {
  if (ws) { stoppedByUser = true; ws.close(1000, "stopped by the user"); }
}

function setBusy(busy) {
  if (!busy) stoppedByUser = false;
  $("#stream").disabled = busy;
  $("#score").disabled = busy;
  $("#check-det").disabled = busy;
  $("#stop-stream").disabled = !busy;
}

// Totals and the most surprising tokens of what is shown.
function summarize() {
  const spans = $$("#tokens .tok").filter((s) => s._info.logprob !== null && s._info.logprob !== undefined);
  if (!spans.length) return;
  const lps = spans.map((s) => s._info.logprob);
  const sum = lps.reduce((a, b) => a + b, 0);
  const worst = [...spans].sort((a, b) => a._info.logprob - b._info.logprob).slice(0, 5);
  $("#summary").replaceChildren(
    el("p", { text: `${spans.length} tokens with logprobs · sum ${sum.toFixed(3)} · mean ${(sum / spans.length).toFixed(3)} · perplexity ${Math.exp(-sum / spans.length).toFixed(2)}` }),
    el("p", { class: "small" }, "Most surprising: ", ...worst.flatMap((s, k) => [
      k ? ", " : "",
      el("button", { type: "button", class: "link mono", text: JSON.stringify(s._info.text) + ` (${s._info.logprob.toFixed(2)})`,
        onclick: () => { s.focus(); } }),
    ])));
}

// ---- score mode --------------------------------------------------------------------------------
async function score() {
  clearOutput();
  const prompt = $("#prompt").value;
  if (!prompt) { showError("Paste or type some text to score."); return; }
  setBusy(true);
  setStatus("Scoring…");
  try {
    const { data } = await api("/v1/completions", { method: "POST",
      body: { prompt, max_tokens: 0, echo: true, logprobs: 5 } });
    const lp = data.choices[0].logprobs;
    lp.tokens.forEach((text, k) => {
      const top = lp.top_logprobs && lp.top_logprobs[k]
        ? Object.entries(lp.top_logprobs[k]).sort((a, b) => b[1] - a[1]) : [];
      addToken({ text, logprob: lp.token_logprobs[k], top });
    });
    $("#tokens").dataset.done = String(lp.tokens.length);
    setStatus(`Scored ${lp.tokens.length} prompt tokens · fingerprint ${data.system_fingerprint}`);
    summarize();
  } catch (e) {
    showError(e.message);
    setStatus("");
  } finally {
    setBusy(false);
  }
}

// ---- determinism: the validator, in the browser ----------------------------------------------------
function vectorOf(kind, body) {
  const c = body.choices[0];
  if (kind === "chat") return (c.logprobs && c.logprobs.content || []).map((t) => t.logprob);
  return (c.logprobs && c.logprobs.token_logprobs) || [];
}

function bytesKey(values) {
  const a = new Float64Array(values);
  return Array.from(new Uint8Array(a.buffer), (b) => b.toString(16).padStart(2, "0")).join("");
}

async function withRetry(path, body, counters) {
  for (let attempt = 0; ; attempt++) {
    try {
      return (await api(path, { method: "POST", body })).data;
    } catch (e) {
      if (e.status === 429 && attempt < 5) {
        counters.refused++;
        await new Promise((r) => setTimeout(r, 1000 * Math.max(0.2, Number(e.retryAfter) || 1)));
        continue;
      }
      throw e;
    }
  }
}

async function checkDeterminism() {
  clearOutput();
  $("#det-result").replaceChildren();
  let base;
  try {
    const n = num("det-n", { integer: true }), bg = num("det-bg", { integer: true }) || 0;
    if (!(n >= 1 && n <= 64)) throw new ApiError(400, { error: { message: "identical requests must be between 1 and 64", param: "det-n" } });
    if (!(bg >= 0 && bg <= 64)) throw new ApiError(400, { error: { message: "background requests must be between 0 and 64", param: "det-bg" } });
    base = { n, bg, req: buildRequest(0) };
  } catch (e) { showError(e.message); return; }
  const kind = mode() === "chat" ? "chat" : "completion";
  const path = kind === "chat" ? "/v1/chat/completions" : "/v1/completions";
  const req = base.req;
  let note = "";
  if ((req.temperature === undefined || req.temperature > 0) && req.seed === undefined) {
    req.seed = 1234;
    note = "Temperature > 0 without a seed: every copy uses seed 1234. ";
  }
  const counters = { refused: 0 };
  const maxTok = req.max_tokens || 16;
  const background = Array.from({ length: base.bg }, (_, k) => {
    const b = { ...req, temperature: 1, seed: 1000 + k, max_tokens: 1 + ((k * 7) % maxTok) };
    delete b.stop;
    if (kind === "chat") b.messages = [{ role: "user", content: `Background request ${k}: ${"lorem ipsum ".repeat(1 + (k % 5))}` }];
    else b.prompt = `Background request ${k}: ${"lorem ipsum dolor ".repeat(1 + (k % 5))}`;
    return b;
  });
  setBusy(true);
  setStatus(`Sending ${base.n} identical requests with ${base.bg} background requests…`);
  const t0 = performance.now();
  try {
    const jobs = [];
    // Interleave so the identical requests land in different batches and batch positions.
    for (let k = 0; k < Math.max(base.n, base.bg); k++) {
      if (k < base.bg) jobs.push(withRetry(path, background[k], counters).then(() => null));
      if (k < base.n) jobs.push(withRetry(path, req, counters));
    }
    const results = (await Promise.all(jobs)).filter((r) => r !== null);
    const vectors = results.map((r) => vectorOf(kind, r));
    const distinct = new Set(vectors.map(bytesKey));
    const texts = new Set(results.map((r) => kind === "chat" ? r.choices[0].message.content : r.choices[0].text));
    const fps = new Set(results.map((r) => r.system_fingerprint));
    let drift = 0, lengthsDiffer = false;
    for (const v of vectors) {
      if (v.length !== vectors[0].length) { lengthsDiffer = true; continue; }
      v.forEach((x, j) => { drift = Math.max(drift, Math.abs(x - vectors[0][j])); });
    }
    const ok = distinct.size === 1;
    const box = $("#det-result");
    box.dataset.distinct = String(distinct.size);
    box.dataset.drift = String(drift);
    box.className = "det-result " + (ok ? "ok" : "bad");
    box.replaceChildren(
      el("h3", { text: ok ? "Deterministic" : "Not deterministic" }),
      el("dl", {},
        ...[["Distinct logprob vectors", `${distinct.size} of ${results.length}`],
          ["Max drift", lengthsDiffer ? `${drift.toExponential(3)} (and lengths differ)` : drift === 0 ? "0 (bitwise identical)" : drift.toExponential(3)],
          ["Distinct texts", String(texts.size)],
          ["Tokens per response", String(vectors[0] ? vectors[0].length : 0)],
          ["Background requests", String(base.bg)],
          ["Refused (429) and retried", String(counters.refused)],
          ["Fingerprints", [...fps].join(", ")],
          ["Time", ((performance.now() - t0) / 1000).toFixed(2) + " s"]]
          .map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: v })))),
      note ? el("p", { class: "small muted", text: note }) : null);
    setStatus("");
  } catch (e) {
    showError(e.message);
    setStatus("");
  } finally {
    setBusy(false);
  }
}

// ---- wiring ------------------------------------------------------------------------------------
function applyMode() {
  const m = mode();
  $("#chat-fields").hidden = m !== "chat";
  $("#prompt-field").hidden = m === "chat";
  $("#sampling").disabled = m === "score";
  $("#stream").hidden = m === "score";
  $("#stop-stream").hidden = m === "score";
  $("#score").hidden = m !== "score";
  $("#prompt-hint").textContent = m === "score" ? "(paste any text: each token is shaded by how surprising the model finds it)" : "";
  $("#check-det").closest("fieldset").hidden = m === "score";
}

boot((s) => {
  stats = s;
  $("#model-line").textContent = `${s.model.name} · ${s.model.fingerprint}`;
  setupTokenNav();
  $$("input[name=mode]").forEach((r) => r.addEventListener("change", applyMode));
  applyMode();
  $("#request-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (mode() === "score") score(); else stream();
  });
  $("#stop-stream").addEventListener("click", stopStream);
  $("#score").addEventListener("click", score);
  $("#check-det").addEventListener("click", checkDeterminism);
});
