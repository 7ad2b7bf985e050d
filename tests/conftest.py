import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the tests that need a real model run the embedded SmolLM2 (98 MB, in the environment after `make install`): the
# default model is a 1.1 GB download that `make run` makes, not `make test` (docs/testing.md)
os.environ.setdefault("RAGBLEND_MODEL__NAME", "smollm2")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="run the engine tests' tiny models on this device (cuda: bf16, looser tolerances)")


def pytest_configure(config):
    # read by tests/engine_models.py; an env var so helper modules outside fixtures see it too
    os.environ["RAGBLEND_TEST_DEVICE"] = config.getoption("--device")


@pytest.fixture(params=["native", "torch"])
def decode_kernel(request, monkeypatch) -> str:
    """Each decode kernel of the quantized layers in turn: ragblend's (skipped where it cannot be built:
    tests/test_native_kernels.py says why) and torch's. Layers made in the test take it."""
    from blend_engine import native

    monkeypatch.setattr(native, "_enabled", [request.param == "native"])
    if request.param == "native" and native.int4_mm() is None:
        pytest.skip(f"ragblend's decode kernels are not built here: {native.unavailable_reason()}")
    return request.param


@pytest.fixture(scope="session")
def postgres():
    """One temporary Postgres cluster for the session (skipped, saying why, only where no Postgres
    binary exists); tests take a fresh database from it (`postgres.new_database()`)."""
    try:
        from tests.postgres_server import start_or_skip
    except ImportError:  # run from inside tests/
        from postgres_server import start_or_skip
    server = start_or_skip()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=["sqlite", "postgres"])
def store_kind(request) -> str:
    """The document store's backend: each test that asks for it runs on both."""
    return request.param


@pytest.fixture
def open_store(store_kind, tmp_path, request):
    """A callable opening the test's document store (the same one each call: reopening after a
    "crash" sees what was committed), of `store_kind`; every store it opened is closed after."""
    from retrieval.doc_store import SqliteDocumentStore
    from retrieval.pg_store import PostgresDocumentStore

    opened = []
    if store_kind == "sqlite":
        path = tmp_path / "documents.sqlite3"
        make = lambda: SqliteDocumentStore(path)  # noqa: E731
    else:
        url = request.getfixturevalue("postgres").new_database()
        make = lambda: PostgresDocumentStore(url)  # noqa: E731

    def open_():
        store = make()
        opened.append(store)
        return store

    yield open_
    for store in opened:
        store.close()


@pytest.fixture(scope="module", autouse=True)
def _model_from_yaml(request):
    """A module whose servers take their model from a YAML config (`MODEL_FROM_YAML = True`): the environment's
    RAGBLEND_MODEL__NAME (set above for every other test) would win over the file, so it is unset for them."""
    if not getattr(request.module, "MODEL_FROM_YAML", False):
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAGBLEND_MODEL__NAME", raising=False)
        yield
