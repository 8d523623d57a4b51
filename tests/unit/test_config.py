"""Every preset composes; bad values fail at start-up with the key named."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from conftest import REPO, compose_config, small_overrides
from dflash.config import ConfigError


@pytest.mark.parametrize("model", [p.stem for p in (REPO / "conf" / "model").glob("*.yaml")])
def test_every_model_preset_composes(model, tmp_path):
    cfg = compose_config([f"model={model}", f"model.path={tmp_path}", f"output_root={tmp_path}"])
    assert cfg.model.name == model
    assert cfg.model.architecture["num_hidden_layers"] > 0


@pytest.mark.parametrize("experiment", [p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")])
def test_every_experiment_composes(experiment, tmp_path):
    cfg = compose_config([f"experiment={experiment}", f"model.path={tmp_path}",
                          f"data.path={tmp_path}", f"output_root={tmp_path}"])
    assert cfg.run_dir == str(tmp_path / cfg.run_name)


def test_defaults_and_run_dir(tmp_path):
    cfg = compose_config([f"output_root={tmp_path}"])
    assert cfg.stage == "all" and cfg.run_name == "demo"
    assert cfg.run_dir == str(tmp_path / "demo")
    assert cfg.model.name == "tiny" and cfg.data.source == "synthetic"
    assert Path(cfg.data.prepared_dir) == tmp_path / "demo" / "prepared"


def test_debug_preset(tmp_path):
    cfg = compose_config(["debug=default", f"output_root={tmp_path}"])
    assert cfg.wandb.mode == "disabled" and cfg.device == "cpu"


@pytest.mark.parametrize("override, key", [
    ("extract.token_budget=0", "extract.token_budget"),
    ("extract.overlong=drop", "extract.overlong"),
    ("extract.layer_ids=[1,1]", "extract.layer_ids"),
    ("extract.dtype=float16", "extract.dtype"),
    ("wandb.mode=sometimes", "wandb.mode"),
    ("stage=fly", "stage"),
    ("barrier.timeout_s=-1", "barrier.timeout_s"),
    ("data.num_samples=0", "data.num_samples"),
])
def test_bad_value_names_the_key(override, key, tmp_path):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        compose_config([override, f"output_root={tmp_path}"])


def test_bad_type_names_the_key(tmp_path):
    with pytest.raises(ConfigCompositionException, match="token_budget"):
        compose_config(["extract.token_budget=lots", f"output_root={tmp_path}"])


def test_unknown_key_is_refused(tmp_path):
    with pytest.raises(ConfigCompositionException, match="token_budgett"):
        compose_config(["extract.token_budgett=5", f"output_root={tmp_path}"])


def test_required_model_path(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        compose_config(["model=qwen3_6_27b", f"output_root={tmp_path}"])


def test_small_overrides_compose(tmp_path):
    cfg = compose_config(small_overrides(tmp_path))
    assert cfg.device == "cpu"
