"""The `geofed-hpc` command: Hydra overrides in, typed configs out, one clear line on error."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import typing
from dataclasses import replace
from datetime import timedelta
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
    "data prepare": "tokenize data.source into site.num_sites token shards + a validation shard under RUN_DIR/data",
}
# Switches of this invocation that only some commands read (main sets them).
OPTIONS = argparse.Namespace(dry_run=False, follow=False, init_from="", ttl="", token_id="", site_given=False)
# Commands whose first plain word (no '=') is the run directory.
RUN_DIR_ARG = ("report", "wandb sync")
# Commands whose first plain word is a token id.
TOKEN_ID_ARG = ("token revoke",)
PS_PROBE_TIMEOUT = timedelta(seconds=5)
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
    lines = ["usage: geofed-hpc COMMAND [key=value ...] [+key=value] [~key] [--cfg] [--dry-run] [--follow] [-q|-v]"]
    lines += ["", "commands:"]
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
    p.add_argument("--dry-run", action="store_true", help="launch: print the sbatch files, submit nothing")
    p.add_argument("--follow", action="store_true", help="logs: keep printing until the jobs end")
    p.add_argument("--init-from", metavar="CKPT", default="", help="ps up: seed the global model from CKPT")
    p.add_argument("--ttl", metavar="DURATION", default="", help="token issue: lifetime (30s, 5m, 2h, 7d; 0: forever)")
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
        return command, rest
    raise ConfigError(f"unknown command {' '.join(words[:2])!r}; commands: {', '.join(COMMANDS)} (see --help)")


def _site_list(overrides: list[str]) -> list[str]:
    """The site configs of `site=osc,tacc` (one job set each); [] without a site= override."""
    for o in overrides:
        if o.startswith("site="):
            return [s.strip() for s in o[5:].split(",") if s.strip()]
    return []


def shard_overrides(counts: list[int], i: int) -> list[str]:
    """Disjoint data shards for site configs launched together: config i's sites follow those before it."""
    return [f"site.first_shard={sum(counts[:i])}", f"site.shard_count={sum(counts)}"]


def _launch_each(sites: list[str], overrides: list[str], args: argparse.Namespace) -> int:
    flags = [f for f, on in (("--cfg", args.cfg), ("--dry-run", args.dry_run), ("-q", args.quiet)) if on]
    flags += ["-v"] if args.verbose else []
    per_site = [[f"site={site}" if o.startswith("site=") else o for o in overrides] for site in sites]
    if not any(o.startswith(("site.first_shard=", "site.shard_count=")) for o in overrides):
        counts = [compose_config(o)[0].site.num_sites for o in per_site]
        per_site = [[*o, *shard_overrides(counts, i)] for i, o in enumerate(per_site)]
    for site_overrides in per_site:
        code = main([*flags, "launch", *site_overrides])
        if code:
            return code
    return 0


def cmd_launch(cfg: RunConfig) -> int:
    if cfg.site.executor == "slurm":
        return _launch_slurm(cfg)
    if OPTIONS.dry_run:
        print(f"site {cfg.site.name} runs {cfg.site.num_sites} processes here (submitit LocalExecutor): no sbatch file")
        return 0
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


def _launch_slurm(cfg: RunConfig) -> int:
    from geofed_hpc.config import to_dict
    from geofed_hpc.errors import UnavailableError
    from geofed_hpc.launch.executor import check_slurm_site, job_folder, sbatch_preview, site_names, site_run_dir
    from geofed_hpc.launch.manifest import record_jobs
    from geofed_hpc.launch.slurm import preflight, submit_site
    from geofed_hpc.rpc.client import PSClient

    check_slurm_site(cfg)
    run_dir = site_run_dir(cfg, strict=not OPTIONS.dry_run)
    if OPTIONS.dry_run:
        for index, name in enumerate(site_names(cfg)):
            print(f"# ---- {name}: {job_folder(run_dir, name) / '%j_submission.sh'} (not submitted)")
            print(sbatch_preview(cfg, index, run_dir))
        return 0
    if not cfg.ps.address:
        raise ConfigError("ps.address: Slurm site jobs dial the parameter server; set ps.address=host:port")
    preflight(cfg)
    try:
        with PSClient(replace(cfg.ps, connect_timeout=PS_PROBE_TIMEOUT)) as probe:
            probe.connect()
    except UnavailableError as exc:
        logger.warning("%s; submitting anyway: the jobs retry for ps.connect_timeout when they start", exc)
    records = submit_site(cfg, cfg.ps.address)
    manifest = record_jobs(run_dir, cfg.federation, cfg.ps.address, cfg.site.name, to_dict(cfg), records)
    for r in records:
        print(f"submitted {r.site}: job {r.job_id}\n  stdout {r.stdout}\n  stderr {r.stderr}", flush=True)
    print(f"run directory: {run_dir} (manifest {manifest.name}; checkpoints under sites/)")
    site = f"site={cfg.site.name}"
    print(f"next: geofed-hpc status {site} | geofed-hpc logs {site} --follow | geofed-hpc cancel {site}")
    return 0


