"""A catalogue model's fitted blend settings (its probe layer) are the server's defaults when it runs, beneath
every setting a user gives: YAML, env, flags; any other model keeps BlendConfig's own."""

from __future__ import annotations

from pathlib import Path

import pytest

from blend_engine.catalogue import CATALOGUE, catalogue_model, fitted_blend
from blend_engine.config import BlendConfig
from configs.settings import load_settings

FITTED = [m for m in CATALOGUE.values() if m.fitted_probe_layer is not None]


@pytest.fixture(autouse=True)
def _no_user_env(monkeypatch):
    for name in ("RAGBLEND_MODEL__NAME", "RAGBLEND_BLEND__PROBE_LAYER", "RAGBLEND_BLEND__RECOMPUTE_RATIO"):
        monkeypatch.delenv(name, raising=False)


def test_some_catalogue_model_is_fitted_off_the_engines_default():
    assert FITTED, "no catalogue model has a fitted probe layer"
    assert all(m.fitted_probe_layer != BlendConfig().probe_layer for m in FITTED)


@pytest.mark.parametrize("model", FITTED, ids=lambda m: m.name)
def test_a_fitted_model_runs_with_its_probe_layer(model):
    assert load_settings(model={"name": model.name}).blend.probe_layer == model.fitted_probe_layer


def test_the_model_named_by_env_or_by_its_file_gets_its_fit_too(monkeypatch, tmp_path):
    model = FITTED[0]
    assert load_settings(model={"name": str(tmp_path / model.file_name)}).blend.probe_layer == model.fitted_probe_layer
    monkeypatch.setenv("RAGBLEND_MODEL__NAME", model.name)
    assert load_settings().blend.probe_layer == model.fitted_probe_layer


def test_a_model_outside_the_catalogue_keeps_the_engines_default(tmp_path):
    for name in ("random:llama-tiny", str(tmp_path / "other.Q4_K_M.gguf"), str(tmp_path)):
        assert catalogue_model(name) is None and fitted_blend(name) == {}
        assert load_settings(model={"name": name}).blend == BlendConfig()


def test_what_the_user_sets_wins_over_the_fit_and_the_rest_merges(monkeypatch, tmp_path):
    model = FITTED[0]
    user = model.fitted_probe_layer - 1
    assert load_settings(model={"name": model.name}, blend={"probe_layer": user}).blend.probe_layer == user
    # YAML
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name: {model.name}\nblend:\n  probe_layer: {user}\n")
    assert load_settings(config).blend.probe_layer == user
    # env: one blend field set, the fitted one kept beside it
    monkeypatch.setenv("RAGBLEND_BLEND__RECOMPUTE_RATIO", "0.3")
    blend = load_settings(model={"name": model.name}).blend
    assert (blend.probe_layer, blend.recompute_ratio) == (model.fitted_probe_layer, 0.3)
    monkeypatch.setenv("RAGBLEND_BLEND__PROBE_LAYER", str(user))
    assert load_settings(model={"name": model.name}).blend.probe_layer == user
    # null (probe at the check layer) is a setting too, not an absence
    assert load_settings(model={"name": model.name}, blend={"probe_layer": None}).blend.probe_layer is None


def test_a_yaml_naming_the_model_gets_its_fit(tmp_path):
    model = FITTED[0]
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  name: {model.name}\nblend:\n  recompute_ratio: 0.2\n")
    blend = load_settings(config).blend
    assert (blend.probe_layer, blend.recompute_ratio) == (model.fitted_probe_layer, 0.2)
    assert isinstance(load_settings(config).model.cache_dir, Path)


def test_models_list_says_each_fitted_probe_layer(tmp_path, capsys):
    from app.cli import main

    assert main(["models", "list", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for model in FITTED:
        assert f"{model.upstream}; blend probe layer {model.fitted_probe_layer} (fitted)" in out
