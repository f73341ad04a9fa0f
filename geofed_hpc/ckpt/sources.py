"""Where a trained model lives: a run's newest global model, a PS snapshot, a site checkpoint, or an export."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from geofed_hpc.ckpt.best import INDEX as BEST_INDEX
from geofed_hpc.ckpt.best import BestCheckpoints
from geofed_hpc.ckpt.store import CheckpointStore
from geofed_hpc.ckpt.tensorfile import read_meta
from geofed_hpc.errors import CheckpointError, ConfigError

SNAPSHOT = re.compile(r"^global-\d{9,}\.gft$")
SITE = re.compile(r"^site-\d{9,}\.gft$")
KINDS = (
    "a run directory, a PS snapshot (global-*.gft, or the folder holding them), a site checkpoint (site-*.gft, "
    "a site's ckpt/ folder for its latest, or ckpt/best/ for its best), or an exported Hugging Face folder "
    "(config.json and model.safetensors)"
)


@dataclass
class Located:
    """A model source: `kind` snapshot (`path` a global-*.gft, or a folder of them: the newest that loads), site
    (`path` a site-*.gft, or a ckpt/ folder: the newest that loads) or hf (`path` a Hugging Face folder, as
    `export hf` writes one)."""

    kind: Literal["snapshot", "site", "hf"]
    path: Path
    version: int
    shape: dict[str, Any] | None = None
    """The model and paradigm a site recorded (checkpoint meta "model"), for a snapshot one found in its run."""
    global_model: bool = False
    """Chosen as a run's global model: hybrid_lora's private adapters are left out."""
    meta: dict[str, Any] = field(default_factory=dict)
    run: Path | None = None
    """The run directory the model was found in (RUN, RUN/ps, RUN/sites/NAME/ckpt...), None outside one."""


def _meta(path: Path) -> dict[str, Any]:
    try:
        return read_meta(path)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None


def _newest(folder: Path, prefix: str) -> Path | None:
    files = CheckpointStore(folder, prefix=prefix).files()
    return files[-1][1] if files else None


def _site_shape(run: Path) -> dict[str, Any] | None:
    """The model a run's sites recorded (from the newest checkpoint of the first site that has one)."""
    for ckpt in sorted(run.glob("sites/*/ckpt")):
        newest = _newest(ckpt, "site")
        if newest is not None:
            shape = _meta(newest).get("model")
            if isinstance(shape, dict):
                return shape
    return None


def run_of(path: Path) -> Path | None:
    """The run directory a site checkpoint or its folder lies in (RUN/sites/NAME/ckpt[/best][/site-*.gft])."""
    for parent in list(Path(path).absolute().parents)[:4]:
        if parent.name == "sites":
            return parent.parent
    return None


def hf_folder(path: Path) -> bool:
    """True for a folder holding a Hugging Face model: config.json and model.safetensors (or its shards' index)."""
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    return path.is_dir() and (path / "config.json").is_file() and weights


def _site(path: Path, global_model: bool = False) -> Located:
    meta = _meta(path)
    shape = meta.get("model") if isinstance(meta.get("model"), dict) else None
    return Located("site", path, int(meta.get("version", 0)), shape, global_model, meta, run_of(path))


def _snapshot(path: Path, run: Path | None) -> Located:
    file = path if path.is_file() else _newest(path, "global")
    meta = _meta(file) if file else {}
    return Located("snapshot", path, int(meta.get("version", 0)), _site_shape(run) if run else None, True, meta, run)


def _run_global(run: Path) -> Located:
    """The newest global model of a run: its PS snapshots (ps/) or a site checkpoint that holds one."""
    found: list[tuple[int, int, Located]] = []
    snapshots = run / "ps"
    if _newest(snapshots, "global") is not None:
        snap = _snapshot(snapshots, run)
        found.append((snap.version, 1, snap))
    for ckpt in sorted(run.glob("sites/*/ckpt")):
        newest = _newest(ckpt, "site")
        best = [ckpt / "best" / str(e["file"]) for e in BestCheckpoints(ckpt / "best").entries()]
        for file in [newest, *best]:
            if file is None:
                continue
            meta = _meta(file)
            if meta.get("global_model"):
                found.append((int(meta.get("version", 0)), 0, _site(file, global_model=True)))
    if not found:
        raise ConfigError(
            f"{run}: the run holds no global model yet (no PS snapshot in ps/, no site checkpoint of a global model "
            "in sites/*/ckpt); give a site checkpoint instead, or --site NAME"
        )
    return max(found, key=lambda f: (f[0], f[1]))[2]


def locate(src: Path, site: str = "") -> Located:
    """The model that `src` (and `site`, a site of a run directory) names; ConfigError saying what it takes."""
    src = Path(src).expanduser()
    if not src.exists():
        raise ConfigError(f"{src} does not exist; give {KINDS}")
    if site:
        ckpt = src / "sites" / site / "ckpt"
        if not (src / "sites").is_dir():
            raise ConfigError(f"--site picks a site of a run directory, and {src} is none (it has no sites/ folder)")
        newest = _newest(ckpt, "site")
        if newest is None:
            names = ", ".join(sorted(p.name for p in (src / "sites").iterdir() if p.is_dir())) or "none"
            raise ConfigError(f"--site {site}: no checkpoint in {ckpt}; the sites of {src}: {names}")
        meta = _meta(newest)
        return Located("site", ckpt, int(meta.get("version", 0)), meta.get("model"), False, meta, src)
    if src.is_file():
        try:
            meta = {} if SNAPSHOT.match(src.name) or SITE.match(src.name) else _meta(src)
        except ConfigError as exc:
            raise ConfigError(f"{src} is none of {KINDS} ({exc})") from None
        if SNAPSHOT.match(src.name) or "sessions" in meta:
            return _snapshot(src, src.parent.parent if src.parent.name == "ps" else None)
        if SITE.match(src.name) or "syncs" in meta:
            return _site(src)
    elif hf_folder(src):
        return Located("hf", src, 0)
    elif (src / BEST_INDEX).is_file():
        entries = BestCheckpoints(src).entries()
        if entries:
            return _site(src / str(entries[0]["file"]))
    elif _newest(src, "global") is not None:
        return _snapshot(src, src.parent if src.name == "ps" else None)
    elif _newest(src, "site") is not None:
        newest = _newest(src, "site")
        assert newest is not None
        located = _site(newest)
        located.path, located.run = src, run_of(newest)
        return located
    elif (src / "sites").is_dir() or (src / "ps").is_dir():
        return _run_global(src)
    raise ConfigError(f"{src} is none of {KINDS}")
