"""`ragblend bench llamacpp` without llama-cpp-python: refused at once, naming the extra that installs it."""

import argparse
import sys

from bench.engine import llamacpp


def test_without_llama_cpp_the_bench_names_the_extra_that_installs_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it raises ImportError
    parser = argparse.ArgumentParser()
    llamacpp.add_arguments(parser)
    assert llamacpp.run(parser.parse_args([])) == 2
    assert "pip install -e '.[llamacpp]'" in capsys.readouterr().err
