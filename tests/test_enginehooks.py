"""The engine-process hooks of the sampling checks (specgate.vllmside.enginehooks), on the real vLLM
CPU ops: the released expand shim shows vLLM #55005 (a float32 or int32 output stays
untouched), the repair fills the caller's tensor as vLLM's Triton kernel would, and only while
an engine asked for it."""

from __future__ import annotations

from pathlib import Path

import pytest
import wheels

from specgate.vllmside import enginehooks


@pytest.fixture
def kernels(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    current_platform.import_kernels()   # the CPU build's _C ops, as an engine loads them
    monkeypatch.setattr(cpu_triton_utils, "_expand_kernel_impl", cpu_triton_utils._expand_kernel_impl)
    monkeypatch.setattr(enginehooks, "_installed", set())
    return cpu_triton_utils


def _expand(kernels, values, dtype_name):
    """Expand per-request values over [2, 3, 1] tokens, 0 replaced by 1 (the temperature call).
    dtypes by name: torch is imported by the tests that run, not by collecting the fast tier."""
    import torch

    dtype = getattr(torch, dtype_name)
    out = torch.full((6,), -7, dtype=dtype)
    kernels._expand_kernel_impl(out, torch.tensor(values, dtype=dtype), torch.tensor([2, 5, 6], dtype=torch.int32),
                                0, 1)
    return out.tolist()


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.vllm
def test_the_released_shim_leaves_the_callers_tensor_untouched_55005(kernels, dtype):
    assert _expand(kernels, [3, 0, 2], dtype) == [-7] * 6


@pytest.mark.parametrize("dtype", ["float32", "int32", "int64"])
@pytest.mark.vllm
def test_the_repair_expands_into_the_callers_tensor_only_while_active(kernels, dtype):
    enginehooks.install(record=False, repairs={"vllm-55005"})
    want = [3, 3, 1, 1, 1, 2]   # 0 (greedy) becomes 1
    with enginehooks.active(record=False, repair="vllm-55005"):
        assert _expand(kernels, [3, 0, 2], dtype) == want
    released = [-7] * 6 if dtype != "int64" else want    # int64 was never affected
    assert _expand(kernels, [3, 0, 2], dtype) == released


def test_an_unknown_repair_is_refused():
    with pytest.raises(ValueError, match="unknown repair"):
        enginehooks.install(record=False, repairs={"vllm-1"})


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.vllm
def test_the_repaired_builds_shim_expands_as_the_runtime_repair_does(kernels, dtype):
    """tests/wheels.py's #55006 change, applied to this vLLM's own shim source (the file the
    repaired wheel carries): the released text is there exactly once, and the result fills the
    caller's tensor."""
    import importlib.util

    path, old, new = wheels.REPAIRED_55005
    source = Path(kernels.__file__).read_text()
    assert path.endswith("cpu_triton_utils.py") and source.count(old) == 1
    spec = importlib.util.spec_from_loader("repaired_cpu_triton_utils", loader=None)
    repaired = importlib.util.module_from_spec(spec)
    exec(compile(source.replace(old, new), path, "exec"), repaired.__dict__)
    assert _expand(repaired, [3, 0, 2], dtype) == [3, 3, 1, 1, 1, 2]


@pytest.mark.vllm
def test_the_recorded_q_keeps_each_drafted_token_and_every_token_of_at_least_the_floor():
    """What the acceptance check reads of q: the drafted token's probability even below the floor
    (here 1e-7 and 0), and every other token's of at least Q_FLOOR (1e-6)."""
    import torch

    q = torch.tensor([[0.6, 0.4 - 1e-7, 1e-7, 0.0], [1e-8, 0.0, 0.0, 1.0 - 1e-8]])
    rows = enginehooks._sparse_rows(q, torch.tensor([2, 1]))
    assert [[token for token, _ in row] for row in rows] == [[0, 1, 2], [1, 3]]
    assert rows[0][2][1] == pytest.approx(1e-7) and rows[1][0][1] == 0.0
