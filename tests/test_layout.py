"""The package keeps its rooms (DESIGN §2): who may import torch, hydra, the generated stubs and sockets."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "geofed_hpc"


def importers(pattern: str) -> set[str]:
    rx = re.compile(pattern, re.MULTILINE)
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if rx.search(p.read_text())}


def test_only_cli_imports_hydra() -> None:
    assert importers(r"^\s*(from|import) (hydra|omegaconf)\b") == {"cli.py"}


def test_only_serde_imports_the_generated_protobuf_classes() -> None:
    users = importers(r"^\s*(from|import) .*geofed_pb2\b") - {"rpc/geofed_pb2_grpc.py"}
    assert users == {"rpc/serde.py"}


def test_ps_and_rpc_stay_in_their_rooms() -> None:
    assert not {f for f in importers(r"^\s*(import|from) (grpc|socket)\b") if f.startswith("ps/")}
    assert not {f for f in importers(r"^\s*(import|from) (numpy|torch)\b") if f.startswith("rpc/")}
    assert not importers(r"^\s*(import|from) (socket|grpc|geofed_hpc\.rpc)\b") & {"ps/aggregate.py"}


def test_launch_does_not_import_torch() -> None:
    code = (
        "import sys, geofed_hpc.launch.local, geofed_hpc.launch.slurm, geofed_hpc.launch.executor, "
        "geofed_hpc.launch.jobs, geofed_hpc.launch.manifest; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_only_the_strategy_factory_names_an_aggregation_mode() -> None:
    """ps/ asks its strategy (ps/strategy/) what a mode does; only the factory reads the mode's name."""
    factory = PACKAGE / "ps" / "strategy" / "__init__.py"
    compares = re.compile(r"aggregation\s*(==|!=|\bin\b|\bnot in\b)|\bmatch\s+[\w.]*aggregation")
    names = re.compile(r"""["'](sync|async|buffered)["']""")
    hits = [
        f"{p.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for p in sorted((PACKAGE / "ps").rglob("*.py"))
        if p != factory
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if compares.search(line) or names.search(line)
    ]
    assert hits == []
    assert names.search(factory.read_text())  # the check looks where the names are
