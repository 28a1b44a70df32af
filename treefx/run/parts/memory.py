"""``treefx.backward(..., max_memory=)``: a memory budget made the planner's token budget.

A :class:`MemoryModel` says how many bytes a step in parts holds, from the model's shape
(:func:`from_config`, :func:`for_model`), and :func:`tokens_for` turns a budget in bytes
(:func:`parse_size`: ``"40GiB"``, ``"512MB"``, an int) into the largest ``max_tokens`` whose
estimated peak fits it; :func:`plan_tokens`, what :func:`treefx.backward` plans with,
picks the budget with the fewest parts below that. The estimate of a step cut at
``max_tokens = T``, whose parts read an open path of at most ``C`` tokens
(:meth:`treefx.parts.PartPlan.peak_context_tokens`)::

    peak(T, C) = fixed + T · per_token + per_part + C · context_per_token + loss(T)
    loss(T) = min(T, chunk_rows) · logit_row + head_grad

and a plan's (:meth:`MemoryModel.plan_peak`) counts, after each part's forward, the tokens
and the parts held on the device (:meth:`treefx.parts.PartPlan.held_on_device`):
``max(tokens · per_token + parts · per_part)`` in place of ``T · per_token + per_part``.

- ``per_token``: activation bytes a token holds for its backward. Per layer (``s`` the
  dtype's size, ``h`` hidden, ``i`` intermediate, ``q = heads · head_dim``,
  ``kv = KV heads · head_dim``)::

      layer = s · (4h + 2q + 2kv + 4i) + 4 · (2 + heads)

  the two norms' inputs and outputs (4h), the queries and the attention's output (2q), the
  keys and values (2kv), the MLP's gate, up, activated gate and product (4i), and in float32
  the norms' reciprocal RMS (2) and the attention's log-sum-exp (one per head). Without
  checkpointing ``per_token = layers · layer + head``; with activation checkpointing on every
  layer, each layer keeps its input and one layer's activations are rebuilt at a time:
  ``per_token = layers · s · h + layer + head``, where ``head = 2 s h + 4`` (the final norm).
- ``context_per_token``: the open path's keys and values at every attention layer,
  ``attention layers · 2 · KV heads · head dim · s``, three times: kept for later parts,
  their gradients, and the current part's ``[context; part]`` copy its attention saves. A
  part keeps only the rows later parts read (``PartPlan.exported_rows``), so for a plan
  (:meth:`MemoryModel.plan_peak`) ``C`` is the longest open path or, where more, the most
  such rows held at once.
- ``per_part``: what every part held on the device keeps for its backward whatever its size:
  where the part graph makes its own loss (:func:`treefx.backward` without ``loss_fn``), the
  output weight's gradient, which the fused loss makes in the forward and saves for the
  backward (``vocab · hidden · s``). Held parts each keep one: what the estimate lacked
  against the measured peaks of steps in parts (BENCHMARKS.md, issue 66's table), seen part
  by part on the CPU with :class:`treefx.tools.live_bytes.LiveBytes`. 0 with a ``loss_fn``
  (``own_loss=False``): the log-probabilities' op saves no such buffer.
- ``loss``: the fused loss's chunk of logits (:mod:`treefx.ops.cross_entropy.fast`: two
  [rows, vocab] tensors in the weights' dtype, ``rows = min(T, 4 · CHUNK_ELEMENTS // vocab)``,
  so ``logit_row = 2 · vocab · s`` bytes a row) and the output weight's float32 gradient
  buffer (``head_grad = vocab · hidden · 4``).
- ``fixed``: weights, gradients and optimizer state: ``fixed_bytes=``, else on a GPU
  ``torch.cuda.memory_allocated()`` when :func:`for_model` is called (what is allocated then:
  weights, gradients and optimizer state where they exist) plus the gradients the step will
  allocate (trainable parameters without one yet), on the CPU the parameters' bytes twice
  (weights and their gradients).

The formula is derived, not measured: the target (a measured peak under the budget and within
15% of it) is **not yet measured on a GPU**. :meth:`MemoryModel.calibrate` takes one measured
step's peak and returns the per-token bytes that would have predicted it; ``memory.calibrated(
peak, max_tokens, context_tokens)`` is the model with them.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re

import torch

__all__ = ["MemoryModel", "parse_size", "parse_shape", "from_config", "for_model",
           "tokens_for", "plan_tokens", "longest_path", "parameter_count", "dtype_size"]

_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
          "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40,
          "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}


def parse_size(size) -> int:
    """Bytes from ``"40GiB"``, ``"40 GB"`` (10**9), ``"512MiB"``, ``"1.5G"`` (binary, as
    ``nvidia-smi`` and PyTorch print), or an int (bytes). Refuses a size below one byte."""
    if isinstance(size, bool):
        raise ValueError(f"a memory size is bytes or a string like '40GiB', got {size!r}")
    if isinstance(size, numbers.Integral):
        value = int(size)
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*", size)
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise ValueError(f"not a memory size: {size!r} (write e.g. '40GiB', '512MB' or "
                             "bytes)")
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError(f"a memory size is bytes or a string like '40GiB', got {size!r}")
    if value < 1:
        raise ValueError(f"a memory size must be at least one byte, got {size!r}")
    return value


def dtype_size(dtype) -> int:
    """Bytes an element of ``dtype`` (a ``torch.dtype`` or its name) takes."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Bytes a step in parts holds (see the module's docstring for each term).

    ``per_token``: activation bytes per token held for its backward (all layers).
    ``context_per_token``: bytes per open-path token (keys, values, their gradients, a copy).
    ``logit_row``, ``chunk_rows``: the loss's bytes per row of its chunk of logits, and the
    most rows a chunk has. ``head_grad``: the output weight's float32 gradient buffer.
    ``fixed``: weights, gradients, optimizer state. ``per_part``: bytes each part held on the
    device keeps whatever its size (the output weight's gradient its own loss saves)."""

    per_token: int
    context_per_token: int
    logit_row: int = 0
    chunk_rows: int = 0
    head_grad: int = 0
    fixed: int = 0
    per_part: int = 0

    def loss(self, max_tokens: int) -> int:
        """The loss's bytes for parts of ``max_tokens`` tokens."""
        return min(max_tokens, self.chunk_rows) * self.logit_row + self.head_grad

    def peak(self, max_tokens: int, context_tokens: int = 0, parts: int = 1) -> int:
        """The estimated peak of a step holding ``max_tokens`` tokens' activations in
        ``parts`` parts and an open path of ``context_tokens``."""
        return (self.fixed + max_tokens * self.per_token + parts * self.per_part
                + context_tokens * self.context_per_token + self.loss(max_tokens))

    def plan_peak(self, plan) -> int:
        """The estimated peak of a :class:`treefx.parts.PartPlan`: what the parts held on the
        device at once hold (:meth:`~treefx.parts.PartPlan.held_on_device`: tokens and
        parts, at the moment they weigh most), and its longest open path or, where more, the
        most rows held parts keep for later parts at once
        (:meth:`~treefx.parts.PartPlan.peak_exported_tokens`: those of several branches'
        paths while their parts wait)."""
        held = plan.held_on_device()  # one walk of the schedule for both maxima
        held_bytes = max((t * self.per_token + p * self.per_part for t, p in held), default=0)
        tokens = max((t for t, _ in held), default=0)  # plan.peak_held_tokens()
        ctx = max(plan.peak_context_tokens(), plan.peak_exported_tokens())
        return self.fixed + held_bytes + ctx * self.context_per_token + self.loss(tokens)

    def calibrate(self, measured_peak, max_tokens: int, context_tokens: int = 0,
                  parts: int = 1) -> int:
        """The per-token bytes that predict ``measured_peak`` (bytes or ``"41.2GiB"``, e.g.
        ``torch.cuda.max_memory_allocated()`` over one step) of a step that held
        ``max_tokens`` tokens (``plan.peak_held_tokens()``) in ``parts`` parts with an open
        path of ``context_tokens`` (``plan.peak_context_tokens()``), the other terms as they
        are."""
        rest = measured_peak if isinstance(measured_peak, numbers.Integral) \
            else parse_size(measured_peak)
        rest -= (self.fixed + parts * self.per_part + context_tokens * self.context_per_token
                 + self.loss(max_tokens))
        if max_tokens < 1 or rest <= 0:
            raise ValueError(f"a measured peak of {measured_peak} leaves nothing for "
                             f"{max_tokens} tokens' activations over the fixed, open-path and "
                             "loss terms")
        return math.ceil(rest / max_tokens)

    def calibrated(self, measured_peak, max_tokens: int, context_tokens: int = 0,
                   parts: int = 1):
        """This model with :meth:`calibrate`'s per-token bytes."""
        return dataclasses.replace(
            self, per_token=self.calibrate(measured_peak, max_tokens, context_tokens, parts))


def _get(config, *names, default=None):
    for name in names:
        v = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if v is not None:
            return v
    if default is not None:
        return default
    raise ValueError(f"the model's config has none of {names}")


def _shape(config) -> tuple[int, int, int, int, int, int, int]:
    """hidden size, intermediate size, layers, heads, KV heads, head dim and vocabulary of
    ``config`` (a Hugging Face config, a dict, or the short names)."""
    h = int(_get(config, "hidden_size", "hidden", "n_embd", "d_model"))
    i = int(_get(config, "intermediate_size", "intermediate", "n_inner", "ffn_dim",
                 default=4 * h))
    layers = int(_get(config, "num_hidden_layers", "layers", "n_layer", "num_layers"))
    heads = int(_get(config, "num_attention_heads", "heads", "n_head"))
    kv_heads = int(_get(config, "num_key_value_heads", "kv_heads", default=heads))
    head_dim = int(_get(config, "head_dim", default=h // heads))
    vocab = int(_get(config, "vocab_size", "vocab"))
    return h, i, layers, heads, kv_heads, head_dim, vocab


def from_config(config, *, dtype=None, checkpointing: bool = False,
                fixed_bytes: int = 0, own_loss: bool = True) -> MemoryModel:
    """A :class:`MemoryModel` from a Hugging Face config (an object or a dict:
    ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``, ``vocab_size``, ``dtype``/``torch_dtype``; where
    present, ``layer_types`` counts the softmax attention layers, not ``linear_attention``)
    or the same keys as short names (``hidden``, ``intermediate``, ``layers``, ``heads``,
    ``kv_heads``, ``vocab``). ``dtype``: the activations' (default the config's, else
    bfloat16). ``checkpointing``: every layer activation-checkpointed. ``fixed_bytes``:
    weights, gradients, optimizer state. ``own_loss``: the part graphs make their own loss
    (:func:`treefx.backward` without ``loss_fn``), each held part keeping the output weight's
    gradient (``per_part``)."""
    h, i, layers, heads, kv_heads, head_dim, vocab = _shape(config)
    if dtype is None:
        dtype = _get(config, "dtype", "torch_dtype", default="bfloat16")
    s = dtype_size(dtype)
    types = _get(config, "layer_types", default=[])
    attention_layers = sum(1 for t in types if "attention" in str(t)
                           and "linear" not in str(t)) if types else layers
    q, kv = heads * head_dim, kv_heads * head_dim
    layer = s * (4 * h + 2 * q + 2 * kv + 4 * i) + 4 * (2 + heads)
    head = 2 * s * h + 4
    per_token = (layers * s * h + layer if checkpointing else layers * layer) + head
    from ...ops.cross_entropy.fast import CHUNK_ELEMENTS

    return MemoryModel(per_token=per_token,
                       context_per_token=3 * attention_layers * 2 * kv * s,
                       logit_row=2 * vocab * s, chunk_rows=max(1, 4 * CHUNK_ELEMENTS // vocab),
                       head_grad=vocab * h * 4, fixed=int(fixed_bytes),
                       per_part=vocab * h * s if own_loss else 0)


def parameter_count(config) -> int:
    """The parameters of a decoder of ``config``'s shape (as :func:`from_config` reads it):
    the embedding, the output projection unless ``tie_word_embeddings``, per layer the
    attention's four projections, the SwiGLU MLP's three and two norms, the final norm."""
    h, i, layers, heads, kv_heads, head_dim, vocab = _shape(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    tied = bool(_get(config, "tie_word_embeddings", default=False))
    layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    return vocab * h * (1 if tied else 2) + layers * layer + h


def parse_shape(text: str) -> dict:
    """A model's shape on the command line: ``hidden=4096,intermediate=12288,layers=36,
    heads=32,kv_heads=8,head_dim=128,vocab=151936,dtype=bfloat16`` (:func:`from_config`'s
    short names; ints but ``dtype``)."""
    shape = {}
    for item in text.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"not a model shape: {text!r} (write e.g. hidden=4096,"
                             "intermediate=12288,layers=36,heads=32,kv_heads=8,vocab=151936)")
        key, value = key.strip(), value.strip()
        shape[key] = value if key == "dtype" else int(value)
    return shape


def for_model(model: torch.nn.Module, *, checkpointing: bool | None = None,
              fixed_bytes=None, dtype=None, own_loss: bool = True) -> MemoryModel:
    """A :class:`MemoryModel` of a Hugging Face causal LM (its ``config``; the compiled
    model's ``.model``). ``checkpointing``: default the model's
    ``is_activation_checkpointing`` (``is_gradient_checkpointing`` before transformers
    5.17). ``fixed_bytes`` (bytes or ``"20GiB"``): default, on a GPU,
    ``torch.cuda.memory_allocated()`` of the model's device now, plus the bytes of the gradients
    of trainable parameters that have none yet (the step allocates them); on the CPU, its
    parameters' bytes twice (weights and gradients). ``dtype``: default its parameters'.
    ``own_loss``: as :func:`from_config`'s."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"max_memory= needs a model with a Hugging Face config (hidden size, "
                         f"layers, heads...) to size its activations; {type(model).__name__} "
                         "has none: pass max_tokens= instead")
    param = next(model.parameters(), None)
    if checkpointing is None:
        name = "is_activation_checkpointing" if hasattr(type(model),
                                                         "is_activation_checkpointing") \
            else "is_gradient_checkpointing"  # before transformers 5.17
        checkpointing = bool(getattr(model, name, False))
    if dtype is None:
        dtype = param.dtype if param is not None else None
    if fixed_bytes is None:
        if param is not None and param.device.type == "cuda":
            # the step allocates the gradients that do not exist yet (after
            # ``zero_grad(set_to_none=True)``, every optimizer's default): count them now
            missing = sum(p.numel() * p.element_size() for p in model.parameters()
                          if p.requires_grad and p.grad is None)
            fixed_bytes = torch.cuda.memory_allocated(param.device) + missing
        else:
            fixed_bytes = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    elif not isinstance(fixed_bytes, numbers.Integral):
        fixed_bytes = parse_size(fixed_bytes)
    return from_config(config, dtype=dtype, checkpointing=checkpointing,
                       fixed_bytes=fixed_bytes, own_loss=own_loss)


def longest_path(batch) -> int:
    """The most tokens on a root-to-token path of a packed batch: a bound on any plan's
    open path (:meth:`treefx.parts.PartPlan.peak_context_tokens`) at any budget."""
    if batch is None or batch.num_tokens == 0:
        return 0
    return int(batch.position_ids.max()) + 1


def tokens_for(memory: MemoryModel, max_memory, batch=None) -> int:
    """The token budget (``max_tokens``) for ``max_memory`` bytes (or ``"40GiB"``): the whole
    batch when it fits in one part (``peak(N, 0)``); else the largest ``T`` with
    ``peak(T, longest_path(batch))`` within the budget: a bound for the plans at ``T`` (whose
    open path is no longer than that, and which hold at most ``T`` tokens' activations with
    recompute or host parts); :func:`plan_tokens` then passes over a plan whose held parts
    (``per_part`` each) take it over the budget. Non-decreasing in ``max_memory``.
    Raises ValueError where not even one token fits."""
    budget = parse_size(max_memory)
    n = 0 if batch is None else batch.num_tokens
    if n and memory.peak(n, 0) <= budget:
        return n
    path = longest_path(batch)
    room = budget - memory.peak(0, path)
    # peak(T, path) = peak(0, path) + T · per_token + min(T, chunk_rows) · logit_row
    tokens = room // (memory.per_token + memory.logit_row) if room > 0 else 0
    if tokens > memory.chunk_rows:
        tokens = (room - memory.chunk_rows * memory.logit_row) // memory.per_token
    if tokens < 1:
        raise ValueError(
            f"max_memory={max_memory!r} ({budget / 2 ** 30:.2f} GiB) holds no token: the "
            f"weights, gradients and optimizer state ({memory.fixed / 2 ** 30:.2f} GiB), the "
            f"loss's buffers ({memory.loss(1) / 2 ** 30:.2f} GiB) and the open path's keys "
            f"and values ({path} tokens, {path * memory.context_per_token / 2 ** 30:.2f} GiB) "
            "fill it")
    return int(min(tokens, n) if n else tokens)


_GRID_STEPS = 32  # budgets tried: the integers floor(2 ** (k / 32)), 2.2% apart


def _grid_below(tokens: int) -> list[int]:
    """The grid's budgets up to ``tokens``, largest first."""
    top = int(math.floor(_GRID_STEPS * math.log2(tokens))) + 1
    grid = {int(2 ** (k / _GRID_STEPS)) for k in range(top + 1)}
    return sorted((g for g in grid if g <= tokens), reverse=True)


def plan_tokens(memory: MemoryModel, max_memory, batch, *, beyond: str | None = None) -> int:
    """The token budget :func:`treefx.backward` plans ``batch`` with for ``max_memory``: the
    whole batch where it fits (:func:`tokens_for`), else, among the budgets of a grid 2.2%
    apart (the integers ``floor(2 ** (k / 32))``) up to :func:`tokens_for`'s, the largest
    of those whose plan (:func:`treefx.parts.plan` with ``beyond``) has the fewest parts.
    The planner's part count is not monotone in ``max_tokens`` (a budget a token larger may
    cut a part more), so the budget is chosen among all the grid's below it: a larger
    ``max_memory`` never gives more parts. Every budget tried is within :func:`tokens_for`'s,
    and a plan whose estimated peak (:meth:`MemoryModel.plan_peak`: the rows kept for several
    branches can outnumber the longest path) is over ``max_memory`` is passed over, so the
    plan's estimated peak is within ``max_memory`` (where none is down to an eighth of
    :func:`tokens_for`'s budget, that eighth). A budget ``T'`` cuts at least ``ceil(N / T')`` parts, so the search stops where
    that bound reaches the fewest found."""
    from ... import parts as parts_mod

    tokens = tokens_for(memory, max_memory, batch)
    if batch is None or tokens >= batch.num_tokens:
        return tokens
    n = batch.num_tokens
    limit = parse_size(max_memory)
    best, best_parts = None, None
    grid = _grid_below(tokens)
    for t in grid:
        if best_parts is not None and -(-n // t) >= best_parts:
            break
        if best is None and t < tokens // 8:  # none fits down to an eighth: the last tried
            return t
        plan = parts_mod.plan(batch, t, beyond=beyond)
        if memory.plan_peak(plan) > limit:
            continue
        if best_parts is None or plan.num_parts < best_parts:
            best, best_parts = t, plan.num_parts
    return best if best is not None else grid[-1]
