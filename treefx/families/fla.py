"""flash-linear-attention (fla): its chunked Triton kernels as the variable-length fast path of
the tree recurrence for Gated DeltaNet and Kimi Delta Attention, used only where their
gradients are known to be right.

The tree recurrence (:mod:`treefx.ops.recurrence`) runs all nodes of one tree depth in one
call of a kernel's variable-length form (``cu_seqlens``, one initial state per node: the
parent node's final state). fla's ``chunk_gated_delta_rule`` and ``chunk_kda`` take exactly
that. Where this module says no (fla missing, the tensors not on an NVIDIA GPU, a version and
GPU combination whose backward is known to be wrong, ``TREEFX_FLA=0``), the tree runs Hugging
Face's torch kernel instead: the same result, slower. On a GPU that fallback is announced by
one warning per process and reason, naming the versions; it is never silent.

What is known (fla's own guards and issues, checked on Hopper GPUs with torch 2.11 and
Triton 3.6; BENCHMARKS.md, "Hybrids on fla's kernels"):

- fla issue 640: on Hopper with 3.4.0 <= Triton < 3.7.1, the gated ``chunk_bwd_dqkwg``
  kernel miscompiles when it tiles the key dimension by 64, which gives wrong ``beta`` and
  gate gradients. fla 0.5.0 and 0.5.1 refuse the backward on Hopper with Triton >= 3.4.0 and
  fla >= 0.5.2 with Triton < 3.7.1, unless tilelang is installed (fla then runs that kernel
  in tilelang). fla 0.4.2 has no guard but tiles by 128 on Hopper for key heads wider than
  64, which avoids it (and matched a float32 reference on Hopper, per-node initial states
  and their gradients included); fla 0.4.0 / 0.4.1 tile by 64.
- fla 0.4.x's Kimi Delta Attention backward can pick an autotune configuration that reads
  out of bounds on Hopper (fixed in fla 0.5.0, fla pull request 807).
- fla 0.4.x takes as many query/key heads as value heads; Qwen3-Next and Qwen3.5 have more
  value heads than key heads, so query and key are expanded first (:func:`expand_heads`),
  as Hugging Face's torch kernel does.
- fla's kernels are Triton: CUDA tensors, no float64.

``TREEFX_FLA=0`` turns the fast path off (the torch kernel everywhere, no warning);
``TREEFX_FLA=1`` or unset: on where known good.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import re
import warnings
from dataclasses import dataclass

import torch

from ..ops.recurrence.reference import takes_keyword
from ..options import Options, current
from . import fla_l2norm

__all__ = ["ENV", "Decision", "Environment", "FlaFallbackWarning", "decide", "environment",
           "expand_heads", "fla_distribution_version", "gate", "gated_delta_rule",
           "kimi_delta_attention", "use_fla"]

log = logging.getLogger("treefx")

ENV = Options.env_name("fla")
KERNELS = ("gated_delta_rule", "kimi_delta_attention")


class FlaFallbackWarning(UserWarning):
    """A recurrence runs on Hugging Face's torch kernel rather than fla's on the GPU."""


def _version(text: str | None) -> tuple[int, ...]:
    """(major, minor, patch) of a version string ("3.6.0+git1234" -> (3, 6, 0))."""
    if not text:
        return ()
    parts = re.findall(r"\d+", text.split("+")[0])[:3]
    return tuple(int(p) for p in parts) + (0,) * (3 - len(parts))


def _hopper(capability) -> bool:
    return capability is not None and capability[0] == 9


def gate(kernel: str, fla: str, triton: str | None, capability: tuple[int, int] | None,
         tilelang: bool, key_head_dim: int | None = None) -> tuple[bool, str]:
    """Whether fla ``fla`` computes ``kernel``'s gradients right with Triton ``triton`` on an
    NVIDIA GPU of compute ``capability`` (``tilelang``: tilelang importable), at key head
    width ``key_head_dim``; (yes/no, why). Only what is known; see the module's docstring."""
    v, t = _version(fla), _version(triton)
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {KERNELS}")
    if v < (0, 4, 0):
        return False, f"fla {fla} is older than 0.4.0, which treefx has not checked"
    hopper = _hopper(capability)
    bad_triton = (3, 4, 0) <= t < (3, 7, 1)
    if kernel == "kimi_delta_attention":
        if v < (0, 5, 0) and hopper:
            return False, (f"fla {fla}'s Kimi Delta Attention backward can read out of bounds "
                           "on Hopper GPUs (fixed in fla 0.5.0, fla pull request 807)")
        return True, "known good"
    if not hopper or t < (3, 4, 0):
        return True, "known good"
    if v >= (0, 5, 0):
        # fla's own guard (fla/ops/common/chunk_o.py): refuses the gated backward on Hopper
        # with Triton >= 3.4.0 (0.5.0, 0.5.1) or 3.4.0 <= Triton < 3.7.1 (0.5.2 on) unless
        # tilelang runs that kernel.
        refused = bad_triton if v >= (0, 5, 2) else True
        if refused and not tilelang:
            return False, (f"fla {fla} refuses its Gated DeltaNet backward on Hopper GPUs with "
                           f"Triton {triton} without tilelang (fla issue 640: wrong gate "
                           "gradients); install tilelang or a Triton fla accepts, or fla 0.4.2")
        return True, "known good"
    if not bad_triton:
        return True, "known good"
    # fla 0.4.x on Hopper with an affected Triton: right unless the backward tiles the key
    # dimension by 64 (0.4.2: keys of 33-64 channels; 0.4.0/0.4.1: any key wider than 32).
    k = key_head_dim  # unknown: refused
    tile = None if k is None else min(max(1 << (k - 1).bit_length(), 16),
                                      128 if v >= (0, 4, 2) else 64)
    if tile is None or tile == 64:
        return False, (f"fla {fla} with Triton {triton} on Hopper GPUs tiles key heads of {k} "
                       "channels by 64, where the gated backward is miscompiled (fla issue "
                       "640: wrong gate gradients); fla 0.4.2 with key heads wider than 64 "
                       "is right")
    return True, "known good"


