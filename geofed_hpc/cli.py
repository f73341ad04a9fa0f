"""The `geofed-hpc` command: Hydra overrides in, typed configs out, one clear line on error."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import yaml
from hydra import compose, version
from hydra._internal.hydra import Hydra
from hydra._internal.utils import create_config_search_path
from hydra.core.config_search_path import SearchPathQuery
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from geofed_hpc import __version__
from geofed_hpc.commands import HANDLERS, OPTIONS
from geofed_hpc.config import RunConfig, from_dict
from geofed_hpc.config.files import (
    GIVEN_DIRS,
    check_list_items,
    conf_dir,
    config_dirs,
    config_groups,
    option_file,
    user_options,
)
from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.log import logger, setup_logging
from geofed_hpc.paths import describe_os_error

COMMANDS = {
    "launch": "submit this site's training jobs (site=local runs sites here, with an embedded PS; "
    "a Slurm site submits one job per site, --dry-run prints their sbatch files)",
    "ps up": "run the parameter server until Ctrl-C / SIGTERM (--init-from CKPT: seed its model from CKPT)",
    "ps init": "create the TLS CA and PS certificate (ps.tls_names=[vm.example.org,1.2.3.4], "
    "ps.tls_sites=[osc] for mutual TLS); never overwrites keys unless ps.tls_overwrite=true",
    "status": "show the site jobs (from Slurm) and the federation as the parameter server sees it",
    "cancel": "cancel this site's Slurm jobs (each checkpoints first and is not requeued)",
    "logs": "print the end of this site's job logs (--follow: keep printing until the jobs end)",
    "report": "write RUN_DIR/report.png (loss curves) and print a summary: report RUN_DIR",
    "wandb sync": "upload a run directory's offline W&B runs (from a login node): wandb sync RUN_DIR",
    "token issue": "print a new enrollment token for site=NAME, once (the PS keeps its hash in ps.state_dir; "
    "--ttl 7d, default ps.token_ttl; a running PS sees it at once)",
    "token revoke": "revoke a token: token revoke ID, or every token of site=NAME (their sessions end)",
    "token list": "list the issued tokens: ids, sites, created, expires, revoked (never a secret)",
    "data prepare": "tokenize data.source (a file, folder or glob of .txt/.jsonl/.jsonl.gz/.jsonl.zst/.parquet, or a "
    "`datasets` save_to_disk folder) into site.num_sites token shards + validation under RUN_DIR/data, on "
    "data.workers threads (a core each); an interrupted prepare continues",
    "export hf": "export hf SRC OUT [--dtype bf16|fp32] [--site NAME] [--force]: write a trained model (SRC: a run "
    "directory's newest global model, a PS snapshot or a site checkpoint) as a Hugging Face folder",
    "generate": 'generate SRC --prompt "..." [--max-new-tokens N] [--temperature T] [--site NAME]: continue a '
    "prompt with a trained model (greedy at temperature 0)",
    "site new": "site new NAME: write your own site file NAME.yaml (from the template, or a copy of the shipped NAME) "
    "into ~/.config/geofed-hpc/site/ (or --config-dir DIR/site/)",
    "site check": "site check site=NAME ps.address=HOST:PORT: each path of site.egress tried from a compute node (a "
    "short job; saved for launch), then the launch preflight (model, data, checkpoints, the PS and its TLS, Slurm's "
    "partition and account), one line per check",
    "relay": "relay --to PS_HOST:PORT [--listen HOST:PORT]: on a node both the compute nodes and the PS reach, forward "
    "the sites' connections to that PS only (TLS end to end); sites set ps.address to the relay and ps.tls_name "
    "to the PS's name; or `relay --spool DIR --to PS_HOST:PORT [--once]`: answer the request files of sites with "
    "site.egress=[spool] site.spool=DIR through that PS",
}
__all__ = ["compose_config", "conf_dir", "config_groups", "main"]
# Words users type for a command of another name.
SYNONYMS = {
    "stop": "cancel",
    "kill": "cancel",
    "scancel": "cancel",
    "submit": "launch",
    "run": "launch",
    "start": "launch",
    "log": "logs",
    "tail": "logs",
    "ps start": "ps up",
    "server": "ps up",
}
# Commands whose first plain word (no '=') is the run directory.
RUN_DIR_ARG = ("report", "wandb sync")
# Commands whose first plain word is a token id.
TOKEN_ID_ARG = ("token revoke",)
# Commands whose first plain words are paths: how many.
PATH_ARGS = {"export hf": 2, "generate": 1, "site new": 1}
EXAMPLES = """examples:
  geofed-hpc launch site=local model=tiny             # local federation: PS + 2 sites on this machine
  geofed-hpc launch train.max_syncs=3 site.num_sites=3
  geofed-hpc launch paradigm=lora paradigm.rank=8 data.source=squad.json   # federated LoRA on SQuAD-format QA
  geofed-hpc ps up ps=cloud ps.port=50051             # on the cloud VM
  geofed-hpc status ps.address=vm.example.org:50051
  geofed-hpc launch site=osc ps.address=vm.example.org:50051 --dry-run   # print the sbatch file only
  geofed-hpc launch site=osc,tacc ps.address=vm.example.org:50051       # one job per site config
  geofed-hpc status site=osc                          # the jobs as Slurm sees them, then the PS's view
  geofed-hpc logs site=osc --follow
  geofed-hpc cancel site=osc
  geofed-hpc token issue site=osc ps=cloud --ttl 14d  # on the VM: prints osc's enrollment token once
  geofed-hpc token revoke site=osc ps=cloud           # every token of osc (or: token revoke <id>)
  geofed-hpc data prepare data.source='corpus/*.jsonl.zst' model=llama3_1b data.tokenizer=~/Llama-3.2-1B/tokenizer.json
  geofed-hpc export hf runs/geofed out/model --dtype bf16   # the newest global model as a Hugging Face folder
  geofed-hpc generate runs/geofed --prompt "In the beginning" --max-new-tokens 40
  geofed-hpc site new mycluster                       # ~/.config/geofed-hpc/site/mycluster.yaml to edit
  geofed-hpc site check site=mycluster ps=cloud ps.address=vm.example.org:50051   # the preflight alone
  geofed-hpc relay --to vm.example.org:50051          # on a login node, for compute nodes that cannot dial out
  geofed-hpc launch --cfg                             # print the composed config and exit
