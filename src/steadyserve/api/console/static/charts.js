// A small time-series line chart on <canvas>: no library. Series colours match the CSS classes .c0 … .c7.
export const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];

export class LineChart {
  // figure: the <figure> holding a <canvas> and a legend <ul>; opts: {span: seconds shown, format: v => string}
  constructor(figure, opts = {}) {
    this.figure = figure;
    this.canvas = figure.querySelector("canvas");
    this.legend = figure.querySelector(".legend");
    this.span = opts.span || 120;
    this.format = opts.format || ((v) => String(Math.round(v * 100) / 100));
    this.minMax = opts.minMax || 0; // the y axis goes at least this high
    this.integer = !!opts.integer; // counts: ticks on whole numbers
    this.label = opts.label || figure.querySelector("figcaption").textContent.trim();
    this.series = new Map(); // name -> {color, points: [[t, v|null]]}
    this.max = 0;
    new ResizeObserver(() => this.draw()).observe(this.canvas);
  }

  ensure(name) {
    if (!this.series.has(name)) {
      const i = this.series.size % COLORS.length;
      this.series.set(name, { color: COLORS[i], points: [] });
      if (this.legend) {
        const sw = document.createElement("span");
        sw.className = "swatch c" + i;
        sw.setAttribute("aria-hidden", "true");
        const li = document.createElement("li");
        const val = document.createElement("span");
        val.className = "val";
        li.append(sw, document.createTextNode(name + " "), val);
        this.legend.append(li);
        this.series.get(name).li = val;
      }
    }
    return this.series.get(name);
  }

  // values: {seriesName: number|null}
  push(t, values) {
    for (const [name, v] of Object.entries(values)) {
      const s = this.ensure(name);
      s.points.push([t, v]);
      while (s.points.length && s.points[0][0] < t - this.span - 5) s.points.shift();
      if (s.li) s.li.textContent = v === null || v === undefined ? "–" : this.format(v);
      if (v !== null && v !== undefined && v > this.max) this.max = v;
    }
    this.now = t;
    this.figure.dataset.max = String(this.max);
    this.figure.dataset.points = String(Math.max(0, ...Array.from(this.series.values(), (s) => s.points.length)));
    this.draw();
  }

  draw() {
    const c = this.canvas;
    const dpr = window.devicePixelRatio || 1;
    const w = c.clientWidth, h = c.clientHeight;
    if (!w || !h) return;
    if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
      c.width = Math.round(w * dpr);
      c.height = Math.round(h * dpr);
    }
    const g = c.getContext("2d");
    g.setTransform(dpr, 0, 0, dpr, 0, 0);
    g.clearRect(0, 0, w, h);
    const css = getComputedStyle(c);
    const ink = css.color || "#111";
    const grid = css.getPropertyValue("--grid").trim() || "rgba(128,128,128,.25)";
    const padL = 56, padR = 8, padT = 8, padB = 18;
    const now = this.now || 0;
    let ymax = this.minMax;
    for (const s of this.series.values())
      for (const [t, v] of s.points) if (v !== null && t >= now - this.span && v > ymax) ymax = v;
    ymax = this.integer ? Math.max(4, Math.ceil(ymax / 4) * 4) : niceCeil(ymax);
    const x = (t) => padL + ((t - (now - this.span)) / this.span) * (w - padL - padR);
    const y = (v) => padT + (1 - v / ymax) * (h - padT - padB);
    g.font = "11px system-ui, sans-serif";
    g.fillStyle = ink;
    g.strokeStyle = grid;
    g.lineWidth = 1;
    g.textAlign = "right";
    g.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = (ymax * i) / 4, yy = Math.round(y(v)) + 0.5;
      g.beginPath(); g.moveTo(padL, yy); g.lineTo(w - padR, yy); g.stroke();
      g.fillText(this.format(v), padL - 4, yy);
    }
    g.textAlign = "left";
    g.textBaseline = "alphabetic";
    g.fillText(`−${this.span}s`, padL, h - 4);
    g.textAlign = "right";
    g.fillText("now", w - padR, h - 4);
    g.save();
    g.beginPath(); g.rect(padL, 0, w - padL - padR, h); g.clip();
    g.lineWidth = 1.75;
    for (const s of this.series.values()) {
      g.strokeStyle = s.color;
      g.beginPath();
      let pen = false;
      for (const [t, v] of s.points) {
        if (v === null || v === undefined) { pen = false; continue; }
        if (!pen) g.moveTo(x(t), y(v)); else g.lineTo(x(t), y(v));
        pen = true;
      }
      g.stroke();
    }
    g.restore();
    const latest = Array.from(this.series.entries(), ([n, s]) => {
      const p = s.points[s.points.length - 1];
      return `${n} ${p && p[1] !== null ? this.format(p[1]) : "no data"}`;
    }).join(", ");
    c.setAttribute("aria-label", `${this.label}, last ${this.span} seconds. Latest: ${latest || "no data"}.`);
  }
}

function niceCeil(v) {
  if (!(v > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (v <= m * p) return m * p;
  return 10 * p;
}
