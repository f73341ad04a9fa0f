"""What each `geofed-hpc` command does, given its typed config (cli.py parses the command line and composes the
config; nothing here imports Hydra)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from geofed_hpc.config import ModelConfig, ParadigmConfig, RunConfig, from_dict, to_dict
from geofed_hpc.errors import ConfigError
from geofed_hpc.log import logger

# Switches of this invocation that only some commands read (main sets them).
OPTIONS = argparse.Namespace(
    dry_run=False,
    follow=False,
    init_from="",
    ttl="",
    token_id="",
    site_given=False,
    paths=[],
    dtype="fp32",
    site="",
    force=False,
    prompt="",
    max_new_tokens=50,
    temperature=0.0,
    seed=0,
    model_given=False,
)
PS_PROBE_TIMEOUT = timedelta(seconds=5)


def cmd_launch(cfg: RunConfig) -> int:
    if cfg.site.executor == "slurm":
        return _launch_slurm(cfg)
    if OPTIONS.dry_run:
        print(f"site {cfg.site.name} runs {cfg.site.num_sites} processes here (submitit LocalExecutor): no sbatch file")
        return 0
    from geofed_hpc.launch.local import check_local_device, launch_local

    check_local_device(cfg)  # the sites run here: train.device=cuda without a GPU fails now, not in each job
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
    from geofed_hpc.data.prepare import prepare_shards
    from geofed_hpc.data.tokenizer import run_tokenizer

    out = Path(cfg.run_dir).expanduser() / "data"
    tok = run_tokenizer(cfg)
    index = prepare_shards(cfg.data, out, cfg.site.shards, tok)
    tokens = sum(s.tokens for s in index.train) + (index.val.tokens if index.val else 0)
    print(
        f"{tokens:,} {index.dtype} tokens (largest id {index.max_id:,}, tokenizer {tok.name}) in {len(index.train)} "
        f"site shards + validation under {out}"
    )
    print(f"train with: data.source={out}" + ("" if tok.name == "gpt2" else f" data.tokenizer={tok.name}"))
    return 0


def _model_config(cfg: RunConfig, shape: dict[str, Any] | None, where: str) -> ModelConfig:
    """The model a checkpoint recorded (model= may name it too, but not another one), else the composed one."""
    if shape is None:
        return cfg.model
    recorded = {k: v for k, v in shape.items() if k != "paradigm"}
    if OPTIONS.model_given and recorded.get("arch", cfg.model.arch) != cfg.model.arch:
        raise ConfigError(
            f"{where} holds a {recorded.get('arch')} model but model={cfg.model.name} is {cfg.model.arch}; "
            "leave model= out (the checkpoint records its model) or give the run's model"
        )
    return from_dict(ModelConfig, {**to_dict(cfg.model), **recorded, "init_from": ""})


def load_trained(cfg: RunConfig, src: str, site: str = "") -> tuple[ModelConfig, dict[str, Any], str]:
    """(model config, plain weights with adapters merged, a description) of the model `src` names: a run
    directory's newest global model (or --site's own), a PS snapshot, or a site checkpoint."""
    from geofed_hpc.ckpt import CheckpointStore, load_tensors
    from geofed_hpc.ckpt.sources import locate
    from geofed_hpc.paradigms.exchange import exchange_for
    from geofed_hpc.ps.persist import Snapshots, load_init

    where = locate(Path(src), site)
    path, meta = where.path, where.meta
    if where.kind == "snapshot":
        loaded = Snapshots(path).load() if path.is_dir() else None
        if path.is_dir() and loaded is None:
            raise ConfigError(f"{path}: none of its PS snapshots loads; give a site checkpoint instead")
        params, version = (loaded[0].params, loaded[0].version) if loaded else load_init(path)
        path = loaded[1] if loaded else path
        paradigm = str((loaded[0].settings if loaded else meta.get("settings", {})).get("paradigm", "identity"))
    else:
        latest = CheckpointStore(path, prefix="site").load_latest() if path.is_dir() else (*load_tensors(path), path)
        if latest is None:
            raise ConfigError(f"{path}: none of its site checkpoints loads")
        tensors, meta, path = latest
        params = {k[6:]: v for k, v in tensors.items() if k.startswith("model/")}
        version, paradigm = int(meta.get("version", 0)), str((meta.get("model") or {}).get("paradigm", "identity"))
    try:
        pcfg = ParadigmConfig.from_description(paradigm)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if pcfg.name == "hybrid_lora":  # the shared model, or a site's own with its private adapters merged
        merged = (
            exchange_for(pcfg).public(params)
            if where.global_model
            else exchange_for(replace(pcfg, name="lora")).merge(params)
        )
    else:
        merged = exchange_for(pcfg).merge(params)
    return _model_config(cfg, where.shape, str(path)), merged, f"{path} (version {version}, {paradigm})"


def _tokenizer_for(cfg: RunConfig, model: ModelConfig) -> Any:
    from geofed_hpc.data.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.data.tokenizer or model.tokenizer or "")
    if tok.vocab_size > model.vocab_size or model.vocab_size > tok.vocab_size + 4096:
        raise ConfigError(
            f"data.tokenizer: {tok.name} has {tok.vocab_size:,} ids but the model has {model.vocab_size:,}; give the "
            "run's tokenizer (data.tokenizer=PATH of its tokenizer.json)"
        )
    return tok


def cmd_export_hf(cfg: RunConfig) -> int:
    from geofed_hpc.ckpt.atomic import atomic_dir
    from geofed_hpc.models.export import write_model

    if len(OPTIONS.paths) != 2:
        raise ConfigError("export hf: give the source and the output folder: export hf SRC OUT [--dtype bf16]")
    src, out = OPTIONS.paths
    model, params, described = load_trained(cfg, src, OPTIONS.site)
    tok = _tokenizer_for(cfg, model)
    with atomic_dir(Path(out), OPTIONS.force) as folder:
        write_model(folder, model, params, OPTIONS.dtype, tok.bos_id, tok.eot_id, described)
        tok.save(folder, model.max_positions or model.context)
    print(f"exported {described} as a {model.arch} model ({OPTIONS.dtype}, tokenizer {tok.name}) to {out}")
    print(f"load it with: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_generate(cfg: RunConfig) -> int:
    import torch

    from geofed_hpc.models import build_model
    from geofed_hpc.models.generate import generate

    if len(OPTIONS.paths) != 1:
        raise ConfigError('generate: give one model source: generate SRC --prompt "..."')
    model_cfg, params, described = load_trained(cfg, OPTIONS.paths[0], OPTIONS.site)
    tok = _tokenizer_for(cfg, model_cfg)
    model = build_model(model_cfg, seed=0, init=False)
    missing = set(dict(model.named_parameters())) - set(params)
    if missing or set(params) - set(dict(model.named_parameters())):
        raise ConfigError(f"{described}: its tensors do not fit model={model_cfg.name} ({sorted(missing)[:3]}...)")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[name]))
    prompt = tok.encode(OPTIONS.prompt) or [tok.bos_id]
    new = generate(model, prompt, OPTIONS.max_new_tokens, OPTIONS.temperature, tok.eot_id, OPTIONS.seed)
    logger.info("generated %d tokens with %s", len(new), described)
    print(OPTIONS.prompt + tok.decode(new), flush=True)
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
    "export hf": cmd_export_hf,
    "generate": cmd_generate,
}