"""


# key=~/path as the shell passes it (it expands `~` only at the start of a word, not after `ps.ca_file=`): Hydra's
# grammar has no `~`, so such a value is quoted; the setting's reader expands it (Path.expanduser).
_HOME_VALUE = re.compile(r"(?P<key>\+{0,2}[A-Za-z_][\w.]*)=(?P<value>~[^'\"\\]*)")


def _quote_home(text: str) -> str:
    match = _HOME_VALUE.fullmatch(text)
    return f"{match['key']}='{match['value']}'" if match else text


def _hydra_overrides(overrides: list[str]) -> list[str]:
    """Check each group option (site=osc) against conf/; force plain key overrides (`++key=value`).

    Forced overrides reach the config sections even where the chosen option's YAML does not list the key, so
    that a wrong key is named by the sections' own validation (with the valid keys), never by Hydra.
    """
    groups = config_groups()
    overrides = [_quote_home(o) for o in overrides]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        raise ConfigError(f"cannot parse override: {str(exc).splitlines()[0]}") from None
    out = []
    for text, ov in zip(overrides, parsed, strict=True):
        key = ov.key_or_group
        if key in groups and not ov.is_delete() and not ov.is_add():
            value = ov.value()
            if not isinstance(value, str) or value not in groups[key]:
                close = difflib.get_close_matches(str(value), groups[key], n=1, cutoff=0.6)
                hint = f"did you mean {key}={close[0]}? " if close else ""
                raise ConfigError(f"unknown {key} option {value!r}; {hint}valid choices: {', '.join(groups[key])}")
            out.append(text)
        elif ov.type == OverrideType.CHANGE and key.split(".")[0] != "hydra":
            out.append(f"++{text}")
        else:
            out.append(text)
    return out


def _initialize() -> None:
    """Hydra over the shipped conf/, with the user's folders before it (Hydra's own `hydra.searchpath` comes
    after the primary folder, so a user's osc.yaml would lose to the shipped one)."""
    version.setbase("1.3")
    search = create_config_search_path(search_path_dir=str(conf_dir()))
    for folder in config_dirs()[:-1]:
        if folder.is_dir():
            search.prepend("geofed-user", str(folder.resolve()), anchor=SearchPathQuery(provider="main"))
    Hydra.create_main_hydra2(task_name="geofed-hpc", config_search_path=search)


