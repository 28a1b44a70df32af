"""``treefx.compile(model)``: a model compiled to run exactly on DFS-packed trees, its output,
its loss, and the check against each sequence run alone (``treefx.verify``)."""

from __future__ import annotations

import inspect
import logging

import torch

from . import backends
from . import regional as regional_mod
from .. import verification
from .engine import TreeEngine, check_batch, tree_info, unwrap_compiled
from ..layout import TreeBatch, TreeOutput
from ..ops.cross_entropy import weighted_logprob_loss
from ..ops.logprobs import register_site, token_logprobs_site, tree_logprobs_from_logits
from ..compiler import GraphContext
from ..options import Options
from ..plan import Plan
from ..reference import logits_of

__all__ = ["compile", "TreeModel", "TreeOutput", "tree_loss", "verify", "verify_default"]

log = logging.getLogger("treefx")


def tree_loss(out: TreeOutput, batch: TreeBatch) -> torch.Tensor:
    """The tree's training loss: the mean of the per-sequence losses, from a tree model's output.

    Σ_t loss_weights[t] · (−token_logprobs[t]) = (1/P) Σ_p ω_p · loss_p: each sequence's
    own loss (the batch's reduction) with its weight, averaged over the batch's P sequences
    (or the global count given to :func:`treefx.pack`). ``out`` is the model's output on
    ``batch`` (a ``ValueError`` when their token counts differ)."""
    n, m = out.token_logprobs.shape[-1], batch.loss_weights.shape[-1]
    if n != m:
        raise ValueError(f"tree_loss(out, batch): out has {n} tokens but the batch has {m}: out "
                         "came from another batch; pass the batch the model ran on")
    return weighted_logprob_loss(out.token_logprobs, batch.loss_weights)


def model_logits(model, opts: dict, input_ids, tree_info):
    """The model's logits on the row, called with the arguments ``opts`` says its forward
    takes (traced inside the captured function)."""
    kwargs = {}
    if opts["position_ids"]:
        kwargs["position_ids"] = tree_info[0:1]
    if opts["attention_mask"]:
        # An explicit all-ones mask: Hugging Face then builds its causal (+ window) mask from
        # index grids, which the positions pass turns into path positions, instead of
        # inferring packed documents from the jumping position_ids.
        kwargs["attention_mask"] = torch.ones_like(input_ids)
    if opts["use_cache"]:
        kwargs["use_cache"] = False
    return logits_of(model(input_ids, **kwargs))


def tree_forward(opts: dict):
    """The function a compiled model captures: the model's logits on the row (each token's
    log-probability is read from them outside the graph, :meth:`TreeModel.forward`), or with
    ``logits=False`` each token's log-probability at its tree predecessor (one node the
    logprobs pass fuses with the output projection: no [N, vocab] logits).

    With the logits, the graph also returns a small view of ``tree_info``, which nothing
    reads: it keeps ``tree_info`` an input of the captured graph (Dynamo drops inputs nothing
    in the graph reads, and the model's own code reads only the tokens), from which the
    passes build the tree's attention and positions (as ``@treefx.step``'s function does)."""
    def tree_forward(model, input_ids, tree_info):
        torch._check(tree_info.shape[1] == input_ids.shape[1])
        logits = model_logits(model, opts, input_ids, tree_info)
        if opts["logits"]:
            return logits, tree_info[:, :1]
        return token_logprobs_site(logits, input_ids, tree_info[1])

    return tree_forward


