"""`ps up`, `ps init` and the `token` commands: the parameter server's side."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from geofed_hpc.commands.options import OPTIONS
from geofed_hpc.config import RunConfig
from geofed_hpc.errors import ConfigError
from geofed_hpc.paths import writable_dir


def cmd_ps_up(cfg: RunConfig) -> int:
    # everything this process makes (W&B's files, group logs) is its user's alone, whatever the code path that
    # makes it (the state directory's own files are made 0600 and 0700 explicitly as well)
    os.umask(0o077)
    # W&B's own service process writes the run's files: start one of this process's (with this umask) rather than
    # join one that the shell that started `ps up` handed down (wandb's WANDB_SERVICE)
    os.environ.pop("WANDB_SERVICE", None)
    # torch's C++ store and gloo warnings (a stack trace each time a peer of the group dies) before torch loads: the
    # PS logs each such failure itself, in one line (TORCH_CPP_LOG_LEVEL=WARNING brings them back)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from geofed_hpc.ckpt.objects import is_remote
    from geofed_hpc.launch.progress import PSProgress
    from geofed_hpc.ps.app import ParameterServer
    from geofed_hpc.ps.remote import local_state
    from geofed_hpc.ps.statedir import check_state_dir

    def expand(path: str) -> str:
        return str(Path(path).expanduser()) if path else ""

    def writable(path: str, setting: str) -> str:
        return str(writable_dir(path, setting)) if path else ""

    init_from = OPTIONS.init_from or cfg.ps.init_from
    remote = is_remote(cfg.ps.state_dir)  # s3://...: the state lives there, this folder is its working copy
    local, setting = local_state(cfg.ps), "ps.state_cache" if remote else "ps.state_dir"
    if local is not None and local.is_dir():  # refused before anything is written there
        check_state_dir(local, setting)  # when other users may write in it
    state_dir = cfg.ps.state_dir if remote else writable(str(local) if local else "", setting)
    cache = writable(str(local), setting) if remote else cfg.ps.state_cache
    staging_dir = writable(cfg.ps.staging_dir, "ps.staging_dir")
    init_from = expand(init_from)
    ps_cfg = replace(cfg.ps, state_dir=state_dir, state_cache=cache, staging_dir=staging_dir, init_from=init_from)
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
    if server.group is not None:  # formed (or joined) before the server started
        from geofed_hpc.ps.group.membership import describe

        print(f"PS group {describe(ps_cfg, server.group.joined)}; this PS is peer {cfg.ps.peer_rank}", flush=True)
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


def cmd_ps_init(cfg: RunConfig) -> int:
    from geofed_hpc.rpc.tls import describe, init_pki, tls_files

    files = tls_files(cfg.ps)
    for setting, path in (
        ("ps.ca_file", files.ca_cert),
        ("ps.cert_file", files.server_cert),
        ("ps.key_file", files.server_key),
    ):
        writable_dir(path.parent, setting)
    result = init_pki(cfg.ps, cfg.federation)
    f = result.files
    for path in result.created:
        print(f"wrote {path}")
    for path in result.kept:
        print(f"kept  {path} (exists)")
    if not result.created:
        print(
            "nothing to do: every file exists (keys are never overwritten silently; ps.tls_overwrite=true issues new "
            f"server and site keys from the same CA; move {f.ca_cert} and {f.ca_key} away for a new CA)"
        )
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
    from geofed_hpc.ps.statedir import check_state_dir
    from geofed_hpc.ps.tokens import TokenFile, tokens_path

    if cfg.ps.state_dir.startswith("s3://"):
        raise ConfigError(
            f"ps.state_dir: tokens of a PS whose state is in {cfg.ps.state_dir} are kept in its working folder: run "
            "this on the PS's machine with ps.state_dir=<its ps.state_cache>; the running PS uploads them"
        )
    path = tokens_path(cfg.ps.state_dir)
    writable_dir(path.parent, "ps.state_dir")
    check_state_dir(path.parent)  # the PS's private folder (0700), refused when others may write in it
    return TokenFile(path)


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
