"""What `launch`, its --dry-run and `site check` check on the login node before anything waits in a queue."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

from geofed_hpc.ckpt import CheckpointStore, read_meta
from geofed_hpc.commands.footprint import check_run
from geofed_hpc.commands.footprint import run_command as login_query
from geofed_hpc.config import RunConfig
from geofed_hpc.config.fields import split_host_port
from geofed_hpc.config.run import shape_difference
from geofed_hpc.errors import ConfigError, GeofedError
from geofed_hpc.launch.executor import site_names
from geofed_hpc.paths import os_reason

PROBE_TIMEOUT = timedelta(seconds=3)
SLURM_TIMEOUT = timedelta(seconds=15)
Level = Literal["ok", "warning", "error"]
Runner = Callable[[Sequence[str]], "str | None"]


@dataclass
class Finding:
    """One check's verdict: `what` it looked at (model, data, checkpoints, ps, slurm) and a line for the user."""

    level: Level
    what: str
    message: str

    def line(self) -> str:
        return f"{self.level:<8} {self.what:<12} {self.message}"


def run_command(args: Sequence[str]) -> str | None:
    """stdout of a Slurm query, or None when the command is missing, fails or hangs."""
    return login_query(args, SLURM_TIMEOUT)


def check_model(cfg: RunConfig) -> list[Finding]:
    """model.init_from (its files and config.json) and the run's tokenizer against model.vocab_size."""
    from geofed_hpc.data.tokenizer import run_tokenizer
    from geofed_hpc.models.hfconfig import check_folder_config, checkpoint_files

    found = []
    model = cfg.model
    try:
        if model.arch == "hf":
            start = _hf_start(cfg)
        elif model.init_from:
            path = Path(model.init_from).expanduser()
            files = checkpoint_files(path)
            check_folder_config(model, path if path.is_dir() else path.parent)
            start = f"starts from {path} ({len(files)} safetensors file{'s' if len(files) != 1 else ''})"
        else:
            start = f"starts from random weights (seed {cfg.train.seed})"
        found.append(Finding("ok", "model", f"{model.name} ({model.arch}, paradigm {cfg.paradigm.name}) {start}"))
    except ConfigError as exc:
        found.append(Finding("error", "model", str(exc)))
    try:
        tok = run_tokenizer(cfg)
        found.append(Finding("ok", "tokenizer", f"{tok.name} ({tok.vocab_size:,} ids)"))
    except ConfigError as exc:
        found.append(Finding("error", "tokenizer", str(exc)))
    return found


def _hf_start(cfg: RunConfig) -> str:
    """model=hf: the architecture transformers makes of model.path's config.json, and where the weights start from."""
    from geofed_hpc.config.model import hf_weight_files
    from geofed_hpc.models.hfmodel import hf_config

    model = cfg.model
    kind = type(hf_config(model)).__name__.removesuffix("Config")  # transformers knows it (ConfigError otherwise)
    folder = Path(model.init_from or model.path).expanduser()
    files = hf_weight_files(folder) if folder.is_dir() else [folder]
    if not files:
        return f"is a {kind} from {model.path}, starting from random weights (seed {cfg.train.seed}): it has no weights"
    count = f"{len(files)} safetensors file{'s' * (len(files) != 1)}"
    return f"is a {kind} from {model.path}, starting from {folder} ({count})"


def _remote_data(source: str) -> Finding:
    """data.source in object storage: a prepared shard folder (its index.json there) or a raw corpus."""
    from geofed_hpc.data.remote import is_remote_shard_dir

    try:
        if is_remote_shard_dir(source):
            return Finding("ok", "data", f"{source}: each site job fetches its own shards (SHA-256 checked)")
    except ConfigError as exc:
        return Finding("error", "data", str(exc))
    return Finding("ok", "data", f"{source}: each site job downloads and tokenizes its part")


