"""The registry of recurrent / chunked state kernels treefx routes through the tree
(what runs them over the tree is :mod:`treefx.ops.recurrence`).

A hybrid model's linear-attention or SSM layer calls a kernel that runs a recurrence over the
sequence (Gated DeltaNet's chunked delta rule, Mamba2's chunked scan, Mamba's selective scan).
Inlined into the graph such a kernel is hundreds of ops that nothing can recognise; on a DFS
row its state would run from one branch into the next sibling. So during capture treefx swaps
each registered kernel, where the model looks it up, for a *marker*: a function Dynamo keeps
as one graph node (``allow_in_graph``) that still computes the original kernel when run. The
SSM pass then finds the markers and rewrites each into a tree recurrence (every tree node is
one chunk whose initial state is its parent node's final state). A kernel without an
initial-state parameter (Hugging Face's Mamba selective scan) is run over the tree by a
``tree_fn`` that has one.

A :class:`Recurrence` says what the kernel's arguments mean. Register your own with
:func:`register_recurrence`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import logging
import sys

import torch

from .ops.lightning import lightning_attention
from .ops.recurrence import Recurrence
from .ops.selective_scan import selective_scan

__all__ = [
    "Recurrence",
    "capture_patches",
    "discover",
    "recurrence",
    "register_recurrence",
    "registered",
]

log = logging.getLogger("treefx")


_REGISTRY: dict[str, Recurrence] = {}
_SITES: list[tuple[str, str, str]] = []  # (module, attribute, recurrence name)
# Layer classes whose forward writes a recurrence inline (a Python block loop Dynamo would
# unroll): (class, its forward in treefx's form, which calls the recurrence's marker).
_LAYER_SITES: list[tuple[type, object]] = []


def register_recurrence(rec: Recurrence, *, sites: list[tuple[str, str]] = ()) -> Recurrence:
    """Register a recurrent kernel.

    ``sites``: (module path, attribute) pairs where models look
    the kernel up, patched with the marker during capture (e.g. the module of your layer and
    the name it calls)."""
    rec.signature = inspect.signature(rec.fn)
    rec.output_like = rec.output_like or next(iter(rec.seq_args))
    if rec.output_like not in rec.seq_args:
        raise ValueError(f"recurrence {rec.name!r}: output_like={rec.output_like!r} is not one "
                         "of its seq_args")
    missing = [a for a in rec.seq_args if a not in rec.signature.parameters]
    if rec.tree_fn is None:
        missing += [a for a in (rec.initial_state, rec.output_final_state)
                    if a not in rec.signature.parameters]
    if missing:
        raise ValueError(f"recurrence {rec.name!r}: {rec.fn.__name__} has no parameters "
                         f"{missing}")
    if rec.tree_fn is not None:
        # The tree runs tree_fn with fn's arguments (as the model binds them) and the state's.
        params = inspect.signature(rec.tree_fn).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        needed = [a for a in rec.signature.parameters
                  if rec.signature.parameters[a].kind not in (inspect.Parameter.VAR_KEYWORD,
                                                              inspect.Parameter.VAR_POSITIONAL)]
        unknown = [a for a in (*needed, rec.initial_state, rec.output_final_state)
                   if a not in params and not (takes_any and a in needed)]
        if unknown:
            raise ValueError(f"recurrence {rec.name!r}: its tree_fn "
                             f"{getattr(rec.tree_fn, '__name__', rec.tree_fn)} has no "
                             f"parameters {unknown}")
    original = rec.fn

    def marker(*args, **kwargs):
        if _fake_call(args, kwargs):
            # Dynamo runs the marker on fake tensors for the output's shape; Triton kernels
            # (fla's) cannot run on them. The rewritten graph never asks for a final state.
            bound = rec.bind(args, kwargs)
            if not bound.get(rec.output_final_state):
                like = bound[rec.output_like]
                out = like.new_empty(like.shape, dtype=_output_dtype(rec, bound))
                return out if rec.bare_output_without_state else (out, None)
        return original(*args, **kwargs)

    marker.__name__ = marker.__qualname__ = f"treefx_recurrence_{rec.name}"
    marker._treefx_recurrence = rec
    rec.marker = torch._dynamo.allow_in_graph(marker)
    _REGISTRY[rec.name] = rec
    _SITES.extend((mod, attr, rec.name) for mod, attr in sites)
    return rec


_OUTPUT_DTYPES: dict = {}  # (recurrence, argument dtypes) -> the output's dtype


def _output_dtype(rec: Recurrence, bound: dict) -> torch.dtype:
    """The dtype of the kernel's output for these arguments' dtypes. Hugging Face's torch
    kernels compute in float32 and some return it for bfloat16 inputs (Mamba2's chunked scan):
    a traced graph told otherwise would read the output with the wrong dtype. Measured once
    per dtype combination on two real CPU tokens (the kernel cannot run on the fake tensors
    of the trace); a kernel that cannot run there (a Triton kernel) is taken to return its
    ``output_like`` argument's dtype."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    like = bound[rec.output_like]
    key = (rec.name, tuple((k, v.dtype) for k, v in bound.items()
                           if isinstance(v, torch.Tensor)))
    if key not in _OUTPUT_DTYPES:
        dtype = like.dtype
        try:
            with unset_fake_temporarily(), torch.no_grad():
                small = {k: _tiny(v, rec.seq_args.get(k)) if isinstance(v, torch.Tensor) else v
                         for k, v in bound.items()}
                small[rec.output_final_state] = False
                out = rec.fn(**small)
                out = out if rec.bare_output_without_state else out[0]
                dtype = out.dtype
        except Exception as e:  # noqa: BLE001 - the argument's dtype is the usual answer
            log.info("recurrence %s: output dtype not measured (%s)", rec.name, e)
        _OUTPUT_DTYPES[key] = dtype
    return _OUTPUT_DTYPES[key]


def _tiny(t: torch.Tensor, seq_dim: int | None) -> torch.Tensor:
    """A real CPU tensor like ``t`` with two tokens along ``seq_dim`` and batch 1 (symbolic
    sizes take their example value)."""
    shape = []
    for d, s in enumerate(t.shape):
        if seq_dim is not None and d == seq_dim % t.dim():
            shape.append(2)
        elif d == 0 and seq_dim is not None:
            shape.append(1)
        else:
            shape.append(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s))
    if t.is_floating_point():
        return torch.randn(shape, dtype=t.dtype) * 0.1
    return torch.zeros(shape, dtype=t.dtype)


