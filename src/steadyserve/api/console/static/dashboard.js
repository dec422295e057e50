// The dashboard: polls /v1/console/stats every second and draws what it says.
import { $, api, boot, el, fmtNum, fmtSeconds } from "./common.js";
import { LineChart } from "./charts.js";

const POLL_MS = 1000;
const charts = {};
let prev = null; // the previous stats, for rates
const reasonsSeen = new Set();
const tokHist = []; // [server time, generated tokens], the last few seconds

function setupCharts() {
  const fig = (name) => document.querySelector(`figure[data-chart="${name}"]`);
  charts.tokens = new LineChart(fig("tokens"), { format: (v) => fmtNum(v), minMax: 10 });
  charts.requests = new LineChart(fig("requests"), { format: (v) => fmtNum(v, 0), minMax: 4, integer: true });
  charts.kv = new LineChart(fig("kv"), { format: (v) => fmtNum(v * 100, 0) + "%", minMax: 0.05 });
  charts.ttft = new LineChart(fig("ttft"), { format: fmtSeconds, minMax: 0.01 });
  charts.itl = new LineChart(fig("itl"), { format: fmtSeconds, minMax: 0.01 });
  charts.refusals = new LineChart(fig("refusals"), { format: (v) => fmtNum(v, 2), minMax: 1 });
  charts.lag = new LineChart(fig("lag"), { format: fmtSeconds, minMax: 0.005 });
  window.steadyserveConsole = { charts, get last() { return prev; } };
}

function header(s) {
  const m = s.model;
  $("#m-name").textContent = m.name;
  $("#m-name").title = `${m.architecture}, ${m.num_layers} layers, context ${m.max_model_len} tokens`;
  $("#m-fp").textContent = m.fingerprint;
  $("#m-device").textContent = m.device;
  $("#m-dtype").textContent = m.dtype;
  const num = $("#m-numerics");
  num.textContent = `${m.numerics.mode} (${m.numerics_id}) · kernel ${m.kernel}`;
  num.title = Object.entries(m.numerics.facts).map(([k, v]) => `${k}: ${v}`).join("\n");
  const bi = $("#m-bi");
  if (m.selftest === null) {
    bi.textContent = m.batch_invariant ? "on" : "off (self-test skipped)";
    bi.className = m.batch_invariant ? "ok" : "muted";
  } else {
    bi.textContent = (m.batch_invariant ? "on" : "off") + (m.selftest.passed ? " · self-test passed" : " · self-test FAILED");
    bi.className = m.selftest.passed ? "ok" : "bad";
    bi.title = m.selftest.detail;
  }
  const st = s.status;
  const status = $("#m-status");
  status.textContent = st.draining ? "draining" : !st.engine_alive ? "engine down" : st.ready ? "ready" : "not ready";
  status.className = st.ready ? "ok" : "bad";
  const banner = $("#banner");
  let text = "";
  if (st.draining) text = "Draining: the server is shutting down. It finishes the requests in flight and refuses new ones.";
  else if (!st.engine_alive) text = "The engine is not running" + (st.engine_error ? ": " + st.engine_error : "") + ". Requests are refused.";
  else if (!st.selftest_ok) text = "The batch-invariance self-test failed: " + (m.selftest ? m.selftest.detail : "") ;
  showBanner(text, st.draining ? "warn" : "bad");
}

function showBanner(text, kind = "bad") {
  const banner = $("#banner");
  banner.hidden = !text;
  banner.textContent = text;
  banner.className = "banner " + kind;
}

function update(s) {
  header(s);
  const t = s.time;
  const g = s.gauges;
  charts.requests.push(t, { running: g.running, waiting: g.waiting });
  charts.kv.push(t, { "KV cache": g.kv_cache_usage });
  if (s.latency) {
    const L = s.latency;
    charts.ttft.push(t, { p50: L.ttft.p50, p99: L.ttft.p99 });
    charts.itl.push(t, { p50: L.itl.p50, p99: L.itl.p99 });
    charts.lag.push(t, { p50: L.loop_lag.p50, p99: L.loop_lag.p99 });
    $("#window-note").textContent = `Latency percentiles cover the last ${Math.round(s.latency_window_s)} s; rates are between polls.`;
  } else {
    $("#window-note").textContent = "Metrics are disabled on this server (--no-metrics): only the gauges are shown.";
  }
  if (s.counters && !tokHist.length) tokHist.push([t, s.counters.generated_tokens]);
  if (s.counters && prev && prev.counters && t > prev.time) {
    const dt = t - prev.time;
    // Tokens/s over the last ~3 s: steps are bursty, a single poll interval is too jumpy to read.
    tokHist.push([t, s.counters.generated_tokens]);
    while (tokHist.length > 2 && t - tokHist[1][0] >= 3) tokHist.shift();
    const [t0, g0] = tokHist[0];
    charts.tokens.push(t, { "tokens/s": t > t0 ? Math.max(0, s.counters.generated_tokens - g0) / (t - t0) : 0 });
    const vals = {};
    for (const [kind, group] of [["rejected", s.counters.rejected], ["aborted", s.counters.aborted]]) {
      for (const [reason, v] of Object.entries(group)) {
        const before = (prev.counters[kind] || {})[reason] || 0;
        const key = `${kind}: ${reason}`;
        if (v > 0) reasonsSeen.add(key);
        if (reasonsSeen.has(key)) vals[key] = Math.max(0, v - before) / dt;
      }
    }
    if (!Object.keys(vals).length) vals["none"] = 0;
    else if (charts.refusals.series.has("none")) vals["none"] = null;
    charts.refusals.push(t, vals);
  }
  totals(s);
  tenants(s.tenants);
  recent(s.recent);
  prev = s;
}

