// Shared by the dashboard and the playground: the API key, API calls, readable errors, page boot.
const KEY = "steadyserve.apiKey";

export const $ = (sel, root = document) => root.querySelector(sel);
export const $$ = (sel, root = document) => Array.from(root.querySelectorAll(sel));

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-") || k.startsWith("aria-") || k === "role" || k === "tabindex" || k === "scope" || k === "title") e.setAttribute(k, String(v));
    else e[k] = v;
  }
  for (const c of children) if (c !== undefined && c !== null) e.append(c);
  return e;
}

export class ApiError extends Error {
  constructor(status, body, retryAfter) {
    const err = (body && body.error) || {};
    super(describeError(status, err, retryAfter));
    this.status = status;
    this.error = err;
    this.retryAfter = retryAfter;
  }
}

// One sentence a person can act on, for an HTTP status (or a WebSocket error event) and an OpenAI error object.
export function describeError(status, err = {}, retryAfter = null) {
  const msg = err.message || "no details given";
  const param = err.param ? ` (${err.param})` : "";
  const retry = retryAfter !== null && retryAfter !== undefined && retryAfter !== ""
    ? ` Retry after ${Math.max(1, Math.ceil(Number(retryAfter)))} s.` : "";
  if (status === 429) return `The server is overloaded (429): ${msg}.${retry}`.replace("..", ".");
  if (status === 401) return `Not authorized (401): ${msg}`;
  if (status === 503) return `The server is unavailable (503): ${msg}.${retry}`.replace("..", ".");
  if (status === 499) return `Request cancelled: ${msg}`;
  if (status && status >= 400 && status < 500) return `Request rejected (${status})${param}: ${msg}`;
  if (status && status >= 500) return `Server error (${status})${err.code ? ", " + err.code : ""}: ${msg}`;
  return `Error${err.code ? " (" + err.code + ")" : ""}${param}: ${msg}`;
}

const authListeners = [];
export function onUnauthorized(fn) { authListeners.push(fn); }

// fetch JSON from our own API with the key; throws ApiError with a readable message on any non-2xx answer.
export async function api(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  if (body !== undefined) headers["content-type"] = "application/json";
  const k = apiKey();
  if (k) headers.authorization = "Bearer " + k;
  let r;
  try {
    r = await fetch(path, { method, headers, signal, cache: "no-store",
      body: body === undefined ? undefined : JSON.stringify(body) });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    const err = new ApiError(0, { error: { message: `cannot reach the server (${e.message})`, code: "network" } });
    throw err;
  }
  const text = await r.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = { error: { message: text.slice(0, 300) } }; }
  if (!r.ok) {
    const e = new ApiError(r.status, data, r.headers.get("retry-after"));
    if (r.status === 401) authListeners.forEach((fn) => fn(e));
    throw e;
  }
  return { data, headers: r.headers, status: r.status };
}

export function wsUrl(path) {
  return (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
}

export function wsProtocols() {
  const k = apiKey();
  return k ? ["bearer." + k] : [];
}

// Show the login form until /v1/console/stats answers; then reveal the page and call start(stats).
export async function boot(start) {
  const login = $("#login"), form = $("#login-form"), input = $("#api-key"), msg = $("#login-error");
  const app = $$(".app");
  const signout = $("#signout");
  let started = false;

  function showLogin(text) {
    app.forEach((e) => { e.hidden = true; });
    login.hidden = false;
    msg.textContent = text || "";
    input.value = "";
    input.focus();
  }
  onUnauthorized(() => {
    const had = apiKey();
    sessionStorage.removeItem(KEY);
    if (started) location.reload();
    else showLogin(had ? "That API key was not accepted." : "");
  });
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, input.value.trim());
    await attempt();
  });
  signout.addEventListener("click", () => {
    sessionStorage.removeItem(KEY);
    location.reload();
  });

  async function attempt() {
    try {
      const { data } = await api("/v1/console/stats");
      login.hidden = true;
      app.forEach((e) => { e.hidden = false; });
      signout.hidden = !apiKey();
      started = true;
      start(data);
    } catch (e) {
      if (e.status === 401) {
        // onUnauthorized has shown the login
      } else {
        showLogin(e.message + " — retrying…");
        setTimeout(attempt, 2000);
      }
    }
  }
  await attempt();
}

export function fmtNum(v, digits = 1) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  if (Math.abs(v) >= 1000) return v.toFixed(0);
  return v.toFixed(digits);
}

export function fmtSeconds(s) {
  if (s === null || s === undefined) return "–";
  if (s < 0.001) return (s * 1e6).toFixed(0) + " µs";
  if (s < 1) return (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms";
  return s.toFixed(2) + " s";
}