def cmd_ps_up(cfg: RunConfig) -> int:
    from geofed_hpc.launch.progress import PSProgress
    from geofed_hpc.ps.app import ParameterServer

    def expand(path: str) -> str:
        return str(Path(path).expanduser()) if path else ""

    init_from = OPTIONS.init_from or cfg.ps.init_from
    ps_cfg = replace(cfg.ps, state_dir=expand(cfg.ps.state_dir), init_from=expand(init_from))
    server = ParameterServer(replace(cfg, ps=ps_cfg))
    logic = server.logic
    model = f"version {logic.version}" if logic.initialized else "no model yet (the first site uploads it)"
    if logic.rounds.count:  # a round that was open when the PS stopped, replayed from its journal
        n = logic.rounds.count
        model += f", open round of {n} delta{'s' if n != 1 else ''} restored"
    print(
        f"parameter server on {cfg.ps.host}:{server.port} ({'plaintext' if cfg.ps.insecure else 'TLS'}, "
        f"{cfg.ps.aggregation}, {model}); Ctrl-C or SIGTERM to stop",
        flush=True,
    )
    table = None if cfg.verbosity < 0 else PSProgress(sys.stdout)  # --quiet: no line per version

    def progress() -> None:
        if table is not None:
            table.poll(logic.applied_since(table.last), logic.global_val_loss())

    if table is not None:
        table.start(logic.version)
    server.wait_for_signal(progress)  # SIGTERM: finish pushes in flight, apply the open round, write a snapshot
    if table is not None:
        progress()
        table.flush()
    where = f", snapshot of version {logic.snapshot_version} in {ps_cfg.state_dir}" if ps_cfg.state_dir else ""
    print(f"parameter server stopped at version {logic.version}{where}", flush=True)
    return 0


def _launched_jobs(cfg: RunConfig, only_site: bool) -> tuple[Any, dict[str, Any]]:
    """The run directory's launch manifest and its newest job per site (of cfg.site only if `only_site`)."""
    from geofed_hpc.launch.executor import site_run_dir
    from geofed_hpc.launch.manifest import load_manifest

    run_dir = site_run_dir(cfg)
    manifest = load_manifest(run_dir)
    if manifest is None:
        if only_site:
            raise ConfigError(f"run_dir: nothing was launched into {run_dir} (no launch.json); check site=, run_dir=")
        return None, {}
    jobs = manifest.latest(cfg.site.name if only_site else None)
    if only_site and not jobs:
        launched = sorted({j.cluster_site for j in manifest.jobs})
        raise ConfigError(f"site: no {cfg.site.name} jobs in {run_dir}; launched there: {', '.join(launched)}")
    return manifest, jobs


def cmd_status(cfg: RunConfig) -> int:
    from geofed_hpc.rpc.client import PSClient

    manifest, jobs = _launched_jobs(cfg, only_site=False)
    if jobs:
        from geofed_hpc.launch.jobs import jobs_table
        from geofed_hpc.launch.slurm import job_states

        print(jobs_table(jobs, job_states([j.job_id for j in jobs.values()])))
        print()
    address = cfg.ps.address or (manifest.ps_address if manifest else "")
    with PSClient(cfg.ps, address or None) as client:
        client.connect()
        st = client.status()

    def ago(seconds: float) -> str:
        return "-" if seconds < 0 else f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"

    def size(n: int) -> str:
        return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"

    mode = st.aggregation + (f"/{st.outer_optimizer}" if st.outer_optimizer else "")
    mode += f"/{st.robust}" if st.robust not in ("", "none") else ""
    snapshot = f"v{st.snapshot_version}" if st.snapshot_version >= 0 else "none"
    print(
        f"version {st.version}  initialized {st.initialized}  mode {mode}  params {st.num_params:,}  "
        f"uptime {ago(st.uptime_s)}  sites {st.active_sites}/{len(st.sites)} active  pending deltas "
        f"{st.pending_deltas}  pushes in flight {st.pushes_in_flight}  snapshot {snapshot}  "
        f"updates kept {st.updates_kept}"
    )
    head = ("site", "state", "version", "pushes", "last push", "stale", "tokens", "received", "loss", "refused", "seen")
    print(f"{head[0]:<16}{head[1]:<8}" + "".join(f"{h:>11}" for h in head[2:]))
    for s in sorted(st.sites, key=lambda s: s.site):
        cells = [s.version, s.pushes, ago(s.last_push_s), s.last_staleness, f"{s.tokens:,}", size(s.bytes_received)]
        cells += [f"{s.last_train_loss:.4f}", s.refused, ago(s.last_seen_s)]
        print(f"{s.site:<16}{s.state:<8}" + "".join(f"{c!s:>11}" for c in cells))
    return 0


