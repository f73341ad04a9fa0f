"""The `geofed-hpc` command: Hydra overrides in, typed configs out, one clear line on error."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from geofed_hpc import __version__
from geofed_hpc.config import RunConfig, from_dict
from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.log import logger, setup_logging

COMMANDS = {
    "launch": "submit this site's training jobs (site=local runs sites here, with an embedded PS)",
    "ps up": "run the parameter server in the foreground until Ctrl-C / SIGTERM",
    "status": "show the federation as the parameter server sees it",
    "report": "write RUN_DIR/report.png (loss curves) and print a summary: report RUN_DIR",
    "wandb sync": "upload a run directory's offline W&B runs (from a login node): wandb sync RUN_DIR",
}
# Commands whose first plain word (no '=') is the run directory.
RUN_DIR_ARG = ("report", "wandb sync")
EXAMPLES = """examples:
  geofed-hpc launch site=local model=tiny             # local federation: PS + 2 sites on this machine
  geofed-hpc launch train.max_syncs=3 site.num_sites=3
  geofed-hpc ps up ps=cloud ps.port=50051             # on the cloud VM
  geofed-hpc status ps.address=vm.example.org:50051
  geofed-hpc launch --cfg                             # print the composed config and exit
"""


def conf_dir() -> Path:
    """The shipped configuration directory (inside the installed package, or conf/ in a checkout)."""
    return Path(str(resources.files("geofed_hpc.conf")))


def config_groups() -> dict[str, list[str]]:
    root = conf_dir()
    return {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in sorted(root.iterdir())
        if d.is_dir() and not d.name.startswith(("_", "."))
    }


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _check_overrides(overrides: list[str]) -> None:
    """Name the bad group option or key in one line, before Hydra composes anything."""
    groups = config_groups()
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(f"cannot parse override: {str(exc).splitlines()[0]}") from None
    for ov in parsed:
        key = ov.key_or_group
        if key in groups and not ov.is_delete() and not ov.is_add():
            value = ov.value()
            if not isinstance(value, str) or value not in groups[key]:
                raise ConfigError(f"unknown {key} option {value!r}; valid choices: {', '.join(groups[key])}")
            continue
        if ov.is_add():
            continue  # a new key is checked against the dataclasses after composition
        cls: Any = RunConfig
        path: list[str] = []
        for part in key.split("."):
            fields = _fields(cls) if isinstance(cls, type) and dataclasses.is_dataclass(cls) else {}
            if part not in fields:
                where = ".".join(path) or "the top level"
                raise ConfigError(f"unknown key {key}; valid keys in {where}: {', '.join(sorted(fields))}")
            path.append(part)
            cls = fields[part]


def compose_config(overrides: list[str]) -> tuple[RunConfig, str]:
    """Compose conf/ with Hydra's override grammar; return the typed config and its YAML."""
    _check_overrides(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            raw = compose(config_name="config", overrides=overrides)
        plain = OmegaConf.to_container(raw, resolve=True)
    except (HydraException, OmegaConfBaseException) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError(" ".join(lines[:2])) from None
    finally:
        GlobalHydra.instance().clear()
    return from_dict(RunConfig, plain), OmegaConf.to_yaml(raw, resolve=True)


def _help_text() -> str:
    lines = ["usage: geofed-hpc COMMAND [key=value ...] [+key=value] [~key] [--cfg] [-q|-v]", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, text in COMMANDS.items()]
    lines += ["", "config groups (choose one option each, e.g. site=local):"]
    lines += [f"  {group:<8} {', '.join(opts)}" for group, opts in config_groups().items()]
    lines += ["", "any value can be set with dotted keys: ps.port=50051 train.sync_interval=5m codec.block_size=4096"]
    lines += ["", EXAMPLES]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed-hpc", add_help=False)
    p.add_argument("words", nargs="*")
    p.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    p.add_argument("-h", "--help", action="store_true")
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--version", action="store_true")
    return p


def _split(words: list[str]) -> tuple[str, list[str]]:
    command, rest = "", words[1:]
    if " ".join(words[:2]) in COMMANDS:
        command, rest = " ".join(words[:2]), words[2:]
    elif words and words[0] in COMMANDS:
        command = words[0]
    if command:
        if command in RUN_DIR_ARG and rest and "=" not in rest[0] and not rest[0].startswith("~"):
            rest = [f"run_dir={rest[0]}", *rest[1:]]
        return command, rest
    raise ConfigError(f"unknown command {' '.join(words[:2])!r}; commands: {', '.join(COMMANDS)} (see --help)")


def cmd_launch(cfg: RunConfig) -> int:
    from geofed_hpc.launch.local import launch_local
    from geofed_hpc.ps.app import ParameterServer
    from geofed_hpc.rpc.client import PSClient

    run_dir = Path(cfg.run_dir).expanduser().resolve()
    cfg = replace(cfg, run_dir=str(run_dir))
    ps = None
    if cfg.site.embedded_ps:
        state_dir = cfg.ps.state_dir or str(run_dir / "ps")
        ps = ParameterServer(replace(cfg, ps=replace(cfg.ps, state_dir=state_dir)))
        address = ps.address
        print(f"parameter server (embedded) on {address}, state in {state_dir}", flush=True)
    else:
        address = cfg.ps.dial_address()
        with PSClient(cfg.ps, address) as probe:
            probe.connect()
    try:
        launch_local(cfg, address)
    finally:
        if ps is not None:
            ps.stop()
    print(f"run directory: {run_dir} (W&B offline runs under {run_dir / 'metrics' / 'wandb'})", flush=True)
    return 0


def cmd_ps_up(cfg: RunConfig) -> int:
    from geofed_hpc.ps.app import ParameterServer

    ps_cfg = replace(cfg.ps, state_dir=str(Path(cfg.ps.state_dir).expanduser()) if cfg.ps.state_dir else "")
    server = ParameterServer(replace(cfg, ps=ps_cfg))
    print(
        f"parameter server on {cfg.ps.host}:{server.port} ({'plaintext' if cfg.ps.insecure else 'TLS'}, "
        f"{cfg.ps.aggregation}); Ctrl-C to stop",
        flush=True,
    )
    server.wait_for_signal()
    return 0


def cmd_status(cfg: RunConfig) -> int:
    from geofed_hpc.rpc.client import PSClient

    with PSClient(cfg.ps) as client:
        client.connect()
        st = client.status()
    print(
        f"version {st.version}  initialized {st.initialized}  aggregation {st.aggregation}  "
        f"params {st.num_params:,}  uptime {st.uptime_s:.0f}s  pending deltas {st.pending_deltas}"
    )
    print(f"{'site':<16}{'pushes':>8}{'base':>8}{'tokens':>12}{'loss':>9}{'last seen':>11}")
    for s in st.sites:
        print(
            f"{s.site:<16}{s.pushes:>8}{s.last_base_version:>8}{s.tokens:>12,}{s.last_train_loss:>9.4f}"
            f"{s.last_seen_s:>10.0f}s"
        )
    return 0


def cmd_report(cfg: RunConfig) -> int:
    from geofed_hpc.metrics.report import write_report

    path, text = write_report(Path(cfg.run_dir).expanduser())
    print(text)
    print(f"wrote {path}")
    return 0


def cmd_wandb_sync(cfg: RunConfig) -> int:
    from geofed_hpc.metrics.wandb_sync import sync_offline_runs

    return sync_offline_runs(Path(cfg.run_dir).expanduser())


HANDLERS = {
    "launch": cmd_launch,
    "ps up": cmd_ps_up,
    "status": cmd_status,
    "report": cmd_report,
    "wandb sync": cmd_wandb_sync,
}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.version:
        print(f"geofed-hpc {__version__}")
        return 0
    if args.help or not args.words:
        print(_help_text())
        return 0
    try:
        command, overrides = _split(args.words)
        cfg, yaml_text = compose_config(overrides)
        if args.cfg:
            print(yaml_text, end="")
            return 0
        verbosity = -1 if args.quiet else 1 if args.verbose else cfg.verbosity
        cfg = replace(cfg, verbosity=verbosity)
        setup_logging(verbosity)
        started = time.monotonic()
        code = HANDLERS[command](cfg)
        logger.debug("%s finished in %.1fs", command, time.monotonic() - started)
        return code
    except GeofedError as exc:
        print(f"geofed-hpc: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("geofed-hpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
