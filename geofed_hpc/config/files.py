"""Where config files are found, first match wins: --config-dir folders, the user's folder, then the shipped conf/."""

from __future__ import annotations

import os
import re
from importlib import resources
from pathlib import Path

from geofed_hpc.errors import ConfigError

# Folders given with --config-dir on this command line (cli.main sets them), searched before the others.
GIVEN_DIRS: list[Path] = []
USER_DIR_NAME = "geofed-hpc"


def conf_dir() -> Path:
    """The shipped configuration directory (inside the installed package, or conf/ in a checkout)."""
    return Path(str(resources.files("geofed_hpc.conf")))


def user_config_dir() -> Path:
    """The user's own config folder: $XDG_CONFIG_HOME/geofed-hpc, by default ~/.config/geofed-hpc."""
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / USER_DIR_NAME


def config_dirs() -> list[Path]:
    """Every folder searched for config files, in order: --config-dir ones, the user's, the shipped one."""
    return [*GIVEN_DIRS, user_config_dir(), conf_dir()]


def config_groups() -> dict[str, list[str]]:
    """Each config group (the shipped folders of conf/) and its options from every searched folder."""
    groups = sorted(d.name for d in conf_dir().iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))
    return {g: sorted({p.stem for root in config_dirs() for p in (root / g).glob("*.yaml")}) for g in groups}


def option_file(group: str, option: str) -> Path | None:
    """The file that `group=option` reads (the first searched folder that has it), or None."""
    for root in config_dirs():
        path = root / group / f"{option}.yaml"
        if path.is_file():
            return path
    return None


def user_options(group: str) -> dict[str, Path]:
    """Options of `group` that come from a folder other than the shipped one, with their files."""
    found: dict[str, Path] = {}
    for root in config_dirs()[:-1]:
        for path in sorted((root / group).glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def new_site_file(name: str, force: bool = False) -> tuple[Path, Path]:
    """Write site/`name`.yaml into the first --config-dir (else the user's folder): a copy of the shipped site of that
    name, else of the template, with `name:` set. (its path, the file it came from); ConfigError when it exists
    (unless `force`) or the name is not one."""
    from geofed_hpc.paths import writable_dir

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