@dataclass(frozen=True)
class Environment:
    """What :func:`decide` looks at, measured by :func:`environment` (or written out by a
    test): the tensors' device type, the GPU's compute capability and name, the fla, Triton
    and torch versions (None: not installed), whether tilelang is importable, whether this is
    a ROCm build, and the value of ``TREEFX_FLA``."""

    device_type: str
    capability: tuple[int, int] | None = None
    device_name: str = ""
    fla: str | None = None
    triton: str | None = None
    torch: str = torch.__version__
    tilelang: bool = False
    hip: bool = False
    setting: str = ""

    def describe(self) -> str:
        gpu = (f"{self.device_name} (compute {self.capability[0]}.{self.capability[1]})"
               if self.capability else self.device_type)
        return (f"fla {self.fla or 'not installed'}, Triton {self.triton or 'not installed'}, "
                f"torch {self.torch}, tilelang {'installed' if self.tilelang else 'absent'}, "
                f"{gpu}")


@dataclass(frozen=True)
class Decision:
    """fla or not, why, and whether the fallback is announced (a warning)."""

    use: bool
    reason: str
    loud: bool = False


def _dist_version(*names: str) -> str | None:
    """The installed version of the first of the distributions ``names`` found (None: none)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def fla_distribution_version() -> str | None:
    """The installed fla distribution's version (fla-core, else flash-linear-attention), as
    pip records it; None where neither is installed."""
    return _dist_version("fla-core", "flash-linear-attention")


@functools.lru_cache(maxsize=None)
def _installed() -> tuple[str | None, str | None, bool]:
    fla = None
    if importlib.util.find_spec("fla") is not None:
        fla = fla_distribution_version()
        if fla is None:  # a source checkout on the path
            try:
                fla = getattr(importlib.import_module("fla"), "__version__", None) or "0"
            except Exception:  # noqa: BLE001 - fla that fails to import is not usable
                fla = None
    triton = _dist_version("triton", "pytorch-triton")
    tilelang = importlib.util.find_spec("tilelang") is not None
    return fla, triton, tilelang


def environment(device: torch.device, options: Options | None = None) -> Environment:
    """This process's :class:`Environment` for tensors on ``device``."""
    fla, triton, tilelang = _installed()
    cap, name = None, ""
    if device.type == "cuda":
        cap = tuple(torch.cuda.get_device_capability(device))
        name = torch.cuda.get_device_name(device)
    return Environment(device_type=device.type, capability=cap, device_name=name, fla=fla,
                       triton=triton, tilelang=tilelang, hip=torch.version.hip is not None,
                       setting=current(options).fla)


