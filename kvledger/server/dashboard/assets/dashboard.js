// The live dashboard: polls /dashboard/api/stats and redraws the cards, the two time charts,
// the block map, the request table, the latency histograms and the alerts.
"use strict";
(() => {
  const params = new URLSearchParams(location.search);
  const INTERVAL_MS = Math.max(100, Number(params.get("interval_ms")) || 1000);
  const HISTORY = 900; // points kept for the time charts
  const FREE = -1, CACHED = -2, SHARED = -3, OTHER = -4;
  const COLORS = { free: "#232938", cached: "#4b5d80", shared: "#f2d14b", other: "#7a8294" };
  const AXIS = { stroke: "#8a94a7", grid: { stroke: "#262c38", width: 1 },
                 ticks: { stroke: "#262c38", width: 1 } };
  const $ = (id) => document.getElementById(id);
  const history = { t: [], used: [], cached: [], allocated: [], predicted: [] };
  let charts = null;
  let lastGen = null;

  function requestColor(id) {
    let h = 0;
    for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
    return `hsl(${h % 360}, 70%, 62%)`;
  }

  // bucket bounds as axis labels: 0.0025 -> "2.5ms", 0.75 -> "750ms", 2.5 -> "2.5s"
  function shortSeconds(s) {
    return s < 1 ? +(s * 1e3).toPrecision(3) + "ms" : +s.toPrecision(3) + "s";
  }

  function width(node) { return Math.max(200, node.clientWidth); }

  const MIN_SPAN_S = 60;  // a time axis spans at least this, ending at the latest sample

  // the time range from the samples themselves: uPlot widens one sample's to 86,400 / ms
  // seconds (1,000 days with times in seconds: "Apr 2027 ... Aug 2029")
  function timeRange(u, lo, hi) {
    const t = u.data[0];
    if (!t || t.length === 0) return [lo, hi];
    const first = t[0], last = t[t.length - 1];
    return last - first < MIN_SPAN_S ? [last - MIN_SPAN_S, last] : [first, last];
  }

  function lineChart(node, series, yValues, yRange) {
    const opts = {
      width: width(node), height: 200, legend: { live: false }, cursor: { drag: { x: false } },
      scales: { x: { time: true, range: timeRange },
                y: { range: yRange || ((u, lo, hi) => [0, Math.max(1, hi * 1.15)]) } },
      axes: [AXIS, Object.assign({}, AXIS, { values: yValues, size: 70 })],
      series: [{}].concat(series),
    };
    for (const s of series) s.points = { show: false };
    return new uPlot(opts, [[], ...series.map(() => [])], node);
  }

  function histogram(node) {
    const state = { labels: [] };
    const opts = {
      width: width(node), height: 180, legend: { show: false }, cursor: { show: false },
      scales: { x: { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] },
                y: { range: (u, lo, hi) => [0, Math.max(1, hi * 1.1)] } },
      axes: [Object.assign({}, AXIS, {
               splits: (u) => state.labels.map((_, i) => i),
               values: (u, splits) => splits.map((i) => {
                 const step = Math.ceil(state.labels.length / 6);
                 return i % step === 0 ? state.labels[i] : "";
               }) }),
             Object.assign({}, AXIS, { size: 45 })],
      series: [{}, { stroke: "#5ab0ff", fill: "rgba(90,176,255,0.45)",
                     paths: uPlot.paths.bars({ size: [0.85, 60] }), points: { show: false } }],
    };
    return { plot: new uPlot(opts, [[], []], node), state };
  }

  function buildCharts() {
    charts = {
      usage: lineChart($("chart-usage"), [
        { label: "in use", stroke: "#5ab0ff", fill: "rgba(90,176,255,0.15)", width: 2 },
        { label: "cached", stroke: "#8ea0c8", width: 1.5 },
      ], (u, v) => v.map((x) => x + "%"), (u, lo, hi) => [0, Math.min(100, Math.max(10, hi * 1.25))]),
      ledger: lineChart($("chart-ledger"), [
        { label: "allocated", stroke: "#3ecf8e", width: 2 },
        { label: "ledger", stroke: "#f2b84b", width: 1.5, dash: [6, 4] },
      ], (u, v) => v.map(KV.bytes)),
      ttft: histogram($("hist-ttft")),
      tpot: histogram($("hist-tpot")),
      itl: histogram($("hist-itl")),
    };
    window.addEventListener("resize", () => {
      for (const [name, id] of [["usage", "chart-usage"], ["ledger", "chart-ledger"]]) {
        charts[name].setSize({ width: width($(id)), height: 200 });
      }
      for (const name of ["ttft", "tpot", "itl"]) {
        charts[name].plot.setSize({ width: width($("hist-" + name)), height: 180 });
      }
    });
  }

  function pushHistory(snap) {
    const pool = snap.pool || { blocks_total: 1, blocks_in_use: 0, blocks_cached: 0 };
    const h = history;
    h.t.push(snap.time);
    h.used.push(100 * pool.blocks_in_use / pool.blocks_total);
    h.cached.push(100 * pool.blocks_cached / pool.blocks_total);
    h.allocated.push(snap.stats.kv_bytes_allocated || 0);
    h.predicted.push(snap.stats.kv_bytes_predicted || 0);
    if (h.t.length > HISTORY) for (const k in h) h[k].shift();
    charts.usage.setData([h.t, h.used, h.cached]);
    charts.ledger.setData([h.t, h.allocated, h.predicted]);
  }

  function drawCards(snap) {
    const s = snap.stats, pool = snap.pool;
    $("model").textContent = snap.model;
    $("kv-usage").textContent = KV.pct(s.kv_usage || 0);
    if (pool) {
      $("kv-usage-sub").textContent = `${pool.blocks_in_use} / ${pool.blocks_total} blocks · ` +
        `${KV.bytes(pool.blocks_total * pool.bytes_per_block)} pool`;
    }
    const tiers = Object.entries(snap.tiers || {});
    $("tier-card").hidden = tiers.length === 0;
    if (tiers.length) {
      $("tier-value").textContent = tiers.map(([n, t]) => `${n} ${KV.bytes(t.bytes_held)}`)
        .join(" · ");
      $("tier-sub").textContent = tiers.map(([n, t]) =>
        `${n}: ${t.hits} hits, ${t.corrupt_files} corrupt${t.disabled ? ", OFF" : ""}`)
        .join(" · ") + ` · ${s.kv_tier_dropped_writes || 0} dropped writes`;
    }
    $("num-running").textContent = s.num_running;
    $("num-waiting").textContent = s.num_waiting;
    const gen = snap.counters.generation_tokens || 0;
    if (lastGen) {
      const rate = (gen - lastGen.tokens) / Math.max(1e-3, snap.time - lastGen.time);
      $("max-seqs").textContent = rate.toFixed(1) + " tok/s generated";
    }
    lastGen = { tokens: gen, time: snap.time };
    const queried = s.prefix_cache_queried_tokens || 0, hits = s.prefix_cache_hit_tokens || 0;
    $("hit-rate").textContent = queried ? KV.pct(hits / queried) : "-";
    $("hit-sub").textContent = `${hits} of ${queried} prompt tokens`;
    $("spec-card").hidden = s.spec_proposed_tokens === undefined;
    if (s.spec_proposed_tokens !== undefined) {
      const proposed = s.spec_proposed_tokens, accepted = s.spec_accepted_tokens;
      $("spec-rate").textContent = proposed ? KV.pct(accepted / proposed) : "-";
      $("spec-sub").textContent = `${accepted} of ${proposed} proposed tokens`;
    }
    $("preemptions").textContent = s.num_preemptions || 0;
    $("ledger").textContent = KV.bytes(s.kv_bytes_allocated || 0);
    $("ledger-sub").textContent = "allocated · ledger " + KV.bytes(s.kv_bytes_predicted || 0);
  }

  function drawBlocks(snap) {
    const canvas = $("blockmap"), blocks = snap.blocks, n = blocks.length;
    const counts = { used: 0, shared: 0, cached: 0, free: 0 };
    const colorOf = snap.requests.map((r) => requestColor(r.id));
    const ratio = window.devicePixelRatio || 1, w = canvas.clientWidth;
    const cell = Math.max(4, Math.min(16, Math.floor(Math.sqrt((w * 160) / Math.max(1, n)))));
    const cols = Math.max(1, Math.floor(w / cell)), rows = Math.ceil(n / cols);
    canvas.height = Math.max(1, rows * cell) * ratio;
    canvas.width = w * ratio;
    canvas.style.height = rows * cell + "px";
    const ctx = canvas.getContext("2d");
    ctx.scale(ratio, ratio);
    for (let i = 0; i < n; i++) {
      const b = blocks[i];
      let color;
      if (b === FREE) { color = COLORS.free; counts.free++; }
      else if (b === CACHED) { color = COLORS.cached; counts.cached++; }
      else if (b === SHARED) { color = COLORS.shared; counts.shared++; }
      else if (b === OTHER) { color = COLORS.other; counts.used++; }  // another key's request
      else { color = colorOf[b]; counts.used++; }
      ctx.fillStyle = color;
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - 1, cell - 1);
    }
    $("legend-in-use").textContent = counts.used;
    $("legend-shared").textContent = counts.shared;
    $("legend-cached").textContent = counts.cached;
    $("legend-free").textContent = counts.free;
    if (snap.pool) {
      $("block-hint").textContent = `${n} blocks of ${snap.pool.block_size} tokens, ` +
        `${KV.bytes(snap.pool.bytes_per_block)} each; colour = request`;
    }
  }

  function drawRequests(snap) {
    const tbody = $("requests").tBodies[0];
    const rows = snap.requests.map((r) => {
      const share = r.quota_bytes ? Math.min(1, r.kv_bytes / r.quota_bytes) : 0;
      const fill = KV.el("div");
      fill.style.width = (100 * share).toFixed(1) + "%";
      const swatch = KV.el("span", { className: "swatch" });
      swatch.style.background = requestColor(r.id);
      const tr = KV.el("tr", {},
        KV.el("td", { className: "id", title: r.id }, swatch, r.id),
        KV.el("td", { className: "left" }, KV.el("span", { className: "pill " + r.state }, r.state)),
        KV.el("td", { className: "prompt" }, r.prompt_tokens),
        KV.el("td", { className: "output" }, r.output_tokens),
        KV.el("td", { className: "cached" }, r.cached_tokens),
        KV.el("td", { className: "blocks" }, r.blocks),
        KV.el("td", { className: "left kv" }, KV.el("div", { className: "bar" }, fill,
          KV.el("span", {}, `${KV.bytes(r.kv_bytes)} / ${KV.bytes(r.quota_bytes)}`))),
        KV.el("td", { className: "preempted" }, r.preemptions));
      tr.dataset.requestId = r.id;
      tr.dataset.kvBytes = r.kv_bytes;
      return tr;
    });
    if (!rows.length) {
      rows.push(KV.el("tr", {}, KV.el("td", { className: "empty", colSpan: 8 }, "no requests")));
    }
    tbody.replaceChildren(...rows);
  }

  function drawHistograms(snap) {
    for (const name of ["ttft", "tpot", "itl"]) {
      const h = snap.histograms[name], { plot, state } = charts[name];
      const labels = h.le.map(shortSeconds).concat(["more"]);
      let lo = h.counts.findIndex((c) => c > 0), hi = h.counts.length - 1;
      while (hi > 0 && h.counts[hi] === 0) hi--;
      if (lo < 0) { lo = 0; hi = Math.min(5, labels.length - 1); }
      lo = Math.max(0, lo - 1);
      hi = Math.min(labels.length - 1, Math.max(hi + 1, lo + 5));
      state.labels = labels.slice(lo, hi + 1);
      const xs = state.labels.map((_, i) => i);
      plot.setData([xs, h.counts.slice(lo, hi + 1)]);
      const mean = h.count ? KV.seconds(h.sum / h.count) : "-";
      $(name + "-hint").textContent = `${h.count} samples, mean ${mean}`;
    }
  }

  function drawAlerts(snap) {
    const items = snap.alerts.map((a) => KV.el("li", { className: a.level }, a.message));
    if (!items.length) items.push(KV.el("li", {}, "No alerts."));
    $("alerts").replaceChildren(...items);
  }

  async function poll() {
    try {
      const snap = await KV.api("/dashboard/api/stats");
      if (!charts) buildCharts();
      drawCards(snap);
      pushHistory(snap);
      drawBlocks(snap);
      drawRequests(snap);
      drawHistograms(snap);
      drawAlerts(snap);
      $("status").className = "status live";
      $("status").textContent = "live · " + new Date(snap.time * 1000).toLocaleTimeString();
    } catch (err) {
      if (err instanceof KV.AuthError) { KV.refused(); return; }
      $("status").className = "status stale";
      $("status").textContent = "no data: " + err.message;
    }
    setTimeout(poll, INTERVAL_MS);
  }

  KV.start(poll);
})();