class TreeModel(torch.nn.Module):
    """A model compiled for trees: ``out = tm(batch)`` for a :class:`TreeBatch`.

    Holds the user's model as ``.model`` (same parameters: an optimizer built on the model keeps
    working, and the model itself keeps working on ordinary batches); for a model wrapped in
    ``torch.compile``, its original module. ``verify_on_first_call``:
    whether the next call first runs the probe check (see :func:`compile`'s ``verify``);
    ``verification``: its report once it ran (or why it could not).
    """

    def __init__(self, model: torch.nn.Module, backend: str = "auto", *, block_size: int = 128,
                 pass_position_ids: bool | None = None, kernel_options: dict | None = None,
                 interleave_heads: bool | None = None, verify: bool | None = None,
                 logits: bool = True, forward_signature=None, regional: bool | None = None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"treefx.compile expects a torch.nn.Module, got {type(model).__name__}")
        # the options as given (a twin, treefx.run.model.twin, is compiled with the same)
        self._options = dict(backend=backend, block_size=block_size,
                             pass_position_ids=pass_position_ids, kernel_options=kernel_options,
                             interleave_heads=interleave_heads, verify=verify, logits=logits,
                             forward_signature=forward_signature, regional=regional)
        if not isinstance(logits, bool):
            raise TypeError(f"logits must be True or False, got {logits!r}")
        # the TREEFX_* switches, read once, with this call's own arguments over them
        options = Options.from_env(verify=verify)
        backends.check_available(backends.check(backend), options)  # inductor without CUDA
        if not logits:
            register_site()
        model = unwrap_compiled(model)
        model, wrapper = regional_mod.unwrap_ddp(model)
        _check_peft(model)
        self.model = model
        # What the user holds: the DDP wrapper (not registered as a submodule: it holds
        # ``model`` itself), whose call wraps every regional run.
        self._root = [wrapper or model]
        params = _forward_parameters(model, forward_signature)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())

        def accepts(name):
            return name in params or takes_kwargs and name in ("use_cache",)

        def requires(name):
            p = params.get(name)
            return p is not None and p.default is p.empty and p.kind in (
                p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)

        opts = {
            # By default the model computes its own positions with its own code, which the
            # passes evaluate per path: giving it 0-based positions would be wrong for a model
            # whose positions start elsewhere (RoBERTa's start after the padding index).
            "position_ids": requires("position_ids") if pass_position_ids is None
            else bool(pass_position_ids),
            "attention_mask": accepts("attention_mask"),
            "use_cache": accepts("use_cache"),
            "logits": logits,
        }
        if opts["position_ids"] and not accepts("position_ids") and not takes_kwargs:
            raise ValueError("pass_position_ids=True but the model's forward has no position_ids")
        self.opts = opts
        self.plan = Plan(backend=backend, block_size=block_size,
                         kernel_options=kernel_options, interleave_heads=interleave_heads,
                         regional=regional, mode="tree", options=options)
        self.engine = TreeEngine(tree_forward(opts), self.plan,
                                 no_grad_runs_training=options.share_no_grad)
        # A model already on a GPU: the first call's background work (compile workers, cuDNN's
        # kernels) starts here, while the job prepares its data and optimizer.
        device = _parameter_device(model)
        if device is not None and device.type == "cuda":
            self.engine.warm_start(device, model)
        self.verify_on_first_call = options.verify
        if not isinstance(self.verify_on_first_call, bool):
            raise TypeError(f"verify must be True, False or None, got {verify!r}")
        # whether first calls check themselves (treefx.backward's part graph checks itself on
        # its own first call, whatever ran before)
        self.verify_requested = self.verify_on_first_call
        self.verification = None  # the first call's VerificationReport (or why it was skipped)
        # the largest token id of the batches it was called with (the first-call probe's
        # vocabulary where the model does not declare one: treefx.verification.probe_vocab_size)
        self.largest_token_id: int | None = None

    @property
    def returns_logits(self) -> bool:
        """Whether calls return the logits (``treefx.compile(..., logits=True)``, the default)."""
        return self.opts["logits"]

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def num_compilations(self) -> int:
        return self.engine.num_compilations

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent so far in treefx's passes (``passes``), the backend's compilation
        (``compile``: AOTAutograd, Inductor, Triton) and the first-call check (``check``); the
        rest of a first call is Dynamo's trace and the run."""
        return dict(self.engine.timings)

    @property
    def contexts(self) -> list[GraphContext]:
        return self.engine.contexts

    def forward(self, batch: TreeBatch) -> TreeOutput:
        if not isinstance(batch, TreeBatch):
            raise TypeError(f"expected a treefx.TreeBatch (see treefx.pack), got "
                            f"{type(batch).__name__}")
        check_batch(self.model, batch)
        if batch.max_token_id >= 0 or self.verify_on_first_call:  # (no device sync otherwise)
            self.note_token_ids(batch)
        if self.verify_on_first_call:
            self.verify_on_first_call = False
            with self.engine.timed("check"):
                self._verify_first_call(batch)
        out = self.engine(batch.device, self.model, batch.input_ids, tree_info(batch),
                          dynamic=(1, 2), discover_in=self.model, root=self._root[0])
        if not self.opts["logits"]:
            return TreeOutput(None, out)
        # Read outside the graph: a loss on the log-probabilities alone then sends no gradient
        # to the logits output, where a graph returning both would get a zero-filled [N, V]
        # one (:mod:`treefx.ops.logprobs.from_logits`).
        logits, _ = out  # (the tree input's anchor: tree_forward)
        return TreeOutput(logits, tree_logprobs_from_logits(logits, batch.input_ids,
                                                            batch.parent_token))

    @property
    def root(self) -> torch.nn.Module:
        """What the user holds: the DDP wrapper of :attr:`model`, or :attr:`model` itself."""
        return self._root[0]

    def note_token_ids(self, batch) -> None:
        """Remember the largest token id of ``batch`` (a TreeBatch, a Tree or Trees)."""
        if isinstance(batch, TreeBatch):
            top = batch.max_token_id if batch.max_token_id >= 0 else int(batch.input_ids.max())
        else:
            trees = [batch] if hasattr(batch, "segments") else list(batch)
            top = max((int(s.max()) for t in trees for s in t.segments if len(s)), default=-1)
        if top >= 0:
            self.largest_token_id = max(top, self.largest_token_id or 0)

    def _verify_first_call(self, batch: TreeBatch) -> None:
        """The probe check (:mod:`treefx.verification`) through this model's own compiled graph,
        with gradients when the call computes them or captures the training graph
        (:meth:`TreeEngine.captures_training`), before the user's first batch. Through
        Inductor the probe's row is padded to the batch's length (``pad_to``): compiled on a
        short row, the graph would be compiled again for the batch."""
        backend = self.engine.resolve_backend(batch.device)
        training = self.engine.captures_training(self.model, backend, self._root[0])
        grads = torch.is_grad_enabled() or training
        pad_to = batch.num_tokens if backend == "inductor" else None
        kind = regional_mod.distributed_kind(self.model, self._root[0] if self._root[0]
                                             is not self.model else None)
        if kind is not None and grads:
            # Sharded (FSDP) or reduced (DDP) gradients are not this process's own: the probe
            # compares log-probabilities only (the tests compare the gathered gradients).
            log.info("first-call check under %s: log-probabilities only", kind.upper())
            grads = False
        for _ in range(2):
            try:
                self.verification = verification.verify_compiled(self, grads=grads,
                                                                 pad_to=pad_to)
            except verification.TreeVerificationError as e:
                if self.engine.twin_used:
                    # the twin's graph is not this model's (it was captured in another
                    # training mode, with other hooks): this model gets its own graph
                    log.warning("treefx: the graph of a twin model failed this model's first-"
                                "call check; capturing its own (%s)", str(e).splitlines()[0])
                    self.engine.end_twin()
                    continue
                if not isinstance(e, verification.VerificationUnavailable):
                    raise
                self.verification = str(e)
                log.warning("%s", e)
            break
        if training and not isinstance(self.verification, str):
            self._verify_no_grad_runs(pad_to)
        # a twin's graph checked here keeps serving this model; if none was, none will
        self.engine.twin_verified()

    def _verify_no_grad_runs(self, pad_to) -> None:
        """The training graph that serves this model's calls without gradients, checked without
        gradients too: against the model run without them, whose code may take other paths
        (``torch.is_grad_enabled()`` in a layer). Where it fails, calls without gradients
        capture a graph of their own, checked here."""
        try:
            verification.verify_compiled(self, grads=False, pad_to=pad_to)
            return
        except verification.VerificationUnavailable:
            return
        except verification.TreeVerificationError as e:
            log.warning("treefx: the training graph run without gradients differs from the "
                        "model run without them; calls without gradients capture a graph of "
                        "their own (%s)", str(e).splitlines()[0])
        self.engine.no_grad_runs_training = False
        verification.verify_compiled(self, grads=False, pad_to=pad_to)