def decide(kernel: str, env: Environment, dtype: torch.dtype,
           key_head_dim: int | None = None) -> Decision:
    """fla for ``kernel`` on tensors of ``dtype`` in ``env``, or the torch kernel and why
    (loud: announced by a warning, wherever a GPU user could expect fla)."""
    setting = env.setting.strip().lower()
    if setting in ("0", "off", "false", "no"):
        return Decision(False, f"{ENV}={env.setting} turns fla off")
    if setting not in ("", "1", "on", "true", "yes", "auto"):
        raise ValueError(f"{ENV} must be 0 or 1, got {env.setting!r}")
    if env.device_type != "cuda":
        return Decision(False, f"fla's kernels run on CUDA GPUs only ({env.device_type} "
                        "tensors)")
    if env.hip:
        return Decision(False, "fla on ROCm GPUs is not checked by treefx", loud=True)
    if env.fla is None:
        return Decision(False, "fla (flash-linear-attention) is not installed", loud=True)
    if env.triton is None:
        return Decision(False, "Triton is not installed", loud=True)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return Decision(False, f"fla's kernels do not take {dtype}", loud=True)
    ok, why = gate(kernel, env.fla, env.triton, env.capability, env.tilelang, key_head_dim)
    return Decision(ok, why, loud=not ok)


_WARNED: set = set()


def announce(kernel: str, decision: Decision, env: Environment) -> None:
    """One :class:`FlaFallbackWarning` per process for each kernel and reason of a loud
    fallback; a quiet one is logged at INFO."""
    if decision.use:
        return
    msg = (f"treefx: {kernel} runs on Hugging Face's torch kernel, not fla's: "
           f"{decision.reason} ({env.describe()}). Right, but slower; set {ENV}=0 to choose "
           "the torch kernel and silence this.")
    if not decision.loud:
        log.info(msg)
        return
    key = (kernel, decision.reason)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(msg, FlaFallbackWarning, stacklevel=2)


@functools.lru_cache(maxsize=None)
def _env_for(device: torch.device, setting: str) -> Environment:
    return environment(device)


def use_fla(kernel: str, seq: dict, static: dict, options: Options | None = None) -> bool:
    """Whether the tree recurrence runs ``kernel`` on fla for these arguments (the seq args
    of Gated DeltaNet's signature: ``query``, ``key``, ``value``, ...); announces a fallback."""
    q = seq["query"]
    env = _env_for(q.device, current(options).fla)
    decision = decide(kernel, env, q.dtype, key_head_dim=q.shape[-1])
    announce(kernel, decision, env)
    return decision.use


def expand_heads(query: torch.Tensor, key: torch.Tensor, value_heads: int):
    """Query and key [B, N, Hk, K] expanded to ``value_heads`` heads, each key head serving
    ``value_heads // Hk`` consecutive value heads (Hugging Face's mapping: ``repeat_interleave``
    on the head dim); gradients flow back to the unexpanded tensors."""
    heads = key.shape[-2]
    if heads == value_heads:
        return query, key
    if value_heads % heads:
        raise ValueError(f"{value_heads} value heads are not a multiple of {heads} key heads")
    r = value_heads // heads
    return query.repeat_interleave(r, dim=-2), key.repeat_interleave(r, dim=-2)