def _fake_call(args, kwargs) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(a, torch.Tensor) and is_fake(a)
               for a in (*args, *kwargs.values()))


def recurrence(name: str) -> Recurrence:
    """The registered recurrence called ``name`` (built-in ones: ``qwen3_next_gated_delta_rule``,
    ``mamba2_mamba2_chunk_scan``, ...)."""
    _ensure_builtins(force=True)
    if name not in _REGISTRY:
        raise KeyError(f"no recurrence {name!r} is registered (registered: {sorted(_REGISTRY)})")
    return _REGISTRY[name]


def registered(target) -> Recurrence | None:
    """The recurrence whose marker ``target`` is, if any."""
    rec = getattr(target, "_treefx_recurrence", None)
    return rec if rec is not None and rec.marker is target else None


@contextlib.contextmanager
def capture_patches():
    """Swap every registered kernel for its marker where models look it up."""
    _ensure_builtins()
    saved = []
    try:
        for mod_name, attr, name in _SITES:
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            if hasattr(mod, attr):
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, _REGISTRY[name].marker)
        for cls, forward in _LAYER_SITES:
            saved.append((cls, "forward", cls.__dict__["forward"]))
            cls.forward = forward
        yield
    finally:
        for mod, attr, value in reversed(saved):
            setattr(mod, attr, value)