def twin(tm: TreeModel, model: torch.nn.Module) -> TreeModel | None:
    """A :class:`TreeModel` for ``model``, compiled with ``tm``'s options, that runs ``tm``'s
    regional graphs without gradients instead of capturing its own, when ``model`` is a twin of
    ``tm.model``; None when it is not one (compile it on its own).

    For a reference model beside a policy of the same architecture (TRL's GRPO): the graph the
    policy's no-grad calls run, captured in training mode (the policy's training graph, see
    :meth:`TreeEngine.captures_training`), serves the reference in eval mode, with its
    parameters (a regional graph reads each block's parameters from the module it runs).

    Twins: the same class; the same modules (names, classes); the same parameters and
    buffers (names, shapes, dtypes, devices); the same plain attributes on every module
    (numbers, strings, flags; ``training`` aside) and the same Hugging Face config (``use_cache``
    aside, which treefx passes itself); both run regionally on their device's backend, neither
    under FSDP2 or DDP. What may differ, and what the graph took from the model it was
    captured on, are the modules' training modes and forward hooks (``tm``'s model keeps
    transformers' ``make_inputs_require_grads`` hook under gradient checkpointing): so the
    twin shares graphs only under its own first-call check (``verify``, on), which runs the
    shared graph on the probe with the twin's parameters against the twin itself, each
    sequence alone; where they differ, the twin captures its own graph (a warning says so).
    Only calls without gradients are shared; a twin's calls with gradients capture its own.
    ``TREEFX_SHARE_TWINS=0`` (:attr:`treefx.options.Options.share_twins`, read when the twin
    is made) turns sharing off (None, always)."""
    if not Options.from_env().share_twins:
        return None
    opts = dict(tm._options)
    if not tm.plan.options.verify:
        return None
    why = twin_difference(tm.model, model)
    if why is not None:
        log.info("treefx: %s is compiled on its own: %s", type(model).__name__, why)
        return None
    device = _parameter_device(model)
    if device is None or _parameter_device(tm.model) != device:
        return None
    new = TreeModel(model, **opts)
    backend = new.engine.resolve_backend(device)
    if not (new.engine.uses_regions(model, None, backend)
            and tm.engine.uses_regions(tm.model, None, backend)) \
            or regional_mod.distributed_kind(model) is not None \
            or regional_mod.distributed_kind(tm.model) is not None:
        return None
    new.engine.share_from(tm.engine, tm.model)
    return new


