// The conversation: streams answers from /v1/chat/completions (SSE), keeps the history for
// follow-ups, shows numbered sources, turns each [n] of the answer that names one (the last chunk's
// `citations`) into a link to it, and shows each answer's TTFT, reuse and mode. Esc aborts the
// fetch, and the server cancels the generation when the connection closes.
"use strict";

// [n] or [n, m] as the server reads them (app/rag/citations.py): not an index after a name (argv[1])
const CITATION = /(?<![A-Za-z_])\[\s*(\d{1,4}(?:\s*[,;]\s*\d{1,4})*)\s*\]/g;

const MAX_HISTORY_MESSAGES = 6; // earlier turns sent with a question (the model's context is small)
const chat = { history: [], controller: null };

function showError(err) {
  const box = document.getElementById("error");
  box.textContent = err instanceof ApiError ? err.describe() : String(err.message || err);
  box.hidden = false;
}

function clearError() { document.getElementById("error").hidden = true; }

function options() {
  const number = (id) => { const v = document.getElementById(id).value; return v === "" ? undefined : Number(v); };
  const body = { top_k: number("top-k"), max_tokens: number("max-tokens"), temperature: number("temperature") };
  const mode = document.getElementById("mode").value;
  if (mode) body.mode = mode;
  if (kb.current()) body.collection = kb.current();
  const kind = document.getElementById("ratio-kind").value;
  if (kind === "number") body.recompute_ratio = number("ratio");
  else if (kind) body.recompute_ratio = kind;
  return body;
}

function addMessage(role, text) {
  const box = el("div", { className: `msg ${role}` }, el("div", { className: "answer", textContent: text }));
  document.getElementById("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

async function ask(question) {
  clearError();
  addMessage("user", question);
  const box = addMessage("assistant", "");
  const answer = box.querySelector(".answer");
  answer.classList.add("streaming");
  const messages = [...chat.history.slice(-MAX_HISTORY_MESSAGES), { role: "user", content: question }];
  const controller = new AbortController();
  chat.controller = controller;
  setStreaming(true);
  const started = performance.now();
  let firstTokenMs = null, text = "", last = null, sources = [];
  try {
    const response = await api.request("/v1/chat/completions", {
      method: "POST", signal: controller.signal, headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ messages, stream: true, ...options() }),
    });
    await readSse(response, ({ data }) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ApiError(500, chunk.error.type, chunk.error.message);
      if (chunk.sources) { sources = chunk.sources; renderCitations(box, sources); }
      if (chunk.warnings && chunk.warnings.length) box.append(el("div", { className: "note", textContent: chunk.warnings.join(" ") }));
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
      if (delta) {
        if (firstTokenMs === null) firstTokenMs = performance.now() - started;
        text += delta;
        answer.textContent = text;
        box.scrollIntoView({ block: "end" });
      }
      if (chunk.usage) last = chunk;
      if (chunk.citations) renderCited(box, answer, text, sources, chunk.citations, chunk.unsupported || []);
    });
    chat.history.push({ role: "user", content: question }, { role: "assistant", content: text });
    renderStats(box, firstTokenMs, performance.now() - started, last);
  } catch (err) {
    if (err.name === "AbortError") {
      answer.textContent = text;
      box.append(el("div", { className: "note stopped", textContent: "Stopped (Esc): the server cancelled the generation." }));
    } else {
      box.append(el("div", { className: "note", textContent: err instanceof ApiError ? err.describe() : String(err) }));
      showError(err);
    }
  } finally {
    answer.classList.remove("streaming");
    chat.controller = null;
    setStreaming(false);
  }
}

// The answer's text with each [n] the server mapped to a source (`citations`) as a link to it; a number
// naming no source stays plain text. The sources the answer cites are marked in the sources row.
function renderCited(box, answer, text, sources, citations, unsupported) {
  const cited = new Set(citations.map((c) => c.number).filter((n) => n >= 1 && n <= sources.length));
  const open = (n) => { const s = sources[n - 1]; docs.open(s.document_id, s.chunk_id, s.text); };
  const nodes = [];
  let end = 0;
  for (const match of text.matchAll(CITATION)) {
    nodes.push(...marked(text.slice(end, match.index), unsupported));
    end = match.index + match[0].length;
    const numbers = match[1].split(/[,;]/).map((part) => Number(part.trim()));
    if (!numbers.some((n) => cited.has(n))) { nodes.push(match[0]); continue; }  // a citation: never marked
    nodes.push("[");
    numbers.forEach((n, i) => {
      if (i) nodes.push(", ");
      if (!cited.has(n)) { nodes.push(String(n)); return; }
      const s = sources[n - 1];
      nodes.push(el("a", { href: "#", className: "cite", textContent: String(n), title: s.title || s.document_id,
        onclick: (e) => { e.preventDefault(); open(n); } }));
    });
    nodes.push("]");
  }
  answer.replaceChildren(...nodes, ...marked(text.slice(end), unsupported));
  box.querySelectorAll(".citation").forEach((chip, i) => chip.classList.toggle("cited", cited.has(i + 1)));
}

