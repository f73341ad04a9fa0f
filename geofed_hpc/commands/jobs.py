"""`launch`, `site new`, `site check`, `status`, `cancel` and `logs`: site jobs from their config to their logs."""

from __future__ import annotations

import re
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import RunConfig
from geofed_hpc.config.files import GIVEN_DIRS, conf_dir, user_config_dir
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger
from geofed_hpc.paths import writable_dir

# How long `status` of a local run looks for the PS its `launch` embedded (it is gone once that launch ended).
EMBEDDED_WAIT = timedelta(seconds=2)
# How long `status` waits for a PS that does not answer (ps.connect_timeout, when given, instead): a person waits.
STATUS_WAIT = timedelta(seconds=5)


def _checked(found: list[Any]) -> None:
    """Preflight warnings as log lines; the first error ends the command (exit code 2, one line)."""
    from geofed_hpc.commands.preflight import first_error

    for f in found:
        if f.level == "warning":
            logger.warning("%s: %s", f.what, f.message)
    error = first_error(found)
    if error is not None:
        raise error


def cmd_launch(cfg: RunConfig) -> int:
    if cfg.site.executor == "slurm":
        return _launch_slurm(cfg)
    from geofed_hpc.commands.preflight import first_error, preflight

    run_dir = Path(cfg.run_dir).expanduser().resolve()
    address = "" if cfg.site.embedded_ps else cfg.ps.dial_address()
    if OPTIONS.dry_run:
        print(f"site {cfg.site.name} runs {cfg.site.num_sites} processes here (submitit LocalExecutor): no sbatch file")
        found = preflight(cfg, run_dir, address, probe=OPTIONS.ps_check)
        from geofed_hpc.commands.preflight import Finding
        from geofed_hpc.launch.local import check_local_device

        try:
            check_local_device(cfg)  # the sites would run here: as launch checks it
        except ConfigError as exc:
            found.insert(0, Finding("error", "device", str(exc)))
        print("\n".join(f"# {f.line()}" for f in found))
        error = first_error(found)
        if error is not None:
            raise error
        return 0
    from geofed_hpc.launch.local import check_local_device, launch_local
    from geofed_hpc.paths import writable_dir

    check_local_device(cfg)  # the sites run here: train.device=cuda without a GPU fails now, not in each job
    run_dir = writable_dir(run_dir, "run_dir")
    _checked(preflight(cfg, run_dir, address, probe=False))  # the PS is probed below, by connecting
    from geofed_hpc.ckpt.objects import is_remote
    from geofed_hpc.ps.app import ParameterServer

    cfg = replace(cfg, run_dir=str(run_dir))
    ps = None
    if cfg.site.embedded_ps:
        remote = is_remote(cfg.ps.state_dir)  # s3://...: the PS keeps its working folder (ps.state_cache) itself
        state_dir = (
            cfg.ps.state_dir if remote else str(writable_dir(cfg.ps.state_dir or run_dir / "ps", "ps.state_dir"))
        )
        ps = ParameterServer(replace(cfg, ps=replace(cfg.ps, state_dir=state_dir)))
        address = ps.address
        print(f"parameter server (embedded) on {address}, state in {state_dir}", flush=True)
    else:
        from geofed_hpc.egress.paths import choose

        # along site.egress, as the site jobs will dial it (a compute node may reach it only by proxy, relay, ...)
        with choose(cfg, address) as route, route.connect() as probe:
            probe.connect()  # waits up to ps.connect_timeout for a PS that is starting
            direct = route.path == "direct"
        if OPTIONS.ps_check and direct:  # the TLS and token checks dial the PS directly
            from geofed_hpc.commands.preflight import dial_each

            _checked(dial_each(cfg, address))  # as each site will: TLS, CA, and site.token shown to the PS
    try:
        launch_local(cfg, address)
    finally:
        if ps is not None:
            ps.stop()
    print(f"run directory: {run_dir} (W&B offline runs under {run_dir / 'metrics' / 'wandb'})", flush=True)
    return 0