def check_data(cfg: RunConfig) -> list[Finding]:
    """A prepared data.source against the sites: enough shards for site.shards, the run's tokenizer, the vocabulary."""
    from geofed_hpc.data.shards import check_tokenizer, is_shard_dir, read_index
    from geofed_hpc.data.tokenizer import run_tokenizer

    source, site = cfg.data.source, cfg.site
    if source.startswith("s3://"):
        return [_remote_data(source)]
    if not is_shard_dir(source):
        return [
            Finding("ok", "data", f"{source}: each site job tokenizes its part (or `geofed-hpc data prepare` first)")
        ]
    folder = Path(source).expanduser()
    try:
        index = read_index(folder)
        if len(index.train) < site.shards:
            last = site.first_shard + site.num_sites - 1
            raise ConfigError(
                f"site.num_sites: sites {site.first_shard}..{last} of {site.shards} need {site.shards} train shards "
                f"but {folder} holds {len(index.train)}; prepare it again with `geofed-hpc data prepare "
                f"site.num_sites={site.shards} ...`, or launch fewer sites"
            )
        check_tokenizer(index, folder, run_tokenizer(cfg))
        if index.vocab_size > cfg.model.vocab_size or index.max_id >= cfg.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size: is {cfg.model.vocab_size} but {folder} holds ids up to {index.max_id} "
                f"(vocabulary {index.vocab_size}); model.vocab_size={max(index.vocab_size, index.max_id + 1)} would "
                "fit it, or use a model whose vocabulary covers the data's tokenizer"
            )
    except ConfigError as exc:
        return [Finding("error", "data", str(exc))]
    tokens = sum(s.tokens for s in index.train)
    text = f"{folder}: {len(index.train)} train shards ({tokens:,} tokens) for {site.shards} shard slots"
    if len(index.train) % site.shards:
        return [Finding("warning", "data", f"{text}: sites get unequal amounts of data")]
    return [Finding("ok", "data", text)]


def check_checkpoints(cfg: RunConfig, run_dir: Path) -> list[Finding]:
    """Each site's newest checkpoint in the run directory: the same model and paradigm, and not finished already."""
    found = []
    for name in site_names(cfg):
        folder = run_dir / "sites" / name / "ckpt"
        try:
            files = CheckpointStore(folder, prefix="site").files()
        except OSError as exc:
            found.append(Finding("error", "checkpoints", f"run_dir: cannot read {folder}: {os_reason(exc)}"))
            continue
        if not files:
            continue
        path = files[-1][1]
        try:
            meta = read_meta(path)
        except GeofedError as exc:
            found.append(Finding("warning", "checkpoints", f"{exc}; the site tries an older one"))
            continue
        recorded = meta.get("model") if isinstance(meta.get("model"), dict) else None
        diff = shape_difference(cfg, recorded)
        syncs, limit = int(meta.get("syncs", 0)), cfg.train.max_syncs
        if diff is not None:
            key, theirs, ours = diff
            message = (
                f"{path} is of another model ({key}={theirs!r}, this run has {ours!r}): give the run's settings, or "
                f"another run_dir to start afresh"
            )
            found.append(Finding("error", "checkpoints", message))
        elif limit and syncs >= limit:
            message = (
                f"{name} finished already in {run_dir} ({syncs} syncs of train.max_syncs={limit}): raise "
                f"train.max_syncs to train on, or give a new run_dir=... to start afresh"
            )
            found.append(Finding("error", "checkpoints", message))
        else:
            message = f"{name} resumes from {path.name} (version {meta.get('version', 0)}, {syncs} syncs)"
            found.append(Finding("ok", "checkpoints", message))
    return found or [Finding("ok", "checkpoints", f"none in {run_dir}: every site starts afresh")]


def check_ps(cfg: RunConfig, address: str, probe: bool = True) -> list[Finding]:
    """The PS addresses, the TLS files a site reads, its token, and (`probe`) each address dialled as the jobs will
    dial it: resolved, TLS or plaintext as configured, the CA and client certificate, and `site.token` shown to the
    PS (a Status call, which consumes nothing). A job that could not join is an error here, before any queue wait."""
    ps, found = cfg.ps, []
    if not address:
        who = "Slurm site jobs" if cfg.site.executor == "slurm" else "site jobs"
        return [Finding("error", "ps", f"ps.address: {who} dial the parameter server; set ps.address=host:port")]
    addresses = [a.strip() for a in address.split(",") if a.strip()]  # several: the peers of a group, nearest first
    hosts = []
    for each in addresses:
        try:
            hosts.append(split_host_port(each)[0])
        except ValueError as exc:
            return [Finding("error", "ps", f"ps.address: {exc}; give the PS's host:port, e.g. ps.address=vm:50051")]
    if not ps.insecure:
        for key in ("ca_file", "client_cert_file", "client_key_file"):
            value = getattr(ps, key)
            if value and not Path(value).expanduser().is_file():
                how = "copy the ca.crt that `geofed-hpc ps init` wrote on the PS" if key == "ca_file" else "copy it"
                text = f"ps.{key}: {Path(value).expanduser()} does not exist here; {how} to a folder the compute nodes "
                found.append(Finding("error", "tls", text + f"see and set ps.{key}=PATH"))
        found += _certificate_site(cfg)
    if not cfg.site.token and not ps.insecure:
        text = f"site.token is empty: where the PS issues tokens, run `geofed-hpc token issue site={cfg.site.name}`"
        found.append(Finding("warning", "token", text + " there and pass site.token=... here"))
    if any(h in ("localhost", "127.0.0.1", "::1") for h in hosts) and cfg.site.executor == "slurm":
        text = f"ps.address {address} is the compute node itself for a Slurm job (fine on a one-node test cluster); "
        found.append(Finding("warning", "ps", text + "give the PS's host name or IP address as compute nodes reach it"))
    if any(f.level == "error" for f in found):
        return found
    if not probe:
        return found + [Finding("ok", "ps", f"{address} (not probed: --no-ps-check)")]
    if cfg.site.executor == "local" and "direct" not in cfg.site.egress:
        return found + [_along_egress(cfg, address)]  # the jobs run here and take site.egress: probed so
    dialled = dial_each(cfg, address)
    if not cfg.site.token and all(f.level == "ok" for f in dialled):
        found = [f for f in found if f.what != "token"]  # the PS answered without one: it needs none
    return found + dialled