def discover(model: torch.nn.Module) -> list[Recurrence]:
    """Register the kernels of the known families (:data:`_FAMILIES`) that the modules of
    ``model``'s code define or import, by name and signature, wherever they are: a model
    that copies Gated DeltaNet's or Mamba2's torch kernel into its own file (as Hugging Face
    does for every new hybrid) is recognised without treefx knowing the model. A function
    with the family's name but other parameters is left alone (its layer is then refused
    with an error naming the node). Returns the recurrences found."""
    _ensure_builtins()
    found = []
    sites = {(mod, attr) for mod, attr, _ in _SITES}
    for mod_name in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(mod_name)
        for attr, make in _FAMILIES.items():
            fn = getattr(mod, attr, None)
            if not callable(fn) or registered(fn) is not None:
                continue
            rec = next((r for r in _REGISTRY.values() if r.fn is fn), None)
            if rec is not None:  # the same function, imported into another module
                if (mod_name, attr) not in sites:
                    _SITES.append((mod_name, attr, rec.name))
                found.append(rec)
                continue
            owner = mod_name.rsplit(".", 1)[-1].removeprefix("modeling_")
            rec = _register_if_compatible(make(owner, fn), [(mod_name, attr)])
            if rec is not None:
                log.info("recognised %s.%s as recurrence %s", mod_name, attr, rec.name)
                found.append(rec)
    for name, m in model.named_modules():
        cls = type(m)
        if not _is_lightning_layer(m):
            continue
        _check_lightning_tables(name, m)
        if any(c is cls for c, _ in _LAYER_SITES):
            continue
        if _lightning_matches(m):
            _LAYER_SITES.append((cls, _lightning_forward))
            log.info("recognised %s as lightning attention", cls.__qualname__)
            found.append(_lightning_recurrence())
        else:
            log.info("%s looks like lightning attention but its forward differs from the "
                     "recurrence; left alone", cls.__qualname__)
    return found


# --------------------------------------------------------------------------------------------
# Lightning attention (MiniMax): a layer whose forward runs the recurrence in a block loop.
# --------------------------------------------------------------------------------------------

_LIGHTNING_PARTS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay", "block_size",
                    "qkv_proj", "output_gate", "out_proj", "norm", "act_fn",
                    "num_attention_heads", "head_dim")


def _is_lightning_layer(m: torch.nn.Module) -> bool:
    """A layer built like Hugging Face's MiniMax lightning attention: per-head decay rates
    ``slope_rate`` and the block decay tables of its chunked loop."""
    return all(hasattr(m, a) for a in _LIGHTNING_PARTS) and "forward" in type(m).__dict__


def _lightning_recurrence() -> Recurrence:
    if "lightning_attention" not in _REGISTRY:
        register_recurrence(Recurrence(
            name="lightning_attention", fn=lightning_attention,
            seq_args={"query": 1, "key": 1, "value": 1, "g": 1}, output_like="value",
            neutral={"g": 0.0}))  # no decay, zero keys and values: the state is unchanged
    return _REGISTRY["lightning_attention"]


def _lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                       past_key_values=None, **kwargs):
    """The layer's forward (no cache) with its block loop as one recurrence node: the same
    projections, activation, padding mask, norm, output gate and projection; the loop's
    ``S ← exp(-s_h)·S + kᵀv, o = q·S`` per token as :func:`treefx.ops.lightning.
    lightning_attention`, whose marker the SSM pass runs over the tree."""
    if past_key_values is not None:
        raise RuntimeError("treefx's lightning attention runs without a cache")
    b, n, _ = hidden_states.shape
    h, d = self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    mask_padding = getattr(sys.modules[type(self).__module__], "apply_mask_to_padding_states",
                           None)
    if mask_padding is not None:
        qkv = mask_padding(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(b, n, h, 3 * d), d, dim=3)
    g = (-self.slope_rate.reshape(1, 1, h)).expand(b, n, h)  # the kernel widens it
    out, _ = _lightning_recurrence().marker(q, k, v, g)
    out = self.norm(out.reshape(b, n, h * d))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), None


class UnsupportedLayerError(ValueError):
    """A recognised layer that treefx cannot run as its recurrence (the engine reports it as a
    :class:`treefx.TreeCompileError`)."""