// The answer's terms no source holds (the server's `unsupported`), marked where they stand as whole
// words, any case, as the server looked them up: the warning under the answer names them too
function marked(text, terms) {
  if (!terms.length || !text) return [text];
  const escaped = terms.map((t) => t.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).sort((a, b) => b.length - a.length);
  const pattern = new RegExp(`(?<![\\p{L}\\p{N}])(?:${escaped.join("|")})(?![\\p{L}\\p{N}])`, "giu");
  const nodes = [];
  let end = 0;
  for (const match of text.matchAll(pattern)) {
    nodes.push(text.slice(end, match.index),
      el("mark", { className: "unsupported", textContent: match[0], title: "no source contains this: it may be made up" }));
    end = match.index + match[0].length;
  }
  nodes.push(text.slice(end));
  return nodes;
}

async function renderCitations(box, sources) {
  const row = el("div", { className: "citations" });
  box.append(row);
  for (const [i, source] of sources.entries()) {
    const chip = el("button", { type: "button", className: "citation", textContent: `[${i + 1}] ${source.title || source.document_id}`,
      title: source.text.slice(0, 300),
      onclick: () => docs.open(source.document_id, source.chunk_id, source.text, source.collection) });
    row.append(chip);
    docs.detail(source.document_id, source.collection).then((detail) => {
      const page = docs.pageOf(detail, source.chunk_id);
      if (page) chip.textContent += `, p. ${page}`;
    }).catch(() => {});
  }
}

function renderStats(box, firstTokenMs, totalMs, last) {
  if (!last) return;
  const u = last.usage, t = last.timings || {};
  const ratio = last.recompute_ratio === null || last.recompute_ratio === undefined ? "–" : last.recompute_ratio.toFixed(2);
  // tokens served from the prefix cache (an earlier turn's prompt) are reused too, shown apart
  const cached = u.prefix_cached_tokens || 0;
  const parts = [
    `TTFT ${Math.round(firstTokenMs ?? totalMs)} ms (server ${Math.round(t.ttft_ms || 0)} ms)`,
    `reused ${u.reused_tokens + cached}${cached ? ` (${cached} from an earlier prompt)` : ""} / ` +
      `recomputed ${u.recomputed_tokens} of ${u.prompt_tokens} prompt tokens`,
    `mode ${last.mode || document.getElementById("mode").value || "default"}`,
    `ratio ${ratio}${last.quality_guarded ? " (guarded)" : ""}`,
    `${u.completion_tokens} tokens in ${(totalMs / 1000).toFixed(1)} s`,
  ];
  box.append(el("div", { className: "stats" }, ...parts.map((p) => el("span", { textContent: p }))));
}

function setStreaming(on) {
  document.getElementById("send").hidden = on;
  document.getElementById("stop").hidden = !on;
}

function stop() { if (chat.controller) chat.controller.abort(); }

async function checkServer() {
  const status = document.getElementById("server-status");
  for (;;) {
    try {
      const response = await fetch("/readyz");
      const body = await response.json();
      if (response.ok) break;
      status.textContent = body.status === "failed" ? `server failed to start: ${body.error}` : "server loading the model…";
      status.classList.add("bad");
      if (body.status === "failed") return;
    } catch (_) {
      status.textContent = "server unreachable"; status.classList.add("bad");
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
  try {
    const models = await api.json("/v1/models");
    status.textContent = `ready · ${models.data[0].id}`;
    status.classList.remove("bad");
    await kb.refresh();
    await docs.refresh();
  } catch (err) { showError(err); }
}

function askKey() {
  const dialog = document.getElementById("key-dialog");
  if (!dialog.open) {
    document.getElementById("key-input").value = api.key();
    dialog.showModal();
  }
}

function install() {
  api.onAuthError = askKey;
  const question = document.getElementById("question");
  document.getElementById("ask-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = question.value.trim();
    if (!text || chat.controller) return;
    question.value = "";
    ask(text);
  });
  question.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      document.getElementById("ask-form").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => { if (e.key === "Escape" && chat.controller) { e.preventDefault(); stop(); } });
  document.getElementById("stop").addEventListener("click", stop);
  document.getElementById("new-chat").addEventListener("click", () => {
    chat.history = [];
    document.getElementById("messages").replaceChildren();
  });
  document.getElementById("key-button").addEventListener("click", askKey);
  document.getElementById("key-form").addEventListener("submit", () => {
    api.setKey(document.getElementById("key-input").value);
    clearError();
    checkServer();
  });
  kb.install();
  docs.install();
  checkServer();
}

install();
