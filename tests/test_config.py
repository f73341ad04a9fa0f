"""Config composition through Hydra's override grammar, and validation errors that name the field."""

from __future__ import annotations

import dataclasses
import json
import pickle
import typing
from datetime import timedelta

import pytest

from geofed_hpc.cli import compose_config, config_groups, main
from geofed_hpc.config import PSConfig, RunConfig, SiteConfig, TrainConfig, from_dict, parse_duration, to_dict
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
        (
            ["model=tinyy"],
            "unknown model option 'tinyy'; did you mean model=tiny? valid choices: gpt2_medium, hf, llama3_1b",
        ),
        (["site=osc_typo"], "unknown site option 'osc_typo'; valid choices: iitm, local, osc, slurm_local, tacc"),
        (["model.d_modle=8"], "unknown key model.d_modle; did you mean model.d_model?"),
        (["+model.extra=1"], "unknown key model.extra; valid keys in model"),
        (["trian.lr=1"], "unknown key trian.lr; did you mean train.lr?"),
        (["zzz.lr=1"], "unknown key zzz.lr; valid keys in the top level: codec, data, federation"),
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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ps.aggregation=fast"], "ps.aggregation: must be one of sync, async, buffered; got 'fast'"),
        (
            ["paradigm.name=lorax"],
            "paradigm.name: must be one of identity, lora, hybrid_lora, ravan, zo, fsl_sage, split; got 'lorax'",
        ),
        (["codec.adaptive_codecs=[int8,int3]"], "codec.adaptive_codecs: must be one of fp32, bf16, int16, int8, int4,"),
        (["site.nodes=0"], "site.nodes: must be at least 1, got 0"),
        (["site.num_sites=65"], "site.num_sites: must be in 1..64, got 65"),
        (["ps.momentum=1.0"], "ps.momentum: must be in [0, 1), got 1"),
        (["train.lr=0"], "train.lr: must be positive, got 0"),
        (["ps.max_staleness=-1"], "ps.max_staleness: must be 0 or more, got -1"),
        (["ps.heartbeat_interval=50ms"], "ps.heartbeat_interval: must be at least 0.1s, got 50ms"),
        (["ps.prot=1"], "unknown key ps.prot; did you mean ps.port?"),
        (["site.num_sites=true"], "site.num_sites: expected an integer, got True"),
        (["ps.global_lr=fast"], "ps.global_lr: expected a number, got 'fast'"),
        (["ps.insecure=maybe"], "ps.insecure: expected true or false, got 'maybe'"),
        (["site.setup=[[a]]"], "site.setup: expected a string, got ['a']"),
        (["codec.adaptive_codecs=[]"], "codec.adaptive_codecs: must have at least 1 item, got []"),
        (["federation=a@b"], "federation: use letters, digits, _ . -; got 'a@b'"),
    ],
)
def test_validation_errors_name_the_key_and_what_it_takes(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    text = str(info.value)
    assert text.startswith(message) and "\n" not in text


def test_values_are_typed_as_before() -> None:
    cfg, _ = compose_config(["ps.global_lr=2", "site.account=1234", "train.sync_interval=90", "site.mem_gb=16"])
    assert cfg.ps.global_lr == 2.0 and isinstance(cfg.ps.global_lr, float)  # an integer is a number
    assert cfg.site.account == "1234" and cfg.site.mem_gb == 16.0  # a number given for text is its text
    assert cfg.train.sync_interval == timedelta(seconds=90)  # a bare number is seconds
    with pytest.raises(ConfigError, match="ps.port: expected an integer, got 50051.0"):
        compose_config(["ps.port=50051.0"])


def test_a_key_the_chosen_option_does_not_list_can_still_be_set() -> None:
    cfg, _ = compose_config(["site=local", "site.qos=debug", "site.sbatch_extra.reservation=ml"])
    assert cfg.site.qos == "debug" and cfg.site.sbatch_extra == {"reservation": "ml"}


def test_sections_built_directly_raise_the_same_errors() -> None:
    with pytest.raises(ConfigError, match="^ps.aggregation: must be one of sync, async, buffered; got 'x'$"):
        PSConfig(aggregation="x")
    valid = "activation_checkpointing, background_checkpoint, batch_size, checkpoint_mirror, compile"
    with pytest.raises(ConfigError, match=f"^unknown key train.velocity; valid keys in train: {valid}"):
        TrainConfig(velocity=2)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match="^site.setup: expected a string, got None$"):
        from_dict(SiteConfig, {"setup": ["module load cuda", None]})


