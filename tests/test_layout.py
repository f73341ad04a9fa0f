"""The package keeps its rooms (DESIGN §2): who may import torch, hydra, the generated stubs and sockets."""

from __future__ import annotations

import ast
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


# The rooms each room may import (DESIGN §2); the core modules (errors, log, faults, paths) and config sit below all.
CORE = {"errors", "log", "faults", "config", "paths"}
ALLOWED = {
    "config": {"errors"},
    "codec": set(),
    "models": set(),
    "data": {"ckpt"},  # corpora and shard folders in object storage (ckpt/objects.py)
    "paradigms": {"models"},  # split learning cuts the model families' modules (paradigms/split.py)
    "ckpt": set(),
    "metrics": set(),
    "rpc": set(),
    "egress": {"ckpt", "rpc"},  # the paths a site takes to its PS: the relay forwards bytes, the spool carries calls
    "client": {"ckpt", "codec", "data", "egress", "metrics", "models", "paradigms", "rpc"},
    "ps": {"ckpt", "codec", "metrics", "paradigms", "rpc"},
    "launch": {"client", "metrics"},
    "commands": {"ckpt", "data", "egress", "launch", "metrics", "models", "paradigms", "ps", "rpc"},
    "cli": {"commands", "geofed_hpc"},
    "geofed_hpc": {"client"},  # the package's public API (Site, FederatedCallback), imported lazily
    "testing": {"metrics"},
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (at any depth of its body)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("geofed_hpc"):
                base = str(node.module)
                graph[name] |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names if a.name.startswith("geofed_hpc")}
    return graph


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "geofed_hpc"


def test_rooms_import_only_the_rooms_below_them() -> None:
    wrong = sorted(
        f"{a} imports {b}"
        for a, targets in import_graph().items()
        for b in targets
        if _room(a) != _room(b) and _room(b) not in CORE | ALLOWED.get(_room(a), set())
    )
    assert wrong == []


def test_production_code_never_imports_the_test_harness() -> None:
    users = {a for a, targets in import_graph().items() for b in targets if _room(b) == "testing"}
    assert {u for u in users if _room(u) != "testing"} == set()


def test_the_parameter_server_sees_only_the_numpy_side_of_a_paradigm() -> None:
    """...except the split-learning server part (DESIGN §2: paradigms/ for its math, ps/split/ serves it)."""
    graph = import_graph()
    seen = {b for a, targets in graph.items() if _room(a) == "ps" for b in targets if _room(b) == "paradigms"}
    assert seen <= {"geofed_hpc.paradigms", "geofed_hpc.paradigms.exchange", "geofed_hpc.paradigms.cutserver"}
    math = "geofed_hpc.paradigms.cutserver"
    users = {a for a, targets in graph.items() if math in targets and _room(a) == "ps"}
    assert users == {"geofed_hpc.ps.split.service"}


def test_a_ps_of_another_paradigm_never_loads_torch() -> None:
    code = "import sys, geofed_hpc.ps.app, geofed_hpc.ps.servicer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    cycles = []
    for start in graph:  # depth-first from every module: is it reachable from what it imports?
        stack, seen = list(graph[start]), set()
        while stack:
            node = stack.pop()
            if node == start:
                cycles.append(start)
                break
            if node not in seen and node in graph:
                seen.add(node)
                stack.extend(graph[node])
    assert cycles == []


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
