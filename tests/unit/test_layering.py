"""The import rules of the architecture hold: checked on the source and in a real process."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "h5py", "zmq")
# Each third-party library has one home module (or package) in core/.
HOMES = {
    "zmq": {"core/wire/transport.py"},
    "msgpack": {"core/wire/protocol.py"},
    "h5py": {"core/checkpoint/hdf5.py", "core/data/build.py", "core/data/dataset.py", "core/model/gpt/data.py"},
    "megatron": {"core/parallel/megatron.py", "core/parallel/cpu_shim.py", "core/model/gpt/"},
    "prometheus_client": {"core/controller/metrics.py"},
    "submitit": {"launcher/slurm.py"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_core_never_imports_launcher() -> None:
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "core").rglob("*.py") if "launcher" in _imports(p)]
    assert offenders == []


def test_third_party_libraries_live_in_their_home_module() -> None:
    offenders = []
    for path in [*(REPO / "core").rglob("*.py"), *(REPO / "launcher").rglob("*.py")]:
        rel = str(path.relative_to(REPO))
        for lib, homes in HOMES.items():
            if lib in _imports(path) and not any(rel == h or (h.endswith("/") and rel.startswith(h)) for h in homes):
                offenders.append(f"{rel} imports {lib}")
    assert offenders == []


def test_launcher_source_imports_no_heavy_library() -> None:
    offenders = [f"{p.relative_to(REPO)}: {sorted(_imports(p) & set(HEAVY))}"
                 for p in (REPO / "launcher").rglob("*.py") if _imports(p) & set(HEAVY)]
    assert offenders == []


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return set(out.stdout.split())


def test_importing_the_cli_loads_no_heavy_library() -> None:
    loaded = _loaded_after("launcher.cli")
    assert loaded.isdisjoint(HEAVY), loaded & set(HEAVY)


def test_controller_loads_neither_torch_nor_h5py() -> None:
    loaded = _loaded_after("core.controller.group, core.controller.program, core.entrypoint")
    assert "zmq" in loaded  # the check would be vacuous if the module failed to load its transport
    assert loaded.isdisjoint({"torch", "h5py", "megatron"}), loaded & {"torch", "h5py", "megatron"}
