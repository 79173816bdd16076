// The planner form: fills the choices from /dashboard/api/catalogue, posts to
// /dashboard/api/plan and shows the plan's tables and its plot.
"use strict";
(() => {
  const $ = (id) => document.getElementById(id);
  const count = (n) => (n >= 1e9 ? (n / 1e9).toFixed(2) + " B" : (n / 1e6).toFixed(1) + " M");

  function options(select, values, chosen) {
    select.replaceChildren(...values.map((v) => {
      const [value, text] = Array.isArray(v) ? v : [v, v];
      return KV.el("option", { value, selected: value === chosen }, text);
    }));
  }

  function table(node, head, rows) {
    const thead = KV.el("thead", {}, KV.el("tr", {}, ...head.map((h) => KV.el("th", {}, h))));
    const tbody = KV.el("tbody", {}, ...rows.map((r) =>
      KV.el("tr", {}, ...r.map((c) => KV.el("td", {}, c)))));
    node.replaceChildren(thead, tbody);
  }

  function show(result) {
    const p = result.plan, o = p.options, d = p.device;
    $("summary").replaceChildren(
      KV.el("div", {}, KV.el("b", {}, p.model), ` (${p.model_type}): ${count(p.params_total)} ` +
        `params, ${count(p.params_active)} active; weights ${p.weights_dtype} ` +
        `${KV.bytes(p.weights_bytes)}${o.tp > 1 ? " per rank" : ""}`),
      KV.el("div", {}, `${d.name}: ${d.memory_gib} GiB, ${d.bandwidth_gbs} GB/s, ` +
        `${d.tflops} TFLOPS (x${o.tp}); KV ${o.kv_format} ${KV.bytes(p.kv_bytes_per_token)} ` +
        `per token; block ${o.block_size} = ${KV.bytes(p.block_bytes)}; pool ` +
        `${KV.bytes(p.pool_bytes)} = ${p.pool_blocks} blocks`),
      ...p.warnings.map((w) => KV.el("div", { className: "error-text" }, "warning: " + w)));
    table($("t-kinds"), ["layer kind", "layers", "per layer", "all layers", "window"],
      p.layer_kinds.map((r) => [r.kind, r.layers, KV.bytes(r.bytes_per_token_per_layer),
        KV.bytes(r.bytes_per_token), r.window || "-"]));
    table($("t-contexts"), ["context", "KV / request", "weights + KV", "max concurrency",
      "pool / request", "TTFT", "TPOT floor"],
      p.contexts.map((r) => [r.context, KV.bytes(r.kv_bytes_per_sequence),
        KV.bytes(p.weights_bytes + r.kv_bytes_batch), r.max_concurrency,
        r.concurrency_ratio.toFixed(2) + "x", KV.seconds(r.ttft_s), KV.seconds(r.tpot_floor_s)]));
    table($("t-formats"), ["KV format", "KV / token"].concat(p.contexts.map((r) => "@ " + r.context)),
      p.formats.map((f) => [f.kv_format === o.kv_format ? f.kv_format + " *" : f.kv_format,
        KV.bytes(f.kv_bytes_per_token)].concat(f.kv_bytes_per_sequence.map(KV.bytes))));
    $("plot").hidden = !result.plot_png;
    if (result.plot_png) $("plot").src = "data:image/png;base64," + result.plot_png;
    $("plan-out").hidden = false;
  }

  async function submit(event) {
    event.preventDefault();
    $("plan-error").textContent = "planning…";
    const body = { model: $("f-model").value, device: $("f-device").value,
                   context: $("f-context").value, kv_dtype: $("f-kv").value,
                   tp: Number($("f-tp").value) };
    try {
      show(await KV.api("/dashboard/api/plan", { method: "POST", body: JSON.stringify(body),
        headers: { "Content-Type": "application/json" } }));
      $("plan-error").textContent = "";
    } catch (err) {
      if (err instanceof KV.AuthError) { KV.refused(); return; }
      $("plan-error").textContent = err.message;
    }
  }

  async function ready() {
    try {
      const cat = await KV.api("/dashboard/api/catalogue");
      options($("f-model"), cat.models.map((m) =>
        [m.model_id, `${m.model_id} — ${m.layer_kinds}, ${KV.bytes(m.kv_bytes_per_token)}/token`]),
        "meta-llama/Llama-3.1-8B");
      options($("f-device"), cat.devices, "H100-SXM");
      options($("f-kv"), cat.kv_formats, "bf16");
      $("plan-form").onsubmit = submit;
    } catch (err) {
      if (err instanceof KV.AuthError) { KV.refused(); return; }
      $("plan-error").textContent = err.message;
    }
  }

  KV.start(ready);
})();