def cmd_cancel(cfg: RunConfig) -> int:
    from geofed_hpc.launch.slurm import cancel_jobs, job_states

    _, jobs = _launched_jobs(cfg, only_site=True)
    states = job_states([j.job_id for j in jobs.values()])
    live = [j.job_id for j in jobs.values() if states[j.job_id].active]
    cancel_jobs(live)
    for name, job in jobs.items():
        done = "cancelled (it checkpoints, then ends)" if job.job_id in live else f"already {states[job.job_id].state}"
        print(f"{name}: job {job.job_id} {done}")
    return 0


def cmd_logs(cfg: RunConfig) -> int:
    from geofed_hpc.launch.jobs import follow_logs, print_logs

    _, jobs = _launched_jobs(cfg, only_site=True)
    print_logs(jobs)
    if OPTIONS.follow:
        follow_logs(jobs)
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


def cmd_ps_init(cfg: RunConfig) -> int:
    from geofed_hpc.rpc.tls import describe, init_pki

    result = init_pki(cfg.ps, cfg.federation)
    f = result.files
    for path in result.created:
        print(f"wrote {path}")
    for path in result.kept:
        print(f"kept  {path} (exists)")
    print(describe(f.server_cert))
    print(
        f"\nPS:    geofed-hpc ps up ps=cloud ps.cert_file={f.server_cert} ps.key_file={f.server_key}"
        + (f" ps.client_ca_file={f.ca_cert}   # mutual TLS" if cfg.ps.tls_sites else "")
    )
    print(f"sites: copy {f.ca_cert} (public) to each site and pass ps.ca_file=<its path> ps.insecure=false")
    for site in cfg.ps.tls_sites:
        crt, key = f.site(site)
        print(f"       {site}: also copy {crt} and {key} (secret), pass ps.client_cert_file=... ps.client_key_file=...")
    print(f"keep {f.ca_key} secret: it signs certificates for this federation")
    return 0


def _token_file(cfg: RunConfig) -> Any:
    from geofed_hpc.ps.tokens import TokenFile, tokens_path

    return TokenFile(tokens_path(cfg.ps.state_dir))


def cmd_token_issue(cfg: RunConfig) -> int:
    from geofed_hpc.config import parse_duration

    if not OPTIONS.site_given:
        raise ConfigError("site: say which site the token admits, e.g. `geofed-hpc token issue site=osc`")
    ttl = parse_duration(OPTIONS.ttl, "--ttl") if OPTIONS.ttl else cfg.ps.token_ttl
    tokens = _token_file(cfg)
    token, record = tokens.issue(cfg.site.name, ttl)
    expires = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(record.expires)) if record.expires else "never"
    print(f"token {record.id} for site {record.site} (expires {expires}); stored as a hash in {tokens.path}")
    print("shown once; pass it to the site as site.token=... (keep it secret):")
    print(token)
    return 0


def cmd_token_revoke(cfg: RunConfig) -> int:
    if not OPTIONS.token_id and not OPTIONS.site_given:
        raise ConfigError("token revoke: name a token id (`token revoke ID`) or a site (`token revoke site=osc`)")
    site = "" if OPTIONS.token_id else cfg.site.name
    for r in _token_file(cfg).revoke(site=site, token_id=OPTIONS.token_id):
        print(f"revoked token {r.id} of site {r.site}; its sessions end at their next call")
    return 0


def cmd_token_list(cfg: RunConfig) -> int:
    from geofed_hpc.ps.tokens import token_table

    tokens = _token_file(cfg)
    records = tokens.read()
    print(token_table(records) if records else f"no tokens issued in {tokens.path}")
    return 0


def cmd_data_prepare(cfg: RunConfig) -> int:
    from geofed_hpc.data.shards import prepare_shards

    out = Path(cfg.run_dir).expanduser() / "data"
    index = prepare_shards(cfg.data, out, cfg.site.shards)
    tokens = sum(s.tokens for s in index.train) + (index.val.tokens if index.val else 0)
    print(f"{tokens:,} {index.dtype} tokens in {len(index.train)} site shards + validation under {out}")
    print(f"train with: data.source={out}")
    return 0


HANDLERS = {
    "launch": cmd_launch,
    "ps up": cmd_ps_up,
    "ps init": cmd_ps_init,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "logs": cmd_logs,
    "report": cmd_report,
    "wandb sync": cmd_wandb_sync,
    "token issue": cmd_token_issue,
    "token revoke": cmd_token_revoke,
    "token list": cmd_token_list,
    "data prepare": cmd_data_prepare,
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
        OPTIONS.token_id = ""
        command, overrides = _split(args.words)
        OPTIONS.dry_run, OPTIONS.follow = args.dry_run, args.follow
        OPTIONS.init_from, OPTIONS.ttl = args.init_from, args.ttl
        OPTIONS.site_given = any(o.startswith(("site=", "site.name=")) for o in overrides)
        if command == "launch" and len(_site_list(overrides)) > 1:
            return _launch_each(_site_list(overrides), overrides, args)
        cfg, yaml_text = compose_config(overrides)
        if args.cfg:
            print(yaml_text, end="")
            return 0
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
    except KeyboardInterrupt:
        print("geofed-hpc: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
