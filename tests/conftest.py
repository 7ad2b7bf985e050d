import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu", choices=["cpu", "cuda"],
                     help="run the engine tests' tiny models on this device (cuda: bf16, looser tolerances)")


def pytest_configure(config):
    # read by tests/engine_models.py; an env var so helper modules outside fixtures see it too
    os.environ["RAGBLEND_TEST_DEVICE"] = config.getoption("--device")