def _along_egress(cfg: RunConfig, address: str) -> Finding:
    """The PS probed along each path of site.egress in turn, as the local site jobs will reach it."""
    from geofed_hpc.egress.paths import try_path
    from geofed_hpc.errors import GeofedError

    failed = []
    for name in cfg.site.egress:
        try:
            route, rtt = try_path(name, cfg, address, PROBE_TIMEOUT)
        except GeofedError as exc:
            failed.append(f"{name}: {exc}")
            continue
        route.close()
        return Finding("ok", "ps", f"{address} answers by {name} (site.egress), round trip {rtt * 1e3:.0f} ms")
    return Finding("error", "ps", f"ps.address: {address} answers along no path of site.egress ({'; '.join(failed)})")


def dial_each(cfg: RunConfig, address: str) -> list[Finding]:
    """Each address of `address` ("a:port,b:port") dialled as a job dials it (see check_ps)."""
    addresses = [a.strip() for a in address.split(",") if a.strip()]
    return [_dial(cfg, each, split_host_port(each)[0]) for each in addresses]


NOT_YET = "; start it first, or pass --no-ps-check when it comes up later"


def _dial(cfg: RunConfig, address: str, host: str) -> Finding:
    """One PS address as a job dials it; an error naming the setting to change when the job could not join there."""
    from geofed_hpc.errors import AuthError, PermissionDeniedError, UnavailableError
    from geofed_hpc.ps.tokens import admits
    from geofed_hpc.rpc.client import PSClient
    from geofed_hpc.rpc.tls import diagnose

    try:
        socket.getaddrinfo(host, None)
    except OSError:
        return Finding("error", "ps", f"ps.address: host {host!r} of {address} does not resolve here; check its name")
    why = diagnose(address, cfg.ps, PROBE_TIMEOUT)
    if why:
        return Finding("error", "ps", why + (NOT_YET if why.startswith("nothing answers") else ""))
    mode = "plaintext" if cfg.ps.insecure else "TLS, certificate verified"
    try:
        with PSClient(cfg.ps, address) as client:
            reply = client.status(cfg.site.token)
    except AuthError as exc:
        if not cfg.site.token:
            text = f"site.token is empty and the parameter server at {address} needs one ({exc}): run `geofed-hpc "
            return Finding("error", "token", text + f"token issue site={cfg.site.name}` there, pass site.token=...")
        return Finding("error", "token", f"site.token: the parameter server at {address} refuses it ({exc})")
    except PermissionDeniedError as exc:
        return Finding("error", "tls", f"ps.client_cert_file: the parameter server at {address} refuses it ({exc})")
    except UnavailableError as exc:
        return Finding("error", "ps", f"{exc}{NOT_YET}")
    except GeofedError as exc:
        return Finding("error", "ps", f"the parameter server at {address} answers Status with an error: {exc}")
    if reply.caller_site and not admits(reply.caller_site, cfg.site.name):
        text = f"site.token: is an enrollment token of site {reply.caller_site!r}, not {cfg.site.name!r}: "
        return Finding("error", "token", text + f"issue one with `geofed-hpc token issue site={cfg.site.name}`")
    token = "token accepted" if cfg.site.token else "no token needed"
    return Finding("ok", "ps", f"{address} answers ({mode}; {token}; version {reply.version})")


