// What both pages share: the API key (asked for on a 401, kept in localStorage), fetch with it, and a reader of
// server-sent events over fetch (EventSource cannot send the key).
"use strict";

const KEY_STORAGE = "cobatch.apiKey";

const cobatch = {
  keyAsked: null,       // the key form's pending answer, while it is shown

  apiKey() {
    return localStorage.getItem(KEY_STORAGE) || "";
  },

  async api(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    const key = cobatch.apiKey();
    if (key) headers["Authorization"] = "Bearer " + key;
    return fetch(path, Object.assign({}, options, { headers }));
  },

  // The error message of a non-2xx answer (OpenAI's shape), or its status line.
  async errorOf(response) {
    try {
      const body = await response.json();
      if (body && body.error) return body.error.message || String(body.error);
    } catch (_) { /* not JSON */ }
    return response.status + " " + response.statusText;
  },

  // Calls onEvent(parsed JSON) for each `data:` line of an SSE body until it ends or `[DONE]`.
  async readEvents(response, onEvent) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of frame.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") return;
          onEvent(JSON.parse(data));
        }
      }
    }
  },

  // Shows the key form with `message`; resolves once a key is entered (and stored). Callers that ask while the
  // form is up share its answer.
  askForKey(message) {
    const form = document.getElementById("key-form");
    form.querySelector(".key-message").textContent = message;
    if (cobatch.keyAsked) return cobatch.keyAsked;
    const input = form.querySelector("input");
    form.hidden = false;
    input.value = "";
    input.focus();
    cobatch.keyAsked = new Promise((resolve) => {
      form.onsubmit = (event) => {
        event.preventDefault();
        const key = input.value.trim();
        if (!key) return;
        localStorage.setItem(KEY_STORAGE, key);
        form.hidden = true;
        cobatch.keyAsked = null;
        resolve(key);
      };
    });
    return cobatch.keyAsked;
  },

  // fetch that asks for the key again on a 401, until the server takes it.
  async apiWithKey(path, options = {}) {
    for (;;) {
      const response = await cobatch.api(path, options);
      if (response.status !== 401) return response;
      const why = cobatch.apiKey() ? "The server refused this API key (" + (await cobatch.errorOf(response)) + ")."
                                   : "This server needs an API key.";
      await cobatch.askForKey(why);
    }
  },

  el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (name === "text") node.textContent = value;
      else if (name === "class") node.className = value;
      else node.setAttribute(name, value);
    }
    for (const child of children) node.append(child);
    return node;
  },
};