_PLAIN = (bool, int, float, str, type(None))


def _plain_attributes(module: torch.nn.Module) -> dict:
    out = {}
    for k, v in vars(module).items():
        if k == "training" or k.startswith("_"):
            continue
        if isinstance(v, _PLAIN) or (isinstance(v, tuple) and all(isinstance(x, _PLAIN)
                                                                   for x in v)):
            out[k] = v
    return out


def _config_dict(model: torch.nn.Module) -> dict | None:
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    d = dict(to_dict())
    for k in ("use_cache", "_name_or_path", "transformers_version", "_commit_hash"):
        d.pop(k, None)
    return d


def twin_difference(a: torch.nn.Module, b: torch.nn.Module) -> str | None:
    """Why ``b`` is not a twin of ``a`` (:func:`twin`), in words; None when it is one."""
    if a is b:
        return "the same module"
    if type(a) is not type(b):
        return f"{type(b).__name__} is not a {type(a).__name__}"
    ma, mb = list(a.named_modules()), list(b.named_modules())
    if [(n, type(m)) for n, m in ma] != [(n, type(m)) for n, m in mb]:
        return "other modules"
    missing = object()
    for (name, x), (_, y) in zip(ma, mb):
        # an attribute one instance set and the other reads from its class compares by value
        keys = set(_plain_attributes(x)) | set(_plain_attributes(y))
        if any(getattr(x, k, missing) != getattr(y, k, missing) for k in keys):
            return f"other attributes in {name or 'the model'}"
    if _config_dict(a) != _config_dict(b):
        return "another config"

    def tensors(m):
        return [(n, tuple(t.shape), t.dtype, t.device) for n, t in
                [*m.named_parameters(remove_duplicate=False),
                 *m.named_buffers(remove_duplicate=False)]]

    if tensors(a) != tensors(b):
        return "other parameters or buffers"
    return None