def check_egress(cfg: RunConfig, run_dir: Path, address: str) -> list[Finding]:
    """site.egress against the last `site check` from a compute node (egress/check.py): an error naming the path to
    use when none of site.egress worked there."""
    from geofed_hpc.egress.check import load, verdict

    level, line = verdict(cfg, address, load(run_dir))
    found = [Finding(level, "egress", line)]
    site = cfg.site
    for path, given in (("relay", site.relay), ("tunnel", site.tunnel)):
        if given and path not in site.egress:
            text = f"site.{path} is set but site.egress=[{','.join(site.egress)}] does not try it: add {path} to it"
            found.append(Finding("warning", "egress", text))
    return found


def _certificate_site(cfg: RunConfig) -> list[Finding]:
    """Under mutual TLS, the client certificate must be issued for this site (the PS binds a certificate to its
    site's jobs): an error naming both when it is not."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    from geofed_hpc.ps.tokens import admits

    path = Path(cfg.ps.client_cert_file).expanduser() if cfg.ps.client_cert_file else None
    if path is None or not path.is_file():
        return []
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
    except (OSError, ValueError) as exc:
        return [Finding("error", "tls", f"ps.client_cert_file: {path} is not a PEM certificate ({exc})")]
    names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if names and not any(admits(n, cfg.site.name) for n in names):
        text = f"ps.client_cert_file: {path} was issued for {', '.join(names)}, not site {cfg.site.name}: on the PS, "
        return [Finding("error", "tls", text + f"`geofed-hpc ps init ps.tls_sites=[{cfg.site.name}]` issues its own")]
    return []


def check_slurm(cfg: RunConfig, run: Runner = run_command) -> list[Finding]:
    """site.partition in `sinfo`'s list, site.account among the user's associations (`sacctmgr`, where present)."""
    site, found = cfg.site, []
    if shutil.which("sbatch") is None:
        text = "sbatch is not on PATH here: `launch` needs it (run on the login node, or `module load slurm` first)"
        found.append(Finding("warning", "slurm", text))
    listed = run(["sinfo", "-h", "-o", "%P"])
    if listed is None:
        found.append(Finding("warning", "slurm", "sinfo does not answer here: site.partition is not checked"))
    else:
        partitions = sorted({p.strip().rstrip("*") for p in listed.split() if p.strip()})
        if site.partition not in partitions:
            message = f"site.partition: {site.partition!r} is not a partition here; sinfo lists {', '.join(partitions)}"
            found.append(Finding("error", "slurm", message))
        else:
            found.append(Finding("ok", "slurm", f"partition {site.partition} exists"))
    if site.account:
        user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
        assoc = run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account"]) if user else None
        accounts = sorted({a.strip() for a in (assoc or "").split() if a.strip()})
        if assoc is None or not accounts:
            found.append(Finding("warning", "slurm", "sacctmgr does not answer here: site.account is not checked"))
        elif site.account.lower() not in [a.lower() for a in accounts]:
            message = f"site.account: {site.account!r} is not one of {user}'s accounts here: {', '.join(accounts)}"
            found.append(Finding("error", "slurm", message))
        else:
            found.append(Finding("ok", "slurm", f"account {site.account} is one of {user}'s"))
    return found


def preflight(cfg: RunConfig, run_dir: Path, address: str, probe: bool = True) -> list[Finding]:
    """Every check for this site config; the PS's only when the sites dial one (not an embedded PS)."""
    if cfg.script:  # launch script=: the script brings its own model, data and checkpoints
        found = [Finding("ok", "script", f"{cfg.script[0]} runs in each site's job (geofed_hpc.Site)")]
    else:
        found = check_model(cfg) + check_data(cfg) + check_checkpoints(cfg, run_dir)
    if not cfg.site.embedded_ps:
        found += check_ps(cfg, address, probe) + check_egress(cfg, run_dir, address)
    if cfg.site.executor == "slurm":
        found += check_slurm(cfg)
    if not cfg.script:
        found += [Finding(*v) for v in check_run(cfg, run_dir)]  # the demo corpus on Slurm; checkpoints vs disk
    return found


def first_error(found: Sequence[Finding]) -> ConfigError | None:
    """The first error as the ConfigError a command ends with (the others are shown as lines)."""
    errors = [f for f in found if f.level == "error"]
    if not errors:
        return None
    more = f" (and {len(errors) - 1} more: `geofed-hpc site check` lists them)" if len(errors) > 1 else ""
    return ConfigError(errors[0].message + more)
