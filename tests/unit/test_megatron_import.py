"""Megatron-core imported without TorchDynamo: its kernels compile on first call, as before."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from core.parallel.imports import _deferring  # noqa: E402  after the skip


def test_decorating_compiles_nothing_and_the_first_call_compiles_once() -> None:
    compiled: list[tuple[Any, dict[str, Any]]] = []

    def real(fn: Any, **options: Any) -> Any:
        compiled.append((fn, options))
        return lambda *a: ("compiled", fn(*a))

    deferred = _deferring(real)

    @deferred
    def double(x: int) -> int:
        return 2 * x

    @deferred(dynamic=True)
    def square(x: int) -> int:
        return x * x

    assert compiled == [] and double.__name__ == "double"
    assert double(3) == ("compiled", 6) and double(4) == ("compiled", 8)
    assert square(3) == ("compiled", 9)
    assert [(fn.__name__, options) for fn, options in compiled] == [("double", {}), ("square", {"dynamic": True})]


def test_a_module_is_compiled_at_once() -> None:
    seen: list[Any] = []
    module = torch.nn.Linear(2, 2)
    _deferring(lambda m, **o: seen.append(m) or "optimized")(module)
    assert seen == [module]


def test_megatron_imports_without_dynamo_and_torch_compile_is_restored() -> None:
    code = (
        "import sys, torch; real = torch.compile\n"
        "from core.parallel.imports import import_megatron; import_megatron()\n"
        "from megatron.core.jit import jit_fuser\n"
        "from megatron.core.fusions.fused_bias_gelu import bias_gelu\n"
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
        "assert torch.compile is real and jit_fuser is not real\n"
        "print(bias_gelu.__name__)\n"
    )
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "bias_gelu"
