// The documents panel, of the chosen knowledge base (collections.js): upload (drop or picker), list,
// search by title, open, delete. Also the viewer that citations open (chunk text, its page for PDFs,
// the whole document).
"use strict";

const docs = {
  all: [],
  details: new Map(), // "collection/document id" -> GET /v1/documents/{id}, for citations' pages

  async refresh() {
    if (!kb.current()) { docs.all = []; docs.kv = null; docs.render(); return; }
    try {
      const body = await api.json(`/v1/documents?limit=1000${kb.param("&")}`);
      docs.all = body.documents;
      docs.kv = body.kv;
      docs.render();
    } catch (err) { showError(err); }
  },

  render() {
    const query = document.getElementById("doc-search").value.trim().toLowerCase();
    const list = document.getElementById("doc-list");
    list.replaceChildren();
    for (const doc of docs.all) {
      const title = doc.title || doc.id;
      if (query && !title.toLowerCase().includes(query) && !doc.id.toLowerCase().includes(query)) continue;
      const item = el("li", {},
        el("span", { className: "title", title: `${title} (${doc.id})`, textContent: title, onclick: () => docs.open(doc.id) }),
        el("span", { className: "meta", textContent: `${doc.num_chunks} ch`,
          title: `KV: ${docs.bytes(doc.kv_bytes)}, ${Math.round(100 * doc.kv_cached_share)}% of its chunks cached` }),
        el("span", { className: "meta kv-share", textContent: `KV ${Math.round(100 * doc.kv_cached_share)}%` }),
        el("button", { type: "button", textContent: "Delete", className: "delete", hidden: !kb.canWrite(),
          onclick: () => docs.remove(doc) }));
      item.dataset.id = doc.id;
      list.append(item);
    }
    const summary = document.getElementById("doc-kv");
    const kv = docs.kv;
    summary.hidden = !kv;
    if (kv) {
      const budget = kv.budget_bytes ? ` of a ${docs.bytes(kv.budget_bytes)} budget` : "";
      summary.textContent = `KV cached ${docs.bytes(kv.cached_bytes)}${budget}; all documents would need ~${docs.bytes(kv.estimated_full_bytes)}`;
    }
    const chosen = kb.chosen();
    if (chosen && chosen.num_documents !== docs.all.length) { // keep the picker's counts in step
      chosen.num_documents = docs.all.length;
      kb.render();
    }
  },

  bytes(n) {
    if (n >= 1e9) return `${(n / 1e9).toFixed(1)} GB`;
    if (n >= 1e6) return `${(n / 1e6).toFixed(1)} MB`;
    return `${Math.round(n / 1e3)} kB`;
  },

  async detail(id, collection = kb.current()) {
    const key = `${collection}/${id}`;
    if (!docs.details.has(key)) {
      docs.details.set(key, api.json(`/v1/documents/${encodeURIComponent(id)}?collection=${encodeURIComponent(collection)}`));
    }
    try { return await docs.details.get(key); } catch (err) { docs.details.delete(key); throw err; }
  },

  // The 1-based PDF page (or "first–last" pages) a chunk is on, or null (other formats, or an older document).
  pageOf(detail, chunkId) {
    const pages = detail && detail.metadata && detail.metadata.chunk_pages;
    const lasts = detail && detail.metadata && detail.metadata.chunk_last_pages;
    const position = Number(chunkId.slice(chunkId.lastIndexOf("#") + 1));
    if (!Array.isArray(pages) || !Number.isInteger(pages[position])) return null;
    const last = Array.isArray(lasts) && Number.isInteger(lasts[position]) ? lasts[position] : pages[position];
    return last > pages[position] ? `${pages[position]}–${last}` : pages[position];
  },

  async open(id, chunkId = null, chunkText = null, collection = kb.current()) {
    try {
      const detail = await docs.detail(id, collection);
      const page = chunkId ? docs.pageOf(detail, chunkId) : null;
      document.getElementById("viewer-title").textContent = detail.title || detail.id;
      const where = [`document ${detail.id}`, detail.metadata.format, detail.metadata.num_pages && `${detail.metadata.num_pages} pages`,
        chunkId && `chunk ${chunkId}`, page && `page ${page}`].filter(Boolean).join(" · ");
      document.getElementById("viewer-meta").textContent = where;
      const chunk = document.getElementById("viewer-chunk");
      chunk.textContent = chunkText || "";
      chunk.hidden = !chunkText;
      const whole = document.getElementById("viewer-doc-text");
      whole.replaceChildren(...detail.chunks.map((c) => el("p", {
        className: c.id === chunkId ? "hit" : "", textContent: c.text,
        title: `${c.id}${docs.pageOf(detail, c.id) ? ` · page ${docs.pageOf(detail, c.id)}` : ""}` })));
      document.getElementById("viewer-doc").open = !chunkText;
      document.getElementById("viewer").showModal();
    } catch (err) { showError(err); }
  },

  async remove(doc) {
    if (!confirm(`Delete “${doc.title || doc.id}”? Its chunks and their KV cache go too.`)) return;
    try {
      await api.request(`/v1/documents/${encodeURIComponent(doc.id)}${kb.param()}`, { method: "DELETE" });
      docs.details.delete(`${doc.collection}/${doc.id}`);
      await docs.refresh();
    } catch (err) { showError(err); }
  },

  // One request per file (XMLHttpRequest: fetch has no upload progress), so one bad file fails alone.
  upload(files) {
    for (const file of files) docs.uploadOne(file);
  },

  uploadOne(file) {
    const line = el("li", { textContent: `${file.name}: uploading…` });
    document.getElementById("uploads").prepend(line);
    if (!kb.canWrite()) {
      docs.uploadFailed(line, file, new ApiError(403, "permission_error",
        `this key may not upload into ${kb.current() || "any knowledge base"}`));
      return;
    }
    const form = new FormData();
    form.append("files", file, file.name);
    form.append("collection", kb.current());
    const xhr = new XMLHttpRequest();
    xhr.open("POST", "/v1/documents/files");
    for (const [name, value] of Object.entries(api.headers())) xhr.setRequestHeader(name, value);
    xhr.upload.onprogress = (e) => {
      if (!e.lengthComputable) return;
      const share = Math.round((100 * e.loaded) / e.total);
      line.textContent = share < 100 ? `${file.name}: uploading ${share}%` : `${file.name}: extracting, chunking, precomputing KV…`;
    };
    xhr.onerror = () => docs.uploadFailed(line, file, new ApiError(0, "network", "upload failed: connection lost (too large?)"));
    xhr.onload = () => {
      if (xhr.status === 201) {
        const body = JSON.parse(xhr.responseText);
        const chunks = body.documents.reduce((n, d) => n + d.chunks.length, 0);
        const cached = body.documents.reduce((n, d) => n + d.chunks.filter((c) => c.kv_cached).length, 0);
        line.textContent = `${file.name}: ingested, ${chunks} chunk${chunks === 1 ? "" : "s"} (${cached} with KV cached)`;
        line.className = "done";
        body.documents.forEach((d) => docs.details.delete(`${d.collection}/${d.id}`));
        const pending = body.documents.filter((d) => d.kv_pending).map((d) => d.id);
        if (pending.length) docs.watchKV(line, file.name, pending, chunks);
        docs.refresh();
        return;
      }
      let error = new ApiError(xhr.status, "error", xhr.statusText);
      try {
        const e = JSON.parse(xhr.responseText).error;
        error = new ApiError(xhr.status, e.type, e.message, xhr.getResponseHeader("Retry-After"));
      } catch (_) { /* not JSON */ }
      if (xhr.status === 401) api.onAuthError(error);
      docs.uploadFailed(line, file, error);
    };
    xhr.send(form);
  },

  // A large document's KV is computed in the background, between questions: show it filling in.
  async watchKV(line, name, ids, numChunks) {
    line.className = "pending";
    for (;;) {
      await new Promise((resolve) => setTimeout(resolve, 2000));
      let cached = 0;
      try {
        for (const id of ids) {
          const detail = await api.json(`/v1/documents/${encodeURIComponent(id)}${kb.param()}`);
          cached += detail.chunks.filter((c) => c.kv_cached).length;
        }
      } catch (err) { return; } // deleted meanwhile, or the server went away: stop watching
      line.textContent = `${name}: ingested, ${numChunks} chunks; KV cached ${cached}/${numChunks}` +
        (cached < numChunks ? " (computing between questions…)" : "");
      if (cached >= numChunks) { line.className = "done"; return; }
    }
  },

  uploadFailed(line, file, error) {
    line.textContent = `${file.name}: failed. ${error.describe()}`;
    line.className = "failed";
  },

  install() {
    const zone = document.getElementById("dropzone");
    zone.addEventListener("dragover", (e) => { e.preventDefault(); zone.classList.add("over"); });
    zone.addEventListener("dragleave", () => zone.classList.remove("over"));
    zone.addEventListener("drop", (e) => {
      e.preventDefault();
      zone.classList.remove("over");
      docs.upload(e.dataTransfer.files);
    });
    const input = document.getElementById("file-input");
    input.addEventListener("change", () => { docs.upload(input.files); input.value = ""; });
    document.getElementById("doc-search").addEventListener("input", docs.render);
  },
};