def _check_peft(model: torch.nn.Module) -> None:
    """PEFT's prompt-learning methods put virtual tokens before every sequence (or a learned
    key/value prefix into every layer): not a tree of the batch's tokens. Adapters that change
    the weights (LoRA and its relatives) need nothing: they are ordinary modules."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config, "peft_type", None)
        raise TypeError(
            f"treefx.compile: a PEFT {getattr(kind, 'value', kind) or 'prompt-learning'} model "
            "adds virtual tokens (or a key/value prefix) to every sequence, which treefx does "
            "not lay out on the tree; use a weight adapter (LoRA, ...) or train this model "
            "per sequence")


def _forward_parameters(model: torch.nn.Module, forward_signature=None) -> dict:
    """The parameters of the forward treefx calls, by which it decides what to pass besides
    ``input_ids`` (``attention_mask``, ``position_ids``, ``use_cache``).

    A forward written ``(*args, **kwargs)`` names none: for PEFT's ``PeftModel`` they are its
    base model's (``get_base_model()``, which it passes them to); for others,
    ``forward_signature`` (a callable or an ``inspect.Signature``) says what they are."""
    if forward_signature is not None:
        sig = forward_signature if isinstance(forward_signature, inspect.Signature) \
            else inspect.signature(forward_signature)
        return dict(sig.parameters)
    target = model
    while True:
        params = dict(inspect.signature(target.forward).parameters)
        named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if named or not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return params
        get_base = getattr(target, "get_base_model", None)  # PEFT's PeftModel
        base = get_base() if callable(get_base) else None
        if not isinstance(base, torch.nn.Module) or base is target:
            break
        log.info("%s.forward takes (*args, **kwargs): treefx passes the arguments its base "
                 "model's forward (%s) takes", type(target).__name__, type(base).__name__)
        target = base
    raise TypeError(
        f"treefx.compile: {type(target).__name__}.forward takes only (*args, **kwargs), so "
        "treefx cannot tell whether it takes attention_mask, position_ids or use_cache (a "
        "Hugging Face model needs attention_mask, or it reads the tree's positions as packed "
        "documents). Say which with the forward it passes them to: "
        "treefx.compile(model, forward_signature=model.<inner>.forward), or give the wrapper "
        "a forward with named arguments")


def verify_default() -> bool:
    """Whether compiled models verify themselves on their first call when ``verify`` is
    not given: yes, unless the environment variable ``TREEFX_VERIFY`` is ``0``
    (:attr:`treefx.options.Options.verify`)."""
    return Options.from_env().verify


def _parameter_device(model: torch.nn.Module) -> torch.device | None:
    """The device of the model's first parameter (None without parameters)."""
    p = next(iter(model.parameters()), None)
    return None if p is None else p.device


