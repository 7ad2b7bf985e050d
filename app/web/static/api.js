// API access for the chat page: the key (session storage), errors as readable text, SSE over fetch.
"use strict";

const KEY_STORAGE = "ragblend.apiKey";

const api = {
  key() { return sessionStorage.getItem(KEY_STORAGE) || ""; },
  setKey(value) { sessionStorage.setItem(KEY_STORAGE, value.trim()); },
  headers(extra = {}) {
    const key = api.key();
    return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
  },
  onAuthError: () => {},

  // fetch with the key; a non-2xx answer throws an ApiError built from the server's error body.
  async request(path, options = {}) {
    let response;
    try {
      response = await fetch(path, { ...options, headers: api.headers(options.headers || {}) });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, "network", "cannot reach the server: is it running?");
    }
    if (!response.ok) throw await ApiError.from(response);
    return response;
  },
  async json(path, options = {}) { return (await api.request(path, options)).json(); },
};

class ApiError extends Error {
  constructor(status, type, message, retryAfter = null) {
    super(message);
    this.status = status; this.type = type; this.retryAfter = retryAfter;
  }

  static async from(response) {
    let type = "error", message = response.statusText;
    try {
      const body = await response.json();
      if (body && body.error) ({ type, message } = body.error);
    } catch (_) { /* not JSON */ }
    const retryAfter = response.headers.get("Retry-After");
    const error = new ApiError(response.status, type, message, retryAfter);
    if (response.status === 401) api.onAuthError(error);
    return error;
  }

  // What the user reads: the status explained, then the server's own message.
  describe() {
    if (this.status === 401) return "Wrong or missing API key (401): set the key with the “API key” button.";
    if (this.status === 413) return `Too large (413): ${this.message}`;
    if (this.status === 503 && this.type === "not_ready") return `Server not ready (503): ${this.message}`;
    if (this.status === 503) {
      const wait = this.retryAfter ? ` Retry in ${this.retryAfter} s.` : "";
      return `Server busy (503): ${this.message}.${wait}`;
    }
    if (this.status === 0) return this.message;
    return `Error ${this.status}: ${this.message}`;
  }
}

// Reads an SSE response body, calling onEvent({event, data}) for each event; resolves at the end.
async function readSse(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const event = { event: "message", data: "" };
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event.event = line.slice(6).trim();
        else if (line.startsWith("data:")) event.data += line.slice(5).trimStart();
      }
      if (event.data) onEvent(event);
    }
  }
}

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  Object.assign(node, props);
  for (const child of children) node.append(child);
  return node;
}