def _launch_slurm(cfg: RunConfig) -> int:
    from geofed_hpc.commands.preflight import first_error, preflight
    from geofed_hpc.config import to_dict
    from geofed_hpc.launch.executor import (
        check_slurm_site,
        federation_summary,
        job_folder,
        sbatch_preview,
        site_names,
        site_run_dir,
    )
    from geofed_hpc.launch.manifest import record_jobs
    from geofed_hpc.launch.slurm import require_slurm, submit_site
    from geofed_hpc.paths import writable_dir

    check_slurm_site(cfg)
    run_dir = site_run_dir(cfg, strict=not OPTIONS.dry_run)
    if not OPTIONS.dry_run:
        require_slurm(cfg)  # sbatch and srun: before the slower checks
        writable_dir(run_dir, "site.run_dir" if cfg.site.run_dir else "run_dir")
    found = preflight(cfg, run_dir, cfg.ps.address, probe=OPTIONS.ps_check)
    if OPTIONS.dry_run:
        from geofed_hpc.log import hide_passwords

        print("\n".join(f"# {line}" for line in federation_summary(cfg, run_dir)))
        if cfg.site.relay == "job":
            from geofed_hpc.commands.egress import relay_job_plan

            lines, cfg = relay_job_plan(cfg, run_dir)
            print("\n".join(f"# {line}" for line in lines))
        print("# preflight (`geofed-hpc site check` runs it alone):")
        print("\n".join(f"#   {f.line()}" for f in found))
        for index, name in enumerate(site_names(cfg)):
            print(f"# ---- {name}: {job_folder(run_dir, name) / '%j_submission.sh'} (not submitted)")
            print(hide_passwords(sbatch_preview(cfg, index, run_dir)))  # site.proxy's password: never on screen
        error = first_error(found)
        if error is not None:
            raise error
        return 0
    _checked(found)
    relayed: list[Any] = []
    if cfg.site.relay == "job":  # the relay first, on a partition with egress; the sites start once it runs
        from geofed_hpc.commands.egress import start_relay_job

        cfg, relay = start_relay_job(cfg, run_dir)
        relayed.append(relay)
    records = submit_site(cfg, cfg.ps.address) + relayed
    manifest = record_jobs(run_dir, cfg.federation, cfg.ps.address, cfg.site.name, to_dict(cfg), records)
    for r in records:
        print(f"submitted {r.site}: job {r.job_id}\n  stdout {r.stdout}\n  stderr {r.stderr}", flush=True)
    print(f"run directory: {run_dir} (manifest {manifest.name}; checkpoints under sites/)")
    site = f"site={cfg.site.name}"
    print(f"next: geofed-hpc status {site} | geofed-hpc logs {site} --follow | geofed-hpc cancel {site}")
    return 0


def cmd_site_check(cfg: RunConfig) -> int:
    """The launch preflight alone: one line per check; exit code 2 when one fails."""
    from geofed_hpc.commands.preflight import first_error, preflight
    from geofed_hpc.launch.executor import check_slurm_site, site_run_dir

    if not OPTIONS.site_given:
        raise ConfigError("site: say which site to check, e.g. `geofed-hpc site check site=osc ps.address=HOST:PORT`")
    if cfg.site.executor == "slurm":
        check_slurm_site(cfg)
        run_dir = site_run_dir(cfg)
        address = cfg.ps.address
    else:
        run_dir = Path(cfg.run_dir).expanduser().resolve()
        address = "" if cfg.site.embedded_ps else cfg.ps.dial_address()
    if OPTIONS.ps_check and address:  # site.egress tried where the jobs run; the preflight reads the result
        from geofed_hpc.commands.egress import check_paths
        from geofed_hpc.errors import GeofedError

        try:
            for line in check_paths(cfg, run_dir, address):
                print(line, flush=True)
        except GeofedError as exc:  # the login node's checks below still tell what they can
            print(f"warning  egress       could not probe the paths from a compute node: {exc}", flush=True)
    found = preflight(cfg, run_dir, address, probe=OPTIONS.ps_check)
    for f in found:
        print(f.line(), flush=True)
    error = first_error(found)
    if error is not None:
        raise error
    print(f"site {cfg.site.name}: ready to launch")
    return 0