def compile(model: torch.nn.Module, *, backend: str = "auto", block_size: int = 128,
            pass_position_ids: bool | None = None,
            kernel_options: dict | None = None, interleave_heads: bool | None = None,
            verify: bool | None = None, logits: bool = True,
            forward_signature=None, regional: bool | None = None) -> TreeModel:
    """Compile ``model`` to run exactly on DFS-packed trees.

    ``model``: a causal LM taking ``input_ids`` [1, N] first and returning logits (a tensor,
    a tuple starting with them, or an object with ``.logits``): a Hugging Face model, a PEFT
    model with LoRA-style adapters (``peft.get_peft_model``), or your own module. A model
    already wrapped in ``torch.compile`` is unwrapped (``model._orig_mod``, the same
    parameters; logged): treefx compiles it itself, the wrapper's options do not apply.

    ``backend``: ``"inductor"`` (CUDA: FlexAttention with the tree block mask and Inductor's
    fused kernels, forward and backward; a ``ValueError`` here without CUDA, and at a call
    with a batch on the CPU), ``"eager"`` (any device: SDPA with the dense tree mask; the
    reference), or ``"auto"`` (inductor on CUDA, eager otherwise, chosen per batch).
    ``pass_position_ids``: give the model the tree positions (0-based offsets in each sequence)
    as ``position_ids``. Default: only when its forward requires them; otherwise the model
    computes its own positions with its own code and the passes evaluate that code per path
    (an ``arange`` over the tokens becomes the tree positions, a ``cumsum`` along them a sum
    along each path), which is exact whatever the model's convention.
    ``kernel_options``: FlexAttention kernel options for every tree attention site (tile sizes,
    ``num_warps``, ``USE_TMA``, ...; BENCHMARKS.md has measured ones), added to treefx's own.
    ``interleave_heads``: lay the KV heads out along the row, block by block, at every tree
    attention site: same values, a better schedule for FlexAttention's backward (otherwise the
    long shared-prefix key columns of the last heads run last). ``None`` (default): in graphs
    that compute gradients, not in no-grad forwards (the forward alone does not gain);
    ``True``/``False``: always/never. BENCHMARKS.md has the measurements.
    ``verify``: on the first call, run the compiled graph and the unmodified model on each
    sequence of a small probe forest and compare log-probabilities (and gradients when the
    call computes them); a difference raises :class:`treefx.TreeVerificationError` naming the
    worst token and parameter (see :func:`treefx.verify`). The model's ``.grad``, buffers and
    random state are left as they were; skipped with a warning when the graph draws random
    numbers (dropout in training mode). ``None`` (default): on, unless the environment sets
    ``TREEFX_VERIFY=0``.
    ``logits``: ``False`` returns only ``token_logprobs`` (``out.logits`` is None), computed
    from the hidden states with the output projection fused into the log-softmax, in chunks of
    tokens: the [N, vocab] logits are never built, with or without gradients (for old and
    reference log-probs under ``torch.no_grad()`` and for ``treefx.rl`` objectives). Same
    values and gradients as the default. A model whose logits are not a plain linear layer's
    output (a final softcap, an adapter on the output layer) still builds them, with a warning.
    ``forward_signature``: for a model whose forward is ``(*args, **kwargs)``, the callable
    (or ``inspect.Signature``) whose parameters it accepts, usually the forward of the module it
    passes them to: treefx passes ``attention_mask`` (all ones), ``position_ids`` and
    ``use_cache=False`` by it as for a model with that forward. PEFT's ``PeftModel`` needs
    none (its base model's forward is used); another such forward without it is an error.
    ``regional``: run the tree graph block by block (:mod:`treefx.run.regional`): the passes
    rewrite the whole captured forward, then it is cut at the decoder layers, each layer type
    is compiled once (compile time does not grow with depth), and each layer runs through its
    module's own call, where FSDP2 gathers and frees its parameters and DDP reduces its
    gradients. ``None`` (default): for a model sharded with ``fully_shard`` or wrapped in
    ``DistributedDataParallel`` (pass the wrapper; ``.model`` is its inner module), and
    through Inductor (the GPU) for a model with two decoder layers or more (the same step
    time as the whole graph, a first step that does not grow with depth; where regional
    execution refuses the model, e.g. hooks on a layer, the whole graph runs instead, with a
    warning); ``True``: always; ``False``: never, the whole graph compiled at once (an error
    for a model under FSDP2 or DDP).

    Compilation happens at the first call. A model already on a GPU (with the inductor
    backend) starts its background work here instead: Inductor's compile workers and, with
    cuDNN's frontend installed, the processes compiling its attention kernels, which then work
    while the job prepares its data and optimizer.
    """
    return TreeModel(model, backend, block_size=block_size, pass_position_ids=pass_position_ids,
                     kernel_options=kernel_options, interleave_heads=interleave_heads,
                     verify=verify, logits=logits, forward_signature=forward_signature,
                     regional=regional)


def verify(model, trees=None, **options) -> verification.VerificationReport:
    """Compare a tree-compiled model with the unmodified model run on each sequence alone.

    ``model``: a :class:`TreeModel` (its compiled graph is what gets checked) or a module
    (compiled here with ``treefx.compile`` options from ``options``, its own first-call
    check off). The other options are :func:`treefx.verification.verify_compiled`'s."""
    names = set(inspect.signature(verification.verify_compiled).parameters)
    check_opts = {k: v for k, v in options.items() if k in names}
    compile_opts = {k: v for k, v in options.items() if k not in names}
    if isinstance(model, TreeModel):
        if compile_opts:
            raise TypeError(f"compile options {sorted(compile_opts)} given for a model that "
                            "is already compiled")
        tm = model
    else:
        tm = compile(model, **{"verify": False, **compile_opts})
    return verification.verify_compiled(tm, trees, **check_opts)
