"""Config composition through Hydra's override grammar, and validation errors that name the field."""

from __future__ import annotations

from datetime import timedelta

import pytest

from geofed_hpc.cli import compose_config, config_groups
from geofed_hpc.config import PSConfig, RunConfig, TrainConfig, from_dict, parse_duration, to_dict
from geofed_hpc.errors import ConfigError


def test_defaults_compose_to_typed_config() -> None:
    cfg, yaml_text = compose_config([])
    assert isinstance(cfg, RunConfig)
    assert cfg.site.name == "local" and cfg.model.name == "tiny" and cfg.codec.name == "int8"
    assert isinstance(cfg.train.sync_interval, timedelta) and cfg.train.sync_interval == timedelta(seconds=20)
    assert cfg.ps.round_timeout == timedelta(minutes=2)
    assert cfg.run_dir == "runs/geofed"  # interpolated from federation
    assert "site:" in yaml_text and "num_sites: 2" in yaml_text


def test_override_grammar_set_add_delete() -> None:
    cfg, _ = compose_config(["ps.port=50051", "train.sync_interval=5m", "federation=fed1", "~site.token"])
    assert cfg.ps.port == 50051 and cfg.train.sync_interval == timedelta(minutes=5)
    assert cfg.run_dir == "runs/fed1" and cfg.site.token == ""
    cfg, _ = compose_config(["ps=cloud", "codec=fp32"])
    assert not cfg.ps.insecure and cfg.ps.port == 50051 and cfg.ps.aggregation == "async" and cfg.codec.name == "fp32"
    assert cfg.ps.global_lr == 1.0  # inherited from ps/local through the group's defaults list


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=tinyy"], "unknown model option 'tinyy'; valid choices: gpt2_medium, llama3_1b, tiny"),
        (["site=osc_typo"], "unknown site option 'osc_typo'; valid choices: iitm, local, osc, slurm_local, tacc"),
        (["model.d_modle=8"], "unknown key model.d_modle; valid keys in model: arch, context, d_ff, d_model"),
        (["+model.extra=1"], "unknown key model.extra; valid keys in model"),
        (["trian.lr=1"], "unknown key trian.lr; valid keys in the top level: codec, data, federation"),
        (["ps.port=abc"], "ps.port: expected an integer, got 'abc'"),
        (["ps.port=70000"], "ps.port: must be in 0..65535"),
        (["train.sync_interval=soon"], "train.sync_interval: expected a duration"),
        (["model.d_model=10"], "model.d_model: must be divisible by model.n_heads"),
        (["codec.name=int3"], "codec.name: must be one of fp32, bf16, int16, int8, int4"),
        (["ps.address=nohost"], "ps.address: expected host:port"),
        (["ps.insecure=false"], "ps.insecure: TLS is on"),
        (["data.source=/no/such/file.txt"], "data.source: '/no/such/file.txt' is neither 'bible' nor an existing"),
        (["model=[a"], "cannot parse override"),
    ],
)
def test_bad_overrides_fail_with_one_line_naming_them(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_groups_listed_from_conf() -> None:
    groups = config_groups()
    assert {"local", "slurm_local", "osc", "tacc"} <= set(groups["site"])
    assert {"tiny", "llama3_1b", "gpt2_medium"} <= set(groups["model"]) and "cloud" in groups["ps"]
    assert set(groups) >= {"site", "model", "ps", "codec", "data", "train"}


def test_durations() -> None:
    assert parse_duration("250ms", "x") == timedelta(milliseconds=250)
    assert parse_duration(90, "x") == timedelta(seconds=90)
    assert parse_duration("2h", "x") == timedelta(hours=2)
    for bad in ("-5s", "5 parsecs", True):
        with pytest.raises(ConfigError, match="x"):
            parse_duration(bad, "x")


def test_round_trip_through_plain_dict() -> None:
    cfg, _ = compose_config(["train.sync_interval=90s"])
    again = from_dict(RunConfig, to_dict(cfg))
    assert again == cfg


def test_dataclasses_validate_directly() -> None:
    with pytest.raises(ConfigError, match="train.batch_size"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="ps.chunk_bytes"):
        PSConfig(chunk_bytes=10)
    with pytest.raises(ConfigError, match="unknown key ps.colour"):
        from_dict(RunConfig, {"ps": {"colour": "red"}})
    with pytest.raises(ConfigError, match="site.num_sites: expected an integer"):
        from_dict(RunConfig, {"site": {"num_sites": True}})
