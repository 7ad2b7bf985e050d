import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="run the engine tests' tiny models on this device (cuda: bf16, looser tolerances)")


def pytest_configure(config):
    # read by tests/engine_models.py; an env var so helper modules outside fixtures see it too
    os.environ["RAGBLEND_TEST_DEVICE"] = config.getoption("--device")


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