def _extra(static: dict) -> dict:
    return {k: static[k] for k in ("scale", "use_qk_l2norm_in_kernel")
            if static.get(k) is not None}


# CUDA's grid: at most 65,535 blocks along its second and third axes. fla 0.4 launches
# (sequences x heads) blocks on one of them in its state kernels (chunk_delta_h, chunk_h,
# fused_recurrent) and (chunks of 64 tokens) on one in others (chunk_o); past that the
# launch fails ("invalid argument"). A level of many nodes (a forest of short trees, a row
# padded with thousands of one-token roots) is therefore run in several calls.
GRID_AXIS = 65_535
CHUNK = 64


def split_calls(seq: dict, static: dict, sizes: list[int]) -> list[int]:
    """How many nodes of ``sizes`` tokens (in order) each fla call takes
    (:class:`treefx.ops.recurrence.Recurrence`'s ``varlen_split``): at most
    ``GRID_AXIS // heads`` nodes and ``GRID_AXIS`` chunks of 64 tokens a call."""
    heads = seq["value"].shape[-2]
    most = max(1, GRID_AXIS // heads)
    counts, n, chunks = [], 0, 0
    for size in sizes:
        c = -(-size // CHUNK)
        if n and (n + 1 > most or chunks + c > GRID_AXIS):
            counts.append(n)
            n, chunks = 0, 0
        n += 1
        chunks += c
    if n:
        counts.append(n)
    return counts


def _cpu_seqlens(fn, cu_seqlens_cpu) -> dict:
    """``cu_seqlens_cpu=`` for an fla kernel that takes it (fla 0.4.2 does), else nothing."""
    takes = takes_keyword(fn, "cu_seqlens_cpu")
    return {"cu_seqlens_cpu": cu_seqlens_cpu} if takes and cu_seqlens_cpu is not None else {}


def gated_delta_rule(seq: dict, static: dict, initial_state, cu_seqlens, cu_seqlens_cpu=None,
                     final: bool = True):
    """Gated DeltaNet over variable-length nodes (:class:`treefx.ops.recurrence.Recurrence`'s
    ``varlen``): fla's ``chunk_gated_delta_rule``, query and key expanded to the value heads.
    ``cu_seqlens_cpu``: the host copy, from which fla plans its chunks without reading
    ``cu_seqlens`` back (that read was most of the GPU's idle time in a hybrid's step;
    BENCHMARKS.md, "Hybrids on fla's kernels"). ``final``: whether to compute the nodes'
    final states."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k = expand_heads(seq["query"], seq["key"], seq["value"].shape[-2])
    extra = _extra(static)
    if extra.get("use_qk_l2norm_in_kernel") and fla_l2norm.available():
        # fla's own L2-norm kernels, keyed by head width only (fla keys them by row length
        # too, and autotunes again at every new band of lengths): the same arithmetic
        q, k = fla_l2norm.l2norm(q), fla_l2norm.l2norm(k)
        extra["use_qk_l2norm_in_kernel"] = False
    return chunk_gated_delta_rule(q, k, seq["value"], g=seq["g"], beta=seq["beta"],
                                  initial_state=initial_state, output_final_state=final,
                                  cu_seqlens=cu_seqlens,
                                  **_cpu_seqlens(chunk_gated_delta_rule, cu_seqlens_cpu),
                                  **extra)


def kimi_delta_attention(seq: dict, static: dict, initial_state, cu_seqlens,
                         cu_seqlens_cpu=None, final: bool = True):
    """Kimi Delta Attention (a log decay per key channel, ``g`` [B, N, H, K]; as many key as
    value heads) over variable-length nodes: fla's ``chunk_kda``."""
    from fla.ops.kda import chunk_kda

    return chunk_kda(seq["query"], seq["key"], seq["value"], g=seq["g"], beta=seq["beta"],
                     initial_state=initial_state, output_final_state=final,
                     cu_seqlens=cu_seqlens, **_cpu_seqlens(chunk_kda, cu_seqlens_cpu),
                     **_extra(static))