def _yaml_error(exc: yaml.YAMLError) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    if str(getattr(exc, "context", "") or "").startswith("while scanning"):  # the key or quote that never ended
        mark = getattr(exc, "context_mark", None) or mark
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else "a config file"
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return ConfigError(f"{where}: not valid YAML ({problem}); fix that line of the file")


def compose_config(overrides: list[str]) -> tuple[RunConfig, str]:
    """Compose the config folders with Hydra's override grammar; return the typed config and its YAML."""
    forced = _hydra_overrides(overrides)
    groups = config_groups()
    for o in overrides:  # the files this command line chose: list items YAML would merge silently
        group, _, option = o.partition("=")
        path = option_file(group, option) if group in groups and "," not in option else None
        if path is not None:
            check_list_items(path)
    GlobalHydra.instance().clear()
    try:
        _initialize()
        raw = compose(config_name="config", overrides=forced)
        plain = OmegaConf.to_container(raw, resolve=True)
    except (HydraException, OmegaConfBaseException) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise ConfigError(" ".join(lines[:2])) from None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc) from None
    finally:
        GlobalHydra.instance().clear()
    return from_dict(RunConfig, plain), OmegaConf.to_yaml(raw, resolve=True)


def _help_text() -> str:
    lines = [
        "usage: geofed-hpc COMMAND [key=value ...] [+key=value] [~key] [--cfg] [--dry-run] [--no-ps-check] [--follow] "
        "[-q|-v]"
    ]
    lines += ["       geofed-hpc export hf SRC OUT [--dtype bf16|fp32] [--site NAME] [--force] [key=value ...]"]
    lines += ['       geofed-hpc generate SRC --prompt "..." [--max-new-tokens N] [--temperature T] [--seed S]']
    lines += ["", "commands:"]
    lines += [f"  {name:<12} {text}" for name, text in COMMANDS.items()]
    lines += ["", "config groups (choose one option each, e.g. site=local):"]
    lines += [f"  {group:<8} {', '.join(opts)}" for group, opts in config_groups().items()]
    mine = user_options("site")
    lines += ["", "config folders, searched in this order: " + ", ".join(str(d) for d in config_dirs())]
    lines += [f"  site={name}: {path}" for name, path in mine.items()]
    lines += ["", "any value can be set with dotted keys: ps.port=50051 train.sync_interval=5m codec.block_size=4096"]
    lines += ["", EXAMPLES]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geofed-hpc", add_help=False)
    p.add_argument("words", nargs="*")
    p.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    p.add_argument("--config-dir", action="append", default=[], metavar="DIR", help="config files before the others")
    p.add_argument("--dry-run", action="store_true", help="launch: print the sbatch files, submit nothing")
    p.add_argument("--follow", action="store_true", help="logs: keep printing until the jobs end")
    p.add_argument("--demo", action="store_true", help="launch: a Slurm site may train on the demo corpus (bible)")
    p.add_argument(
        "--no-ps-check", action="store_true", help="launch, site check: do not dial the PS first (it comes up later)"
    )
    p.add_argument("--init-from", metavar="CKPT", default="", help="ps up: seed the global model from CKPT")
    p.add_argument("--ttl", metavar="DURATION", default="", help="token issue: lifetime (30s, 5m, 2h, 7d; 0: forever)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="export hf: the weights' dtype")
    p.add_argument("--site", metavar="NAME", default="", help="export hf / generate: that site's model of a run")
    p.add_argument("--force", action="store_true", help="export hf: replace an output folder that is not empty")
    p.add_argument("--prompt", default="", help="generate: the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=50, help="generate: tokens to add (50)")
    p.add_argument("--temperature", type=float, default=0.0, help="generate: 0 greedy, else sampled (0)")
    p.add_argument("--seed", type=int, default=0, help="generate: the sampling seed (0)")
    p.add_argument("--to", metavar="HOST:PORT", default="", help="relay: the PS to forward to (default ps.address)")
    p.add_argument("--listen", metavar="HOST:PORT", default="", help="relay: where sites dial (0.0.0.0:the PS's port)")
    p.add_argument("--max-connections", type=int, default=256, help="relay: connections at once (256)")
    p.add_argument("--idle", metavar="DURATION", default="10m", help="relay: close a connection idle this long (10m)")
    p.add_argument("--spool", metavar="DIR", default="", help="relay: serve the sites' request files in DIR instead")
    p.add_argument("--poll", metavar="DURATION", default="200ms", help="relay --spool: look for requests this often")
    p.add_argument("--once", action="store_true", help="relay --spool: exit after 10 looks find nothing (cron)")
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
        if command in TOKEN_ID_ARG and rest and "=" not in rest[0] and not rest[0].startswith("~"):
            OPTIONS.token_id, rest = rest[0], rest[1:]
        OPTIONS.paths = []
        while len(OPTIONS.paths) < PATH_ARGS.get(command, 0) and rest and "=" not in rest[0] and rest[0][:1] != "~":
            OPTIONS.paths, rest = [*OPTIONS.paths, rest[0]], rest[1:]
        return command, rest
    typed = " ".join(w for w in words[:2] if "=" not in w)
    meant = (
        SYNONYMS.get(words[0] if words else "")
        or next(iter(difflib.get_close_matches(typed, COMMANDS, n=1, cutoff=0.6)), None)
        or next(iter(difflib.get_close_matches(words[0] if words else "", COMMANDS, n=1, cutoff=0.6)), None)
    )
    hint = f"did you mean `geofed-hpc {meant}`? " if meant else ""
    raise ConfigError(f"unknown command {typed!r}; {hint}commands: {', '.join(COMMANDS)} (see --help)")


def _site_list(overrides: list[str]) -> list[str]:
    """The site configs of `site=osc,tacc` (one job set each); [] without a site= override."""
    for o in overrides:
        if o.startswith("site="):
            return [s.strip() for s in o[5:].split(",") if s.strip()]
    return []


def shard_overrides(counts: list[int], i: int) -> list[str]:
    """Disjoint data shards for site configs launched together: config i's sites follow those before it."""
    return [f"site.first_shard={sum(counts[:i])}", f"site.shard_count={sum(counts)}"]


# Switches of ours that change what `launch` does: after `script=` they would silently go to the script instead.
LAUNCH_SWITCHES = ("--dry-run", "--no-ps-check", "--demo", "--cfg", "--config-dir")


def split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    """`launch ... script=train.py --lr 3e-4`: the words after `script=` are the script's own arguments, not ours.
    One of our launch switches among them is refused (ConfigError) unless it follows `--`, which hands everything
    after it to the script as it is."""
    at = next((i for i, word in enumerate(argv) if word.startswith("script=")), None)
    if at is None:
        return argv, []
    theirs = argv[at + 1 :]
    end = theirs.index("--") if "--" in theirs else len(theirs)
    ours = [w for w in theirs[:end] if w.split("=", 1)[0] in LAUNCH_SWITCHES]
    if ours:
        raise ConfigError(
            f"{ours[0]} comes after script=, so it would go to the script, not to geofed-hpc: put it before "
            f"script= (or after `--` to hand it to the script)"
        )
    return argv[: at + 1], theirs[:end] + theirs[end + 1 :]


def with_script(cfg: RunConfig, command: str, script: str, script_args: list[str]) -> RunConfig:
    """`script=PATH`: the Python script each site's job runs (with `script_args`), checked and made absolute."""
    if command != "launch":
        raise ConfigError(f"script: only `launch` runs a script (launch site=NAME script=train.py ARGS), not {command}")
    path = Path(script).expanduser()
    if not script or not path.is_file():
        raise ConfigError(f"script: {script!r} is not a file (launch site=NAME script=train.py ARGS)")
    ranks = cfg.site.nodes * cfg.site.tasks_per_node
    if ranks > 1:
        raise ConfigError(
            f"site.tasks_per_node: script= runs one process per site job (geofed_hpc.Site federates one process); "
            f"this site has {ranks} ranks a job: set site.nodes=1 site.tasks_per_node=1"
        )
    return replace(cfg, script=[str(path.resolve()), *script_args])


def _launch_each(
    sites: list[str], overrides: list[str], args: argparse.Namespace, script_args: list[str] | None = None
) -> int:
    switches = (
        ("--cfg", args.cfg),
        ("--dry-run", args.dry_run),
        ("--no-ps-check", args.no_ps_check),
        ("--demo", args.demo),
        ("-q", args.quiet),
    )
    flags = [f for f, on in switches if on]
    flags += ["-v"] if args.verbose else []
    flags += [f"--config-dir={d}" for d in args.config_dir]
    per_site = [[f"site={site}" if o.startswith("site=") else o for o in overrides] for site in sites]
    configs = [compose_config([w for w in o if not w.startswith("script=")])[0] for o in per_site]
    names = [c.site.name for c in configs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"site: {', '.join(twice)} is given twice in site={','.join(sites)}; its jobs would share one checkpoint "
            f"folder per site ({configs[names.index(twice[0])].site.name}-0, ...): name each site config once "
            "(more jobs of one site: site.num_sites=N)"
        )
    if not any(o.startswith(("site.first_shard=", "site.shard_count=")) for o in overrides):
        counts = [c.site.num_sites for c in configs]
        per_site = [[*o, *shard_overrides(counts, i)] for i, o in enumerate(per_site)]
    for site_overrides in per_site:
        ours = [o for o in site_overrides if not o.startswith("script=")]
        script = [o for o in site_overrides if o.startswith("script=")]  # last: the words after it are its own
        tail = [*script, *(script_args or [])] if script else []
        code = main([*flags, "launch", *ours, *tail])
        if code:
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        argv, script_args = split_script(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as exc:
        print(f"geofed-hpc: error: {exc}", file=sys.stderr)
        return 2
    args = _parser().parse_intermixed_args(argv)
    if args.version:
        print(f"geofed-hpc {__version__}")
        return 0
    GIVEN_DIRS[:] = [Path(d).expanduser().absolute() for d in args.config_dir]
    if args.help or not args.words:
        print(_help_text())
        return 0
    # gRPC's C core logs handshake failures on its own; our errors name them in one line (-v: gRPC's too)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR" if args.verbose else "NONE")
    try:
        missing = [d for d in GIVEN_DIRS if not d.is_dir()]
        if missing:
            raise ConfigError(f"--config-dir: {missing[0]} is not a folder (it holds site/NAME.yaml and other groups)")
        OPTIONS.token_id = ""
        command, overrides = _split(args.words)
        OPTIONS.dry_run, OPTIONS.follow = args.dry_run, args.follow
        OPTIONS.demo, OPTIONS.command = args.demo, command
        OPTIONS.ps_check = not args.no_ps_check
        OPTIONS.given = [o.lstrip("+~").split("=", 1)[0] for o in overrides]  # keys set on this command line
        OPTIONS.init_from, OPTIONS.ttl = args.init_from, args.ttl
        OPTIONS.site_given = any(o.startswith(("site=", "site.name=")) for o in overrides)
        OPTIONS.model_given = any(o.startswith(("model=", "model.")) for o in overrides)
        OPTIONS.dtype, OPTIONS.site, OPTIONS.force, OPTIONS.prompt = args.dtype, args.site, args.force, args.prompt
        OPTIONS.max_new_tokens, OPTIONS.temperature, OPTIONS.seed = args.max_new_tokens, args.temperature, args.seed
        OPTIONS.relay_to, OPTIONS.relay_listen = args.to, args.listen
        OPTIONS.relay_max_connections, OPTIONS.relay_idle = args.max_connections, args.idle
        OPTIONS.relay_spool, OPTIONS.relay_poll, OPTIONS.relay_once = args.spool, args.poll, args.once
        if command == "launch" and len(_site_list(overrides)) > 1:
            return _launch_each(_site_list(overrides), overrides, args, script_args)
        script = next((o.split("=", 1)[1] for o in overrides if o.startswith("script=")), None)
        cfg, yaml_text = compose_config([o for o in overrides if not o.startswith("script=")])
        if script is not None:
            cfg = with_script(cfg, command, script, script_args)
        if args.cfg:
            print(yaml_text, end="")
            return 0
        if "run_dir" in OPTIONS.given and "site.run_dir" not in OPTIONS.given and cfg.site.run_dir:
            cfg = replace(cfg, site=replace(cfg.site, run_dir=""))  # run_dir= typed here beats the site file's root
        verbosity = -1 if args.quiet else 1 if args.verbose else cfg.verbosity
        cfg = replace(cfg, verbosity=verbosity)
        # `launch` and `ps up` print their own progress tables; their info log lines show with -v only.
        setup_logging(verbosity - 1 if command in ("launch", "ps up") else verbosity)
        started = time.monotonic()
        code = HANDLERS[command](cfg)
        logger.debug("%s finished in %.1fs", command, time.monotonic() - started)
        return code
    except GeofedError as exc:
        print(f"geofed-hpc: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the command reads or writes: one line (-v: the stack too)
        logger.debug("file system error", exc_info=True)
        print(f"geofed-hpc: error: {describe_os_error(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("geofed-hpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
