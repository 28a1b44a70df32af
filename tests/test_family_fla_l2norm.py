"""fla's L2-norm kernels run with their row-length key fixed (treefx.families.fla_l2norm): only
where the kernel's body never reads that key. fla's kernels need a GPU or Triton's
interpreter: their values are checked through the tree paths by
``benchmarks/fla_check.py --cases exact`` (GPU; on the CPU under the interpreter by
``benchmarks/fla_tree_interpret.py``, removed in issue 67, its findings in BENCHMARKS.md)."""

from __future__ import annotations

import sys
import types

import pytest

from treefx.families import fla_l2norm

_FWD = '''def l2norm_fwd_kernel(x, y, rstd, eps, T, D: tl.constexpr, BD: tl.constexpr,
                      NB: tl.constexpr, BT: tl.constexpr):
    i_t = tl.program_id(0)
    {body}
'''


def _fake_fla(monkeypatch, body: str):
    """An ``fla.modules.l2norm`` whose kernels have ``body`` (the guard reads their source and
    parameters only; nothing is launched)."""
    names = ["x", "y", "rstd", "eps", "T", "D", "BD", "NB", "BT"]
    kernel = types.SimpleNamespace(fn=types.SimpleNamespace(src=_FWD.format(body=body)),
                                   arg_names=names)

    def wrapper(x, eps=1e-6, output_dtype=None):
        raise AssertionError("not launched here")

    mod = types.ModuleType("fla.modules.l2norm")
    mod.l2norm_fwd_kernel = mod.l2norm_bwd_kernel = kernel
    mod.l2norm_fwd = mod.l2norm_bwd = wrapper
    for name in ("fla", "fla.modules"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.modules.l2norm", mod)
    sys.modules["fla.modules"].l2norm = mod
    monkeypatch.setattr(fla_l2norm, "_FOUND", {})


def test_the_key_is_fixed_only_where_the_kernel_never_reads_it(monkeypatch):
    _fake_fla(monkeypatch,
              "p = tl.make_block_ptr(x, (T, D), (D, 1), (i_t * BT, 0), (BT, BD), (1, 0))")
    assert fla_l2norm.available()
    monkeypatch.setenv(fla_l2norm.ENV, "0")  # turned off: fla's own wrapper
    assert not fla_l2norm.available()
    monkeypatch.delenv(fla_l2norm.ENV)
    _fake_fla(monkeypatch, "p = x + i_t * BT * NB")  # the body reads NB: not the same kernel
    assert not fla_l2norm.available()


def test_without_fla_the_model_keeps_flas_own_path(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # import fla fails
    monkeypatch.setattr(fla_l2norm, "_FOUND", {})
    assert not fla_l2norm.available()


@pytest.mark.parametrize("missing", ["NB", "BT"])
def test_kernels_with_other_parameters_are_not_used(monkeypatch, missing):
    _fake_fla(monkeypatch, "pass")
    k = sys.modules["fla.modules.l2norm"].l2norm_fwd_kernel
    k.arg_names = [n for n in k.arg_names if n != missing]
    assert not fla_l2norm.available()
