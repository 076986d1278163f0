// The chat page: a conversation kept in localStorage, streamed from /v1/chat/completions.
"use strict";

const STORE = "cobatch.chat";
const SETTINGS = { system: "system", temperature: "temperature", top_p: "top-p", min_p: "min-p",
                   dry_multiplier: "dry-multiplier", xtc_probability: "xtc-probability", max_tokens: "max-tokens" };
// The settings sent as numbers with each request (left empty: the server's default)
const NUMBERS = ["temperature", "top_p", "min_p", "dry_multiplier", "xtc_probability", "max_tokens"];

const state = { messages: [], settings: {}, model: null, running: null };

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    state.messages = Array.isArray(saved.messages) ? saved.messages : [];
    state.settings = saved.settings || {};
  } catch (_) { /* a broken entry: start afresh */ }
  for (const [name, id] of Object.entries(SETTINGS)) {
    const input = document.getElementById(id);
    input.value = state.settings[name] ?? "";
    input.addEventListener("input", () => { state.settings[name] = input.value; save(); });
  }
}

function save() {
  const messages = state.messages.map(({ pending, ...kept }) => kept);
  localStorage.setItem(STORE, JSON.stringify({ messages, settings: state.settings }));
}

function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.completion_tokens != null) parts.push(stats.completion_tokens + " tokens");
  if (stats.tok_s != null) parts.push(stats.tok_s.toFixed(1) + " tok/s");
  if (stats.ttft_ms != null) parts.push("TTFT " + Math.round(stats.ttft_ms) + " ms");
  if (stats.cached_tokens != null) parts.push(stats.cached_tokens + " cached prompt tokens");
  if (stats.finish) parts.push(stats.finish);
  return parts.join(" · ");
}

function messageNode(message, index) {
  const node = cobatch.el("div", { class: "message " + message.role, "data-index": index });
  node.append(cobatch.el("div", { class: "role", text: message.role === "user" ? "You" : "Assistant" }));
  if (message.reasoning) {
    const details = cobatch.el("details", { class: "reasoning" },
                               cobatch.el("summary", { text: "Reasoning" }),
                               cobatch.el("div", { class: "reasoning-text", text: message.reasoning }));
    details.open = Boolean(message.reasoningOpen);       // folded unless its reader opened it
    details.addEventListener("toggle", () => { message.reasoningOpen = details.open; });
    node.append(details);
  }
  const content = cobatch.el("div", { class: "content" });
  if (message.role === "assistant") content.innerHTML = markdown.render(message.content || "");  // escaped inside
  else content.textContent = message.content;
  node.append(content);
  if (message.error) node.append(cobatch.el("div", { class: "error", text: message.error }));
  if (message.role === "assistant") {
    const footer = cobatch.el("div", { class: "footer" }, cobatch.el("span", { class: "stats", text: statsLine(message.stats) }));
    if (!message.pending && index === state.messages.length - 1) {
      const again = cobatch.el("button", { type: "button", class: "regenerate", text: "Regenerate" });
      again.addEventListener("click", () => regenerate());
      footer.append(again);
    }
    node.append(footer);
  }
  if (message.pending) node.classList.add("pending");
  return node;
}

function render() {
  const list = document.getElementById("messages");
  list.replaceChildren(...state.messages.map(messageNode));
  list.scrollTop = list.scrollHeight;
  const running = state.running !== null;
  document.getElementById("send").hidden = running;
  document.getElementById("stop").hidden = !running;
}

let renderQueued = false;
function renderSoon() {       // one render per frame, however many tokens arrive
  if (renderQueued) return;
  renderQueued = true;
  requestAnimationFrame(() => { renderQueued = false; render(); });
}

function requestBody(upTo) {
  const messages = [];
  const system = state.settings.system && state.settings.system.trim();
  if (system) messages.push({ role: "system", content: system });
  for (const m of state.messages.slice(0, upTo)) messages.push({ role: m.role, content: m.content });
  const body = { model: state.model || "default", messages, stream: true, stream_options: { include_usage: true } };
  for (const name of NUMBERS) {
    const value = state.settings[name];
    if (value !== undefined && value !== "") body[name] = name === "max_tokens" ? parseInt(value, 10) : parseFloat(value);
  }
  return body;
}

// Streams the answer to the messages before `index` into state.messages[index].
async function generate(index) {
  const message = state.messages[index];
  Object.assign(message, { content: "", reasoning: "", error: "", stats: null, pending: true });
  const controller = new AbortController();
  state.running = controller;
  render();
  const started = performance.now();
  let first = null;
  let usage = null;
  let finish = null;
  try {
    const response = await cobatch.apiWithKey("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody(index)), signal: controller.signal,
    });
    if (!response.ok) throw new Error(await cobatch.errorOf(response));
    await cobatch.readEvents(response, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = choice.delta || {};
        if ((delta.content || delta.reasoning_content) && first === null) first = performance.now();
        message.content += delta.content || "";
        message.reasoning += delta.reasoning_content || "";
        finish = choice.finish_reason || finish;
      }
      renderSoon();
    });
  } catch (err) {
    if (err.name === "AbortError") finish = "stopped";
    else message.error = String(err.message || err);
  }
  const ended = performance.now();
  const stats = { finish };
  if (first !== null) stats.ttft_ms = first - started;
  if (usage) {
    stats.completion_tokens = usage.completion_tokens;
    stats.cached_tokens = (usage.prompt_tokens_details || {}).cached_tokens ?? 0;
    if (first !== null && usage.completion_tokens > 1 && ended > first) {
      stats.tok_s = (usage.completion_tokens - 1) / ((ended - first) / 1000);
    }
  }
  message.stats = stats;
  message.pending = false;
  state.running = null;
  save();
  render();
}

function send(text) {
  if (state.running || !text.trim()) return;
  state.messages.push({ role: "user", content: text });
  state.messages.push({ role: "assistant", content: "" });
  save();
  generate(state.messages.length - 1);
}

function regenerate() {
  const last = state.messages.length - 1;
  if (state.running || last < 0 || state.messages[last].role !== "assistant") return;
  generate(last);
}

async function findModel() {
  const label = document.getElementById("model");
  try {
    const response = await cobatch.apiWithKey("/v1/models");
    if (!response.ok) throw new Error(await cobatch.errorOf(response));
    const models = (await response.json()).data || [];
    state.model = models.length ? models[0].id : null;
    label.textContent = state.model || "no model";
    label.classList.remove("muted");
    // Several served names (aliases, LoRA adapters): the next answers come from the one chosen.
    const choice = document.getElementById("model-choice");
    choice.replaceChildren(...models.map((m) => new Option(m.parent ? `${m.id} (adapter)` : m.id, m.id)));
    choice.hidden = models.length < 2;
    choice.onchange = () => { state.model = choice.value; label.textContent = state.model; };
  } catch (err) {
    label.textContent = "cannot reach the server: " + (err.message || err);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  load();
  render();
  const input = document.getElementById("input");
  document.getElementById("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value;
    if (state.running || !text.trim()) return;
    input.value = "";
    send(text);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      document.getElementById("composer").requestSubmit();
    }
  });
  document.getElementById("stop").addEventListener("click", () => state.running && state.running.abort());
  document.getElementById("new-chat").addEventListener("click", () => {
    if (state.running) state.running.abort();
    state.messages = [];
    save();
    render();
  });
  findModel();
});
