import pytest
from pydantic import ValidationError

from blend_engine.types import BlendConfig
from configs.enums import DeviationKind
from configs.settings import load_settings
from configs.enums import RequestMode


def test_defaults_come_from_the_yaml():
    settings = load_settings()
    assert settings.blend.mode == RequestMode.AUTO
    assert settings.blend.recompute_ratio == 0.15
    assert settings.model.name == "smollm2"  # tests/conftest.py's RAGBLEND_MODEL__NAME: the tests' model


def test_the_default_model_is_the_one_chosen_by_measurement(monkeypatch):
    """docs/decisions/0030: Qwen2.5-Coder-1.5B; `make run` installs it, the tests set SmolLM2 (conftest)."""
    monkeypatch.delenv("RAGBLEND_MODEL__NAME")
    assert load_settings().model.name == "qwen2.5-coder-1.5b"


def test_env_overrides_yaml_and_overrides_win(monkeypatch, tmp_path):
    user = tmp_path / "user.yaml"
    user.write_text("blend:\n  recompute_ratio: 0.3\n  deviation: key\n")
    assert load_settings(user).blend.recompute_ratio == 0.3
    monkeypatch.setenv("RAGBLEND_BLEND__RECOMPUTE_RATIO", "0.4")
    settings = load_settings(user)
    assert settings.blend.recompute_ratio == 0.4 and settings.blend.deviation == DeviationKind.KEY
    assert load_settings(user, blend={"recompute_ratio": 0.5}).blend.recompute_ratio == 0.5


@pytest.mark.parametrize("bad", [{"recompute_ratio": 1.5}, {"check_layers": [2, 1]}, {"check_layers": []},
                                 {"deviation": "x"}, {"mode": "fast"}])
def test_bad_values_are_rejected(bad):
    with pytest.raises(ValidationError):
        load_settings(blend=bad)


def test_missing_config_file_is_an_error():
    with pytest.raises(FileNotFoundError):
        load_settings("/no/such.yaml")


def test_blend_config_validates():
    with pytest.raises(ValueError):
        BlendConfig.cacheblend(recompute_ratio=-0.1)
    with pytest.raises(ValueError):
        BlendConfig.cacheblend(check_layers=(3, 1))
    assert BlendConfig.cacheblend(recompute_ratio=0.1, check_layers=(1, 2, 3), filter_growth=2.0).ratio_at_check(0) == pytest.approx(0.4)