function totals(s) {
  const dl = $("#totals");
  const rows = [];
  if (s.counters) {
    const c = s.counters;
    const sum = (o) => Object.values(o).reduce((a, b) => a + b, 0);
    rows.push(["Generated tokens", c.generated_tokens], ["Prompt tokens", c.prompt_tokens],
      ["Admitted", sum(c.admitted)]);
    for (const [r, v] of Object.entries(c.finished)) if (v) rows.push([`Finished: ${r}`, v]);
    for (const [r, v] of Object.entries(c.rejected)) if (v) rows.push([`Rejected: ${r}`, v]);
    for (const [r, v] of Object.entries(c.aborted)) if (v) rows.push([`Aborted: ${r}`, v]);
    if (c.preemptions) rows.push(["Preemptions", c.preemptions]);
    if (c.prefix_cache_queried_tokens) {
      const rate = c.prefix_cache_hit_tokens / c.prefix_cache_queried_tokens;
      rows.push(["Prefix cache hits", `${(100 * rate).toFixed(1)}% of ${c.prefix_cache_queried_tokens} prompt tokens`]);
    }
    if (s.gauges.kv_cache_cached_blocks !== undefined) rows.push(["Cached KV blocks", s.gauges.kv_cache_cached_blocks]);
  }
  rows.push(["Capacity", `${s.capacity.max_num_seqs} running + ${s.capacity.max_queue} queued`]);
  rows.push(["Uptime", fmtSeconds(s.uptime_s)]);
  dl.replaceChildren(...rows.map(([k, v]) => el("div", {}, el("dt", { text: k }), el("dd", { text: String(v) }))));
}

function tenants(items) {
  $("#tenants-section").hidden = !items || !items.length;
  if (!items || !items.length) return;
  $("#tenants tbody").replaceChildren(...items.map((t) => el("tr", {},
    el("td", { text: t.name }),
    el("td", { class: "num", text: String(t.weight) }),
    el("td", { text: t.priority }),
    el("td", { class: "num", text: t.in_flight + (t.max_concurrent ? ` / ${t.max_concurrent}` : "") }),
    el("td", { class: "num", text: fmtNum(t.admitted, 0) }),
    el("td", { class: "num", text: fmtNum(t.prompt_tokens, 0) }),
    el("td", { class: "num", text: fmtNum(t.output_tokens, 0) }),
    el("td", { class: "num", text: fmtNum(t.refused, 0) }),
  )));
}

function recent(items) {
  const tbody = $("#recent tbody");
  if (!items.length) {
    tbody.replaceChildren(el("tr", {}, el("td", { colSpan: 8, class: "muted", text: "No finished requests yet." })));
    return;
  }
  tbody.replaceChildren(...items.map((r) => el("tr", { "data-request-id": r.request_id },
    el("td", { class: "mono", text: r.request_id }),
    el("td", { text: r.transport }),
    el("td", { class: "num", text: String(r.prompt_tokens) }),
    el("td", { class: "num", text: String(r.generated_tokens) }),
    el("td", { class: "num", text: fmtSeconds(r.ttft_s) }),
    el("td", { class: "num", text: fmtSeconds(r.total_s) }),
    el("td", { class: r.error ? "bad" : "", text: r.finish_reason + (r.error ? ` (${r.error})` : ""), title: r.error || undefined }),
    el("td", { text: new Date(r.finished_at * 1000).toLocaleTimeString() }),
  )));
}

async function poll() {
  if (!document.hidden) {
    try {
      const { data } = await api("/v1/console/stats");
      update(data);
    } catch (e) {
      if (e.status !== 401) showBanner("Cannot read the server's stats: " + e.message, "bad");
    }
  }
  setTimeout(poll, POLL_MS);
}

boot((first) => {
  setupCharts();
  update(first);
  setTimeout(poll, POLL_MS);
});