def _check_lightning_tables(name: str, m: torch.nn.Module) -> None:
    """The layer's block tables are those of its ``slope_rate`` (its loop reads the tables,
    treefx's recurrence the rates): a layer whose tables were changed is refused."""
    s = m.slope_rate.detach().double().reshape(-1, 1, 1)
    i = torch.arange(1, int(m.block_size) + 1, dtype=torch.float64, device=s.device)
    expected = {
        "query_decay": torch.exp(-s * i[:, None]),
        "key_decay": torch.exp(-s * (int(m.block_size) - i[:, None])),
        "diagonal_decay": torch.exp(-s * (i[:, None] - i[None, :])).tril()[None],
    }
    # Tables of a low-precision copy were rounded after they were built from the rates at
    # full precision, and the rates too: only a gross change shows there.
    eps = torch.finfo(m.query_decay.dtype).eps
    rtol = max(1e-4, 4 * eps * (1 + float(s.max()) * int(m.block_size)))
    for attr, want in expected.items():
        have = getattr(m, attr).detach().double()
        if have.shape != want.shape or not torch.allclose(have, want, rtol=rtol, atol=4 * eps):
            raise UnsupportedLayerError(
                f"treefx cannot run the lightning attention at {name}: its {attr} is not the "
                "decay its slope_rate gives, and treefx runs the recurrence from the rates. "
                "Rebuild the tables from slope_rate (or leave them as the layer built them).")


def _lightning_matches(m: torch.nn.Module) -> bool:
    """Whether the layer's own forward and :func:`_lightning_forward` agree on a float64
    copy (sequences of one block and of two and a bit): another version of the layer's code
    is left alone rather than replaced by something else."""
    import copy

    try:
        twin = copy.deepcopy(m).to("cpu", torch.float64)
        torch.manual_seed(0)
        hidden = getattr(twin.qkv_proj, "in_features", None)
        bs = int(twin.block_size)
        with torch.no_grad():
            for n in (3, 2 * bs + 5):
                x = torch.randn(1, n, hidden, dtype=torch.float64)
                ref = type(m).forward(twin, x, None, None)[0]
                out = _lightning_forward(twin, x, None, None)[0]
                # The layer's decay tables are built in float32: ~1e-7 apart from float64.
                if not torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max())):
                    return False
        return True
    except Exception as e:  # noqa: BLE001 - a layer that cannot be probed is left alone
        log.info("lightning attention probe failed: %s", e)
        return False


def _import(path: str):
    try:
        return importlib.import_module(path)
    except ImportError:
        return None


def _register_if_compatible(rec: Recurrence, sites) -> Recurrence | None:
    """Built-in registrations skip a kernel whose signature is not the one described (another
    transformers version): its layer then fails the SSM pass's checks with a clear error."""
    try:
        return register_recurrence(rec, sites=sites)
    except ValueError as e:
        log.info("built-in recurrence %s not registered: %s", rec.name, e)
        return None


def _fla_gated_delta_rule(seq: dict, static: dict, initial_state, cu_seqlens):
    """Gated DeltaNet over variable-length nodes with fla's chunked kernel (CUDA)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    extra = {k: static[k] for k in ("scale", "use_qk_l2norm_in_kernel")
             if static.get(k) is not None}
    return chunk_gated_delta_rule(seq["query"], seq["key"], seq["value"], g=seq["g"],
                                  beta=seq["beta"], initial_state=initial_state,
                                  output_final_state=True, cu_seqlens=cu_seqlens, **extra)


def _has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def _delta_rule(name: str, fn, varlen=None) -> Recurrence:
    """A delta-rule kernel in Gated DeltaNet's signature: ``(query, key, value, g, beta, ...,
    initial_state, output_final_state)``, each [B, N, ...]. ``g`` is a log decay (0: keep the
    state), ``beta`` the update rate (0: no update), so zeros pad a node neutrally."""
    return Recurrence(
        name=name,
        fn=fn,
        seq_args={"query": 1, "key": 1, "value": 1, "g": 1, "beta": 1},
        output_like="value",
        neutral={"g": 0.0, "beta": 0.0},
        varlen=varlen,
    )


def _gated_delta_rule(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Gated DeltaNet kernel (``torch_chunk_gated_delta_rule``)."""
    return _delta_rule(f"{owner}_gated_delta_rule", fn,
                       varlen=_fla_gated_delta_rule if _has_fla() else None)


