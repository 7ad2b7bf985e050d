// Knowledge bases (collections): pick one (kept in this tab's session storage) or create one. The
// documents panel, uploads and questions all work on the chosen one; a key that may only read it gets
// no upload or delete controls (and the server would refuse them: 403).
"use strict";

const KB_STORAGE = "ragblend.collection";

const kb = {
  all: [],

  current() { return sessionStorage.getItem(KB_STORAGE) || ""; },
  chosen() { return kb.all.find((c) => c.name === kb.current()) || null; },
  canWrite() { const c = kb.chosen(); return !!c && c.access !== "read"; },
  // the chosen one as a query string parameter, for the documents API
  param(prefix = "?") { return kb.current() ? `${prefix}collection=${encodeURIComponent(kb.current())}` : ""; },

  async refresh() {
    try {
      kb.all = (await api.json("/v1/collections")).collections;
    } catch (err) { showError(err); return; }
    if (!kb.chosen()) {
      const pick = kb.all.find((c) => c.name === "default") || kb.all[0];
      sessionStorage.setItem(KB_STORAGE, pick ? pick.name : "");
    }
    kb.render();
  },

  render() {
    const select = document.getElementById("kb-select");
    select.replaceChildren(...kb.all.map((c) => el("option", { value: c.name, textContent: c.name })));
    select.value = kb.current();
    const c = kb.chosen();
    document.getElementById("kb-info").textContent = c
      ? `${c.num_documents} documents · ${c.num_chunks} chunks · KV ${docs.bytes(c.kv_bytes)} · ${c.access}`
        + (c.description ? ` · ${c.description}` : "")
      : "no knowledge base this key may use";
    const writable = kb.canWrite();
    document.getElementById("read-only").hidden = writable || !c;
    document.getElementById("dropzone").classList.toggle("disabled", !writable);
    document.getElementById("file-input").disabled = !writable;
  },

  async choose(name) {
    sessionStorage.setItem(KB_STORAGE, name);
    docs.details.clear();
    kb.render();
    await docs.refresh();
  },

  async create(name) {
    try {
      await api.json("/v1/collections", {
        method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify({ name }),
      });
      await kb.refresh();
      await kb.choose(name);
    } catch (err) { showError(err); }
  },

  install() {
    document.getElementById("kb-select").addEventListener("change", (e) => kb.choose(e.target.value));
    document.getElementById("kb-new").addEventListener("click", () => {
      document.getElementById("kb-name").value = "";
      document.getElementById("kb-dialog").showModal();
    });
    document.getElementById("kb-form").addEventListener("submit", (e) => {
      if (e.submitter && e.submitter.value === "cancel") return;
      const name = document.getElementById("kb-name").value.trim();
      if (name) kb.create(name);
    });
  },
};
