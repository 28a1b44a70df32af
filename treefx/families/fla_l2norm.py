"""fla's L2 norm of query and key, tuned once per head width instead of once per row length.

Gated DeltaNet L2-normalises query and key per head before the recurrence (Qwen3-Next and
Qwen3.5 pass ``use_qk_l2norm_in_kernel=True``); fla 0.4.2 does it with its own Triton kernels
(``fla.modules.l2norm``). Their wrapper passes the kernels ``NB = cdiv(rows, 65,536)``, a
compile-time constant that the kernels' bodies never read and that is part of their
autotuning key. So every new band of row lengths (2,048 tokens at 32 heads) autotunes both
kernels again, 25 configurations each, compiling every one, which took a minute and more
at a new length (``benchmarks/fla_tree_check``'s packed case; BENCHMARKS.md, "Hybrids on fla's
kernels"), and a run over
real agent trees (10k-120k tokens) meets a new band at most steps for a long while.

Here the same two kernels run with ``NB`` fixed, so they are tuned and compiled once per head
width and dtype: the arithmetic is fla's (the same kernel body; which configuration the tuning
picks may change the order of a row's sum, as fla's own tuning at another length may). Used
by the one-pass tree path (:mod:`.fla_tree`) and by fla's depth-by-depth call
(:func:`.fla.gated_delta_rule`, which then hands fla query and key already normalised). An
fla whose kernels are not these (the row-length key a parameter that the kernel's body never
reads, checked on its source), or a head wider than the kernels' limit (512), keeps fla's own
wrapper.
"""

from __future__ import annotations

import inspect
import re

import torch

from ..options import Options, current

__all__ = ["ENV", "FIXED_NB", "L2Norm", "available", "l2norm", "l2norm_bwd", "l2norm_fwd"]

# 0: fla's own L2-norm wrapper (a tuning per band of row lengths)
ENV = Options.env_name("fla_l2norm")

FIXED_NB = 1  # the constant handed to fla's kernels in place of cdiv(rows, 65,536)
EPS = 1e-6  # fla's default, which chunk_gated_delta_rule uses
_WIDEST = 512  # fla runs wider heads on other kernels (no row-length key)

_FOUND: dict = {}


def _source(kernel) -> str | None:
    """A Triton kernel's source (through its autotuner; compiled or under the interpreter)."""
    f = kernel
    for _ in range(4):
        src = getattr(f, "src", None)
        if isinstance(src, str):
            return src
        if inspect.isfunction(f):  # under the interpreter: from its def (no decorators)
            src = inspect.getsource(f)
            start = re.search(r"^\s*def\s", src, re.MULTILINE)
            return src[start.start():] if start else None
        f = getattr(f, "fn", None)
    return None


def _kernels():
    """(forward kernel, backward kernel, fla's wrappers), or None where fla's kernels are not
    the ones described above: the row-length key ``NB`` must be a parameter the kernel's body
    never reads (checked on its source), which makes a fixed value sound."""
    if "k" in _FOUND:
        return _FOUND["k"]
    found = None
    try:
        from fla.modules import l2norm as mod

        fwd, bwd = mod.l2norm_fwd_kernel, mod.l2norm_bwd_kernel
        for k in (fwd, bwd):
            src = _source(k)
            if (src is None or not {"NB", "T", "D", "BD", "BT", "eps"} <= set(k.arg_names)
                    or len(re.findall(r"\bNB\b", src)) != 1):
                raise TypeError("fla's l2norm kernels are not the checked ones")
        for f in (mod.l2norm_fwd, mod.l2norm_bwd):
            if "eps" not in inspect.signature(f).parameters:
                raise TypeError("fla's l2norm wrappers are not the checked ones")
        found = (fwd, bwd, mod.l2norm_fwd, mod.l2norm_bwd)
    except (ImportError, AttributeError, TypeError, ValueError, OSError):
        found = None
    _FOUND["k"] = found
    return found


def available() -> bool:
    """Whether the fixed-key kernels run: fla with the kernels described above, and not turned
    off (``TREEFX_FLA_L2NORM=0``: fla's own wrapper and keys, as before)."""
    if not current().fla_l2norm:
        return False
    return _kernels() is not None


def _block(x: torch.Tensor) -> int:
    import triton

    return triton.next_power_of_2(x.shape[-1])


def l2norm_fwd(x: torch.Tensor, eps: float = EPS):
    """(x / ||x|| over the last dim, in x's dtype; 1 / ||x|| per row, float32): fla's
    ``l2norm_fwd`` with its row-length key fixed."""
    fwd, _, fla_fwd, _ = _kernels()
    d = x.shape[-1]
    if d > _WIDEST:
        return fla_fwd(x, eps=eps)
    shape = x.shape
    x = x.contiguous().view(-1, d)  # the kernels read rows of d elements end to end
    y = torch.empty_like(x)
    rows = x.shape[0]
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    fwd[lambda meta: (-(-rows // meta["BT"]),)](
        x=x, y=y, rstd=rstd, eps=eps, T=rows, D=d, BD=_block(x), NB=FIXED_NB)
    return y.view(shape), rstd.view(shape[:-1])


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor, eps: float = EPS):
    """The gradient of x for ``dy``, from :func:`l2norm_fwd`'s output and ``rstd``: fla's
    ``l2norm_bwd`` with its row-length key fixed."""
    _, bwd, _, fla_bwd = _kernels()
    d = y.shape[-1]
    if d > _WIDEST:
        return fla_bwd(y, rstd, dy, eps=eps)
    shape = y.shape
    y, dy = y.contiguous().view(-1, d), dy.contiguous().view(-1, d)
    dx = torch.empty_like(y)
    rows = y.shape[0]
    bwd[lambda meta: (-(-rows // meta["BT"]),)](
        y=y, rstd=rstd, dy=dy, dx=dx, eps=eps, T=rows, D=d, BD=_block(y), NB=FIXED_NB)
    return dx.view(shape)


class L2Norm(torch.autograd.Function):
    """:func:`l2norm_fwd` with :func:`l2norm_bwd` as its backward."""

    @staticmethod
    def forward(ctx, x):
        y, rstd = l2norm_fwd(x.contiguous())
        ctx.save_for_backward(y, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, rstd = ctx.saved_tensors
        return l2norm_bwd(y, rstd, dy)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x L2-normalised over its last dim, differentiable (fla's kernels, one tuning per head
    width)."""
    return L2Norm.apply(x)