def _kimi_delta_attention(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Kimi Delta Attention kernel (``chunk_kimi_delta_attention``,
    Kimi-Linear and Bailing-hybrid): the gated delta rule with a decay per key channel
    (``g`` [B, N, H, K] instead of [B, N, H])."""
    return _delta_rule(f"{owner}_kimi_delta_attention", fn)


def _mamba2_chunk_scan(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Mamba2 chunked scan (``mamba2_chunk_scan``)."""
    return Recurrence(
        name=f"{owner}_mamba2_chunk_scan",
        fn=fn,
        seq_args={"hidden_states": 1, "dt": 1, "B": 1, "C": 1},
        # dt = -inf: softplus gives a step of 0, so the state neither decays nor takes input
        # (x·dt = 0, exp(A·dt) = 1); padded x is 0. A model that clamps dt from below makes
        # this padding non-neutral: measured per kernel (ops.recurrence.padding_is_neutral).
        neutral={"dt": float("-inf")},
        initial_state="initial_states",
        output_final_state="return_final_states",
        bare_output_without_state=True,
    )


def _mamba_selective_scan(owner: str, fn) -> Recurrence:
    """Hugging Face's torch Mamba (v1) selective scan (``mamba_selective_scan``, after
    mamba_ssm's ``selective_scan_fn``). It has no initial state, so the tree runs treefx's own
    selective scan (:func:`treefx.ops.selective_scan.selective_scan`) with the same arguments."""
    return Recurrence(
        name=f"{owner}_mamba_selective_scan",
        fn=fn,
        seq_args={"hidden_states": 2, "dt": 2, "B": 2, "C": 2, "z": 2},
        output_seq_dim=2,
        output_like="hidden_states",
        # dt = -inf: after the bias and softplus a step of 0 (exp(A·0) = 1, no input), as for
        # Mamba2. Without delta_softplus it is not neutral: measured (padding_is_neutral).
        neutral={"dt": float("-inf")},
        initial_state="initial_state",
        output_final_state="return_last_state",
        bare_output_without_state=True,
        tree_fn=selective_scan,
    )


# The kernel families treefx recognises by name wherever a model defines them.
_FAMILIES = {"torch_chunk_gated_delta_rule": _gated_delta_rule,
             "chunk_kimi_delta_attention": _kimi_delta_attention,
             "mamba2_chunk_scan": _mamba2_chunk_scan,
             "mamba_selective_scan": _mamba_selective_scan}


_BUILTINS_DONE = False


def _register_builtins() -> None:
    """The torch fallbacks of Hugging Face's hybrid layers known today (others are recognised
    when a model is compiled: :func:`discover`). Modules that are missing, or whose kernel has
    another signature, are skipped."""
    for model in ("qwen3_next", "qwen3_5", "mamba2", "bamba", "falcon_h1", "granitemoehybrid",
                  "nemotron_h", "zamba2", "mamba", "falcon_mamba", "jamba", "zamba"):
        path = f"transformers.models.{model}.modeling_{model}"
        mod = _import(path)
        for attr, make in _FAMILIES.items():
            fn = getattr(mod, attr, None)
            if fn is not None:
                _register_if_compatible(make(model, fn), sites=[(path, attr)])


def _ensure_builtins(force: bool = False) -> None:
    """Register the built-in kernels once, where the registry is first consulted (capture,
    :func:`discover`, :func:`recurrence`), not at ``import treefx``: importing transformers'
    modeling modules takes seconds. Until something has imported transformers no model can
    call one of its kernels, so a capture then leaves them for a later one (``force``: import
    them now)."""
    global _BUILTINS_DONE
    if _BUILTINS_DONE or not (force or "transformers" in sys.modules):
        return
    _BUILTINS_DONE = True
    _register_builtins()