def cmd_site_new(cfg: RunConfig) -> int:
    if len(OPTIONS.paths) != 1:
        raise ConfigError("site new: give the new site's name: `geofed-hpc site new mycluster`")
    path, source = new_site_file(OPTIONS.paths[0], OPTIONS.force)
    name = path.stem
    print(f"wrote {path} (from {source}); edit partition, account, gpus_per_node, setup and run_dir, then:")
    print(f"  geofed-hpc site check site={name} ps=cloud ps.address=HOST:50051 ps.ca_file=PATH site.token=TOKEN")
    print(f"  geofed-hpc launch site={name} ps=cloud ps.address=HOST:50051 ps.ca_file=PATH site.token=TOKEN --dry-run")
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


def as_launched(cfg: RunConfig, manifest: Any) -> RunConfig:
    """`cfg` with the PS settings (address, TLS, CA, client certificate) and site.token that `launch` recorded for
    this site, where this command line does not set them: `status site=osc` dials the PS as osc's jobs do."""
    from geofed_hpc.config import from_dict, to_dict

    recorded = manifest.configs.get(cfg.site.name) if manifest is not None else None
    if not isinstance(recorded, dict):
        return cfg
    plain = to_dict(cfg)
    given = set(OPTIONS.given)
    for key, value in (recorded.get("ps") or {}).items():
        if f"ps.{key}" not in given and key in plain["ps"]:
            plain["ps"][key] = value
    if "site.token" not in given and "token" in (recorded.get("site") or {}):
        plain["site"]["token"] = recorded["site"]["token"]
    return from_dict(RunConfig, plain)


def cmd_status(cfg: RunConfig) -> int:
    from geofed_hpc.errors import UnavailableError
    from geofed_hpc.rpc.client import PSClient

    manifest, jobs = _launched_jobs(cfg, only_site=False)
    cfg = as_launched(cfg, manifest)
    if jobs:
        from geofed_hpc.errors import LaunchError
        from geofed_hpc.launch.jobs import jobs_table, states_of

        try:
            print(jobs_table(jobs, states_of(jobs)))
        except LaunchError as exc:  # not on the cluster: the PS's view still helps
            print(f"site jobs {', '.join(jobs)}: state unknown: {exc}")
        from geofed_hpc.egress.paths import recorded
        from geofed_hpc.launch.executor import site_run_dir
        from geofed_hpc.log import hide_passwords

        for name, took in recorded(site_run_dir(cfg)).items():  # site.egress: the path each job took to the PS
            detail = hide_passwords(took.get("detail", ""))
            print(f"{name}: reaches the parameter server by {took.get('path', '?')} ({detail})")
        print()
    address = cfg.ps.address or (manifest.ps_address if manifest else "")
    if not address and not cfg.ps.port:
        where = f"{manifest.run_dir}'s launch.json names none" if manifest else "no launch.json in run_dir names one"
        raise ConfigError(
            f"ps.address: say where the parameter server listens, e.g. `geofed-hpc status ps.address=vm:50051` "
            f"({where})"
        )
    embedded = cfg.site.embedded_ps and not cfg.ps.address and manifest is not None
    with PSClient(cfg.ps, address or None) as client:
        try:
            asked = "ps.connect_timeout" in OPTIONS.given
            client.connect(EMBEDDED_WAIT if embedded else cfg.ps.connect_timeout if asked else STATUS_WAIT)
        except UnavailableError:
            if not embedded:
                raise
            print(f"parameter server: embedded in `launch` at {address}, which has ended (it runs while launch does)")
            return 0
        st = client.status(_status_credential(cfg))

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
        f"{st.pending_deltas}  pushes in flight {st.pushes_in_flight}  streams {st.streams}  snapshot {snapshot}  "
        f"updates kept {st.updates_kept}"
    )
    head = ("site", "state", "version", "pushes", "last push", "stale", "tokens", "received", "loss", "refused", "seen")
    print(f"{head[0]:<16}{head[1]:<8}" + "".join(f"{h:>11}" for h in head[2:]))
    quiet_after = 3 * cfg.ps.heartbeat_interval.total_seconds()  # a running site is heard from every interval
    for s in sorted(st.sites, key=lambda s: s.site):
        cells = [s.version, s.pushes, ago(s.last_push_s), s.last_staleness, f"{s.tokens:,}", size(s.bytes_received)]
        cells += [f"{s.last_train_loss:.4f}" if s.pushes else "-", s.refused, ago(s.last_seen_s)]
        state = "quiet" if s.state == "active" and s.last_seen_s > quiet_after else s.state  # stopped, or cut off
        print(f"{s.site:<16}{state:<8}" + "".join(f"{c!s:>11}" for c in cells))
    if st.peers:  # one of a PS group
        members = sum(p.member for p in st.peers)
        rate = st.allreduce_bytes / st.allreduce_s / 1e6 if st.allreduce_s > 0 else 0.0
        print(
            f"\nPS group generation {st.group_generation}: {members} of {len(st.peers)} peers, "
            f"{st.identical_versions} versions identical on every peer; last all-reduce {size(st.allreduce_bytes)} "
            f"in {st.allreduce_s:.3f}s ({rate:.1f} MB/s, {ago(st.allreduce_ago_s)} ago)"
        )
        print(f"{'peer':<24}{'member':<8}{'version':>9}  digest")
        for p in st.peers:
            print(f"{p.address:<24}{'yes' if p.member else 'gone':<8}{p.version if p.member else '-':>9}  {p.digest}")
    return 0


