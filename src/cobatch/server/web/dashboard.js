// The dashboard: /v1/events' snapshots (every 250 ms) drawn as slots, batching figures, KV use and three charts.
"use strict";

const WINDOW_MS = 60000;
const series = { step: [], toks: [], rows: [] };

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function percent(fraction) {
  return fraction == null ? "–" : (100 * fraction).toFixed(fraction < 0.1 ? 1 : 0) + " %";
}

function slotNode(slot) {
  const node = cobatch.el("div", { class: "slot", "data-state": slot.state, "data-slot": slot.id });
  node.append(cobatch.el("div", { class: "slot-head" }, cobatch.el("b", { text: "slot " + slot.id }),
                         cobatch.el("span", { class: "slot-state", text: slot.state })));
  let detail = "served " + (slot.requests_served || 0);
  if (slot.state === "prefilling" || slot.state === "waiting") {
    const bar = cobatch.el("div", { class: "progress" }, cobatch.el("span"));
    bar.firstChild.style.width = (100 * (slot.prefill_progress || 0)).toFixed(1) + "%";
    node.append(bar);
    detail = slot.computed_tokens + " / " + slot.prompt_tokens + " prompt tokens";
    if (slot.cached_prefix_tokens) detail += " (" + slot.cached_prefix_tokens + " cached)";
  } else if (slot.state === "decoding") {
    detail = slot.generated_tokens + " tokens" + (slot.tok_s != null ? " · " + slot.tok_s.toFixed(1) + " tok/s" : "");
  }
  node.append(cobatch.el("div", { class: "slot-detail", text: detail }));
  return node;
}

function push(name, at, value) {
  const points = series[name];
  points.push([at, value]);
  while (points.length && at - points[0][0] > WINDOW_MS) points.shift();
}

// A line over the last minute; a null value (no step in that interval) breaks the line.
function drawChart(canvas, points, color, digits) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const styles = getComputedStyle(document.body);
  const values = points.map((p) => p[1]).filter((v) => v != null);
  const top = Math.max(1e-9, ...values) * 1.15;
  const left = 44, bottom = height - 18, now = performance.now();
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = styles.getPropertyValue("--muted");
  g.strokeStyle = styles.getPropertyValue("--grid");
  g.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = bottom - (bottom - 6) * i / 2;
    g.beginPath(); g.moveTo(left, y); g.lineTo(width, y); g.stroke();
    g.fillText(values.length ? (top * i / 2).toFixed(digits) : "", 2, y + 4);
  }
  g.fillText("-60 s", left, height - 4);
  g.fillText("now", width - 24, height - 4);
  const x = (at) => left + (width - left) * (1 - (now - at) / WINDOW_MS);
  const y = (v) => bottom - (bottom - 6) * v / top;
  g.strokeStyle = color;
  g.lineWidth = 2;
  g.fillStyle = color;
  g.beginPath();
  let drawing = false;
  points.forEach(([at, v], i) => {
    if (v == null) { drawing = false; return; }
    if (drawing) g.lineTo(x(at), y(v)); else g.moveTo(x(at), y(v));
    const next = points[i + 1];
    if (!drawing && (!next || next[1] == null)) g.fillRect(x(at) - 1.5, y(v) - 1.5, 3, 3);   // a lone point
    drawing = true;
  });
  g.stroke();
  const last = values.length ? values[values.length - 1] : null;
  canvas.dataset.last = last == null ? "" : String(last);
  canvas.dataset.points = String(values.length);
  canvas.title = last == null ? "idle" : "latest: " + last.toFixed(digits);
}

function show(snapshot) {
  text("model", snapshot.model);
  document.getElementById("slots").replaceChildren(...snapshot.slots.map(slotNode));
  text("queue-depth", snapshot.queue.depth);
  text("queue-max", snapshot.queue.max);
  text("rejected", snapshot.queue.rejected_429);

  const minute = snapshot.last_minute;
  text("window", "last " + Math.round(minute.seconds) + " s");
  const rows = document.getElementById("rows-per-step");
  rows.textContent = minute.rows_per_step == null ? "–" : minute.rows_per_step.toFixed(2);
  rows.dataset.value = minute.rows_per_step ?? "";
  const batched = document.getElementById("batched-fraction");
  batched.textContent = percent(minute.batched_fraction);
  batched.dataset.value = minute.batched_fraction ?? "";
  for (const cause of Object.keys(minute.lone_decode)) {
    text(`lone-${cause}-minute`, minute.lone_decode[cause]);
    text(`lone-${cause}-total`, snapshot.totals.lone_decode[cause]);
  }

  const kv = snapshot.kv_blocks;
  const bar = document.getElementById("kv-bar");
  bar.querySelector(".kv-used").style.width = (100 * kv.used / kv.total) + "%";
  bar.querySelector(".kv-cached").style.width = (100 * kv.cached / kv.total) + "%";
  text("kv-used", kv.used);
  text("kv-cached", kv.cached);
  text("kv-free", kv.free - kv.cached);
  text("kv-total", kv.total);
  text("kv-block-size", kv.block_size);
  const cache = snapshot.prefix_cache;
  text("prefix-hits", cache.hit_tokens);
  text("prompt-tokens", cache.prompt_tokens);
  text("prefix-fraction", percent(cache.hit_fraction));

  const at = performance.now();
  const recent = snapshot.recent;
  push("step", at, recent.step_ms);
  push("toks", at, recent.steps ? recent.tok_s : null);
  push("rows", at, recent.rows_per_step);
  drawCharts();
}

function drawCharts() {
  const styles = getComputedStyle(document.body);
  drawChart(document.getElementById("chart-step"), series.step, styles.getPropertyValue("--accent"), 1);
  drawChart(document.getElementById("chart-toks"), series.toks, styles.getPropertyValue("--good"), 0);
  drawChart(document.getElementById("chart-rows"), series.rows, styles.getPropertyValue("--warn"), 1);
}

function status(state, label) {
  const node = document.getElementById("status");
  node.dataset.state = state;
  node.textContent = label;
}

async function follow() {
  for (;;) {
    try {
      const response = await cobatch.apiWithKey("/v1/events");
      if (!response.ok) throw new Error(await cobatch.errorOf(response));
      status("live", "live");
      await cobatch.readEvents(response, show);
      status("down", "the stream ended; reconnecting…");
    } catch (err) {
      status("down", "disconnected (" + (err.message || err) + "); reconnecting…");
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));      // a retry's pace, not a synchronisation
  }
}

document.addEventListener("DOMContentLoaded", () => {
  window.addEventListener("resize", drawCharts);
  follow();
});
