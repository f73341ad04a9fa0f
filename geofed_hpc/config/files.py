"""Where config files are found, first match wins: --config-dir folders, the user's folder, then the shipped conf/."""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

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


def check_list_items(path: Path) -> None:
    """ConfigError naming the line where a list item (`- ...`) of `path` is indented deeper than the item above it:
    YAML reads it as the rest of that item (`setup: [module load cuda - source venv]`), silently."""
    import yaml

    from geofed_hpc.errors import ConfigError

    text = path.read_text()
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return  # the composer's own error is reported where the file is read
    lines = text.splitlines()
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            stack += [v for pair in node.value for v in pair]
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                if isinstance(item, yaml.ScalarNode) and item.style is None:
                    for line in range(item.start_mark.line + 1, item.end_mark.line + 1):
                        if line < len(lines) and lines[line].lstrip().startswith("- "):
                            raise ConfigError(
                                f"{path}:{line + 1}: this `- ...` item is indented deeper than the one above it, so "
                                f"YAML reads it as part of that item ({item.value!r}); align the dashes"
                            )
                stack.append(item)