def _status_credential(cfg: RunConfig) -> str:
    """What `status` shows the PS: the operator's admin token when its state directory is here (on the PS's
    machine), else the site's enrollment token (site.token); "" for a PS that needs none."""
    from geofed_hpc.errors import CheckpointError
    from geofed_hpc.ps.remote import local_state
    from geofed_hpc.ps.statedir import admin_token

    local = local_state(cfg.ps)  # ps.state_dir, or the working folder of a state on object storage
    if local is not None:
        try:
            admin = admin_token(local, create=False)
        except (CheckpointError, OSError):
            admin = ""  # not the PS's machine, or not readable by this user: the site's token
        if admin:
            return admin
    return cfg.site.token


def cmd_cancel(cfg: RunConfig) -> int:
    import os
    import signal

    from geofed_hpc.launch.jobs import states_of
    from geofed_hpc.launch.slurm import cancel_jobs

    _, jobs = _launched_jobs(cfg, only_site=True)
    states = states_of(jobs)
    live = [j.job_id for j in jobs.values() if states[j.job_id].active]
    local = {j.job_id for j in jobs.values() if j.executor == "local"}
    cancel_jobs([j for j in live if j not in local])
    for job_id in (j for j in live if j in local):  # its controller hands SIGTERM to the site, as scancel does
        os.kill(int(job_id), signal.SIGTERM)
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


def new_site_file(name: str, force: bool = False) -> tuple[Path, Path]:
    """Write site/`name`.yaml into the first --config-dir (else the user's folder): a copy of the shipped site of that
    name, else of the template, with `name:` set. (its path, the file it came from); ConfigError when it exists
    (unless `force`) or the name is not one."""
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"site new: {name!r} is not a site name (letters, digits, _ . -)")
    folder = writable_dir((GIVEN_DIRS[0] if GIVEN_DIRS else user_config_dir()) / "site", "site new")
    path = folder / f"{name}.yaml"
    if path.exists() and not force:
        raise ConfigError(f"site new: {path} exists; edit it, or pass --force to write it again")
    shipped = conf_dir() / "site"
    source = shipped / f"{name}.yaml" if (shipped / f"{name}.yaml").is_file() else shipped / "template.yaml"
    text = re.sub(r"(?m)^name:[ \t]*\S*", f"name: {name}", source.read_text(), count=1)
    header = f"# Site {name}: written by `geofed-hpc site new {name}` from {source.name}; check it with\n"
    header += f"# `geofed-hpc site check site={name} ps.address=HOST:PORT` before `launch site={name}`.\n"
    path.write_text(header + text)
    return path, source