LIST_FIELDS = [
    ("site.setup", "module load cuda"),
    ("ps.tls_names", "vm.example.org"),
    ("ps.tls_sites", "osc"),
    ("codec.adaptive_codecs", "int8"),
    ("paradigm.targets", "attn.qkv"),
    ("ps.peers", "vm.example.org:50051"),
    ("site.egress", "tunnel"),
]
# What a list field needs beside it to make a valid config.
BESIDE = {"ps.peers": ["ps.peer_rank=0", "ps.peers=[vm.example.org:50051,b.example.org:50051]"]}


@pytest.mark.parametrize("key, value", LIST_FIELDS)
def test_a_single_value_for_a_list_field_is_a_one_element_list(key: str, value: str) -> None:
    section, name = key.split(".")
    if key in BESIDE:  # one value alone is no valid config of this field: the list is checked as one element
        with pytest.raises(ConfigError, match=r"ps.peer_rank: .* got 1 peer\(s\)"):  # read as a list of one
            compose_config([f"{key}={value}", BESIDE[key][0]])
        cfg, _ = compose_config(BESIDE[key])
        assert getattr(getattr(cfg, section), name)[0] == value
        return
    cfg, _ = compose_config([f"{key}={value}"])
    assert getattr(getattr(cfg, section), name) == [value]


def test_every_list_field_takes_a_single_value() -> None:
    listed = set()
    for section in dataclasses.fields(RunConfig):
        cls = RunConfig.__pydantic_fields__[section.name].annotation
        if dataclasses.is_dataclass(cls):
            fields = cls.__pydantic_fields__  # type: ignore[union-attr]
            listed |= {f"{section.name}.{n}" for n, f in fields.items() if typing.get_origin(f.annotation) is list}
    assert listed == {key for key, _ in LIST_FIELDS}


def test_plain_dict_is_json_and_rebuilds_an_equal_config() -> None:
    cfg, _ = compose_config(["ps.token_ttl=30d", "train.eval_interval=250ms", "site.setup=[a, b]"])
    plain = to_dict(cfg)
    assert plain["ps"]["token_ttl"] == "2592000s" and plain["train"]["eval_interval"] == "0.25s"
    assert from_dict(RunConfig, json.loads(json.dumps(plain))) == cfg
    assert from_dict(RunConfig, pickle.loads(pickle.dumps(plain))) == cfg  # what a site job carries


def test_command_line_error_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert main(["launch", "ps.prot=1", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("geofed-hpc: error: unknown key ps.prot; did you mean ps.port?") and err.count("\n") == 1
    assert main(["launch", "site.gpus_per_node=-1", "--cfg"]) == 2
    assert capsys.readouterr().err == "geofed-hpc: error: site.gpus_per_node: must be 0 or more, got -1\n"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ps.address=vm:70000"], "ps.address: port 70000 of 'vm:70000' is out of range: a port is 1..65535"),
        (["ps.address=vm:0"], "ps.address: port 0 of 'vm:0' is out of range: a port is 1..65535"),
        (["ps.address=vm.example.org"], "ps.address: expected host:port (e.g. vm.example.org:50051"),
        (["ps.address=:50051"], "ps.address: expected host:port"),
        (["site.proxy=http://proxy:99999"], "site.proxy: port 99999 of 'proxy:99999' is out of range"),
        (["site.proxy=proxy:3128"], "site.proxy: expected http://[USER:PASS@]host:port, got 'proxy:3128'"),
        (["site.cpus_per_site=4"], "site.cpus_per_site: renamed to site.cpus_per_task"),
    ],
)
def test_every_address_is_checked_when_the_config_is_read(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_good_addresses_are_taken_as_given() -> None:
    cfg, _ = compose_config(["ps.address='[2001:db8::1]:50051'", "site.proxy=http://proxy.example.org:3128"])
    assert cfg.ps.address == "[2001:db8::1]:50051" and cfg.site.proxy == "http://proxy.example.org:3128"
    assert compose_config(["ps.address=vm.example.org:65535"])[0].ps.address == "vm.example.org:65535"
    assert compose_config(["site.cpus_per_task=4"])[0].site.cpus_per_task == 4
