"""verl's FSDP training engine with every micro-batch run as a prefix tree.

In verl (0.9.1) the actor's, the reference model's and ``compute_log_prob``'s model work goes
through a training engine chosen from ``verl.workers.engine.base.EngineRegistry`` by model type,
backend (``strategy``) and device. The language-model engine, ``FSDPEngineWithLMHead``, turns a
micro-batch (a ``TensorDict`` of jagged rows: a prompt then its response) into model inputs, runs
the model, and hands each row position's log-probability of the next token (and the entropy
there) to the loss function, as jagged tensors in the rows' layout.

:class:`TreeFSDPEngine` is that engine with the model call replaced: the micro-batch's rows
become one :class:`treefx.Tree` (a trie: the rollouts of one prompt share the prompt's nodes,
turns of a multi-turn rollout share the earlier turns), the model compiled by
:func:`treefx.compile` runs once over its depth-first layout, and the per-position outputs are
gathered back into verl's layout, differentiably. Everything else is verl's own: the
micro-batches (``prepare_micro_batches``: same rows, same order), the loss functions
(``ppo_loss``, ``sft_loss``), the metrics, gradient accumulation, clipping, the optimizer,
FSDP2's sharding, checkpoints, offload.

**Selecting it.** Two keys of verl's model config (both the actor's and the reference's)::

    actor_rollout_ref.model.external_lib=treefx.integrations.verl
    actor_rollout_ref.model.model_type=tree_language_model
    actor_rollout_ref.actor.strategy=fsdp2           # and ref.strategy

``external_lib`` makes each worker import this module, which registers the engine under model
type :data:`MODEL_TYPE` for the ``fsdp2`` backend on CUDA and on the CPU. To pass options to
:func:`treefx.compile`, register from a module of your own that ``external_lib`` names:
``treefx.integrations.verl.register(compile_options={...})``.

**What is the same, and what is refused.** The outputs are the stock engine's at every position
verl computes one: ``log_probs`` (position t: log p(row[t+1] | row[:t+1]) at the temperature;
at a row's last position the token after it in the packed micro-batch, as the stock engine's
rolled labels give, a value the losses mask), ``entropy`` and ``sum_pi_squared`` of that
distribution. ``use_remove_padding`` on or off, ``use_fused_kernels``, ``pad_to_length`` and
dynamic batch sizes do not change what is computed. Refused, in one line, before the model runs:
Ulysses sequence parallelism, the ``fsdp`` (FSDP1) strategy, LoRA (``lora_rank > 0``),
multi-modal inputs, 3-D (mRoPE) position ids, position ids other than 0, 1, ... within each row,
routing replay (``routed_experts``), and top-k distillation.

Each distinct tree row's log-sum-exp and entropy is computed once (positions of rows that share
a prefix share it), in float32, in chunks recomputed in the backward
(:func:`treefx.integrations.vocab.logits_row_statistics`).

verl 0.9.1 has no CPU platform; :func:`use_cpu_platform` gives it one, so that its FSDP engine
and this one run on the CPU with gloo (the tests and ``examples/verl_engine.py`` do).

Only :data:`SUPPORTED_VERL_VERSIONS` are accepted: the engine depends on internals of
``FSDPEngineWithLMHead`` that change between releases, and importing this module with another
version raises an ``ImportError`` naming the versions that work.
"""

from __future__ import annotations

import contextlib
import logging

import torch

import treefx
from treefx.integrations.vocab import logits_row_statistics

__all__ = ["MODEL_TYPE", "SUPPORTED_VERL_VERSIONS", "TreeFSDPEngine", "check_verl_version",
           "register", "update_batch", "use_cpu_platform"]

log = logging.getLogger("treefx")

#: The verl releases this integration is tested with (``pip install "treefx[verl]"`` pins them).
SUPPORTED_VERL_VERSIONS = ("0.9.1",)

#: The model type (``actor_rollout_ref.model.model_type``) the tree engine is registered under.
MODEL_TYPE = "tree_language_model"


def check_verl_version(version: str | None = None) -> str:
    """The installed verl version (or ``version``), or an ``ImportError`` naming the versions
    this integration supports when it is not one of them."""
    if version is None:
        try:
            import verl
        except ImportError as e:
            raise ImportError(
                "treefx.integrations.verl needs verl: pip install \"treefx[verl]\" "
                f"(verl=={SUPPORTED_VERL_VERSIONS[-1]})") from e
        version = verl.__version__
    if version not in SUPPORTED_VERL_VERSIONS:
        raise ImportError(
            f"treefx.integrations.verl supports verl {' or '.join(SUPPORTED_VERL_VERSIONS)}, the "
            f"versions it is tested with; verl {version} is installed. It subclasses "
            "FSDPEngineWithLMHead (forward_step, _build_module) whose internals change between "
            f"releases: pip install \"verl=={SUPPORTED_VERL_VERSIONS[-1]}\"")
    return version


check_verl_version()

from tensordict import TensorDict  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.device import get_device_id, get_device_name  # noqa: E402
from verl.workers.engine.base import EngineRegistry  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine.utils import detach_tree  # noqa: E402


class TreeFSDPEngine(FSDPEngineWithLMHead):
    """verl's ``FSDPEngineWithLMHead`` whose micro-batches run as prefix trees (see the module's
    docstring). Built and driven exactly as the stock engine (``EngineRegistry.new`` with model
    type :data:`MODEL_TYPE`, or the class itself with verl's four configs).

    ``compile_options``: keyword arguments for :func:`treefx.compile` (class attribute, set by
    :func:`register`). ``tree_stats``: the tokens the trees ran (``"tree_tokens"``) against the
    rows' own (``"sequence_tokens"``), summed over every micro-batch so far."""

    compile_options: dict = {}

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        problems = []
        if engine_config.ulysses_sequence_parallel_size > 1:
            problems.append(f"Ulysses sequence parallelism (ulysses_sequence_parallel_size="
                            f"{engine_config.ulysses_sequence_parallel_size}; a tree is not cut "
                            "across ranks)")
        if engine_config.strategy != "fsdp2":
            problems.append(f"strategy={engine_config.strategy!r} (use fsdp2: treefx runs "
                            "FSDP2's per-layer modules, not FSDP1's flat parameters)")
        if getattr(model_config, "lora_rank", 0) > 0:
            problems.append(f"LoRA (lora_rank={model_config.lora_rank}; verl switches the "
                            "adapters off around reference calls, which a compiled graph does "
                            "not see)")
        if problems:
            raise ValueError("treefx's verl engine does not support " + "; ".join(problems))
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self._tree_model = None
        self._tree_model_of = None
        self.tree_stats: dict[str, int] = {"tree_tokens": 0, "sequence_tokens": 0}

    def _build_module(self):
        # The stock builder picks the HF class by model type: this engine's is a language model.
        cfg = self.model_config
        saved, cfg.model_type = cfg.model_type, "language_model"
        try:
            return super()._build_module()
        finally:
            cfg.model_type = saved

    @property
    def tree_model(self):
        """The :func:`treefx.compile` of the engine's (FSDP2-sharded) module, made on first use."""
        if self._tree_model is None or self._tree_model_of is not self.module:
            self._tree_model = treefx.compile(self.module, **self.compile_options)
            self._tree_model_of = self.module
            log.info("treefx.integrations.verl: compiled %s for trees", type(self.module).__name__)
        return self._tree_model

    def forward_step(self, micro_batch: TensorDict, loss_function, forward_only):
        # FSDPEngineWithLMHead.forward_step (verl 0.9.1) with the model call and the outputs'
        # preparation replaced by the tree's.
        device_name = get_device_name()
        micro_batch = micro_batch.to(get_device_id())
        autocast_dtype = getattr(self, "_autocast_dtype", torch.bfloat16)
        autocast_ctx = (contextlib.nullcontext() if autocast_dtype == torch.float32
                        else torch.autocast(device_type=device_name, dtype=autocast_dtype))
        with autocast_ctx:
            model_output = self.tree_outputs(micro_batch)
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=micro_batch,
                                              dp_group=self.get_data_parallel_group())
            else:
                assert forward_only, "forward_only must be True when loss_function is None"
                loss = torch.tensor(1.0, device=device_name)
                metrics = {}
            output = {"model_output": detach_tree(model_output), "loss": loss.detach().item(),
                      "metrics": metrics}
            return loss, output

    def tree_outputs(self, micro_batch: TensorDict) -> dict:
        """The stock engine's ``model_output`` for ``micro_batch`` (``log_probs`` and, as the
        micro-batch asks, ``entropy`` and ``sum_pi_squared``: jagged [rows, positions]), from
        one run of the tree model over the prefix tree of its rows."""
        get = lambda key, default=False: tu.get_non_tensor_data(  # noqa: E731
            data=micro_batch, key=key, default=default)
        _refuse_micro_batch(micro_batch, get)
        entropy, spp = get("calculate_entropy"), get("calculate_sum_pi_squared")
        input_ids = micro_batch["input_ids"]
        values, offsets = input_ids.values(), input_ids.offsets()
        lengths = offsets.diff().tolist()
        _check_positions(micro_batch["position_ids"], lengths)
        flat = values.tolist()
        starts = offsets.tolist()
        seqs = [flat[s:s + n] for s, n in zip(starts, lengths)]
        device = values.device

        tree = treefx.Tree.from_sequences(seqs)
        batch = treefx.pack(tree).to(device)
        out = self.tree_model(batch)
        if out.logits is None:
            raise ValueError("treefx's verl engine needs the logits: compile with logits=True "
                             "(treefx.compile's default), not logits=False")
        self.tree_stats["tree_tokens"] += tree.num_tokens
        self.tree_stats["sequence_tokens"] += sum(lengths)
        logits = out.logits[0]
        # Each position's tree row, and its label as the stock engine rolls them: the next token
        # of the packed micro-batch (a row's last position takes the next row's first token).
        index = torch.cat([batch.sequence_index(p) for p in range(len(seqs))]).to(device)
        labels = torch.roll(values, shifts=-1, dims=0)
        temperature = _row_temperatures(micro_batch["temperature"], len(seqs))
        row_of = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths))
        distinct = sorted(set(temperature))

        log_probs = torch.empty(values.numel(), dtype=torch.float32, device=device)
        ent = torch.empty_like(log_probs) if entropy else None
        sq = torch.empty_like(log_probs) if spp else None
        results = []
        for t in distinct:
            if len(distinct) == 1:
                pos = torch.arange(values.numel(), device=device)
            else:
                rows_at_t = torch.tensor([temperature[r] == t for r in range(len(seqs))])
                pos = rows_at_t[row_of].nonzero().reshape(-1).to(device)
            nodes, inverse = torch.unique(index[pos], return_inverse=True)
            lse, e, s = logits_row_statistics(logits, nodes, t, entropy=entropy,
                                              sum_pi_squared=spp)
            lp = logits[index[pos], labels[pos]].float() / t - lse[inverse]
            results.append((pos, lp, e[inverse] if entropy else None,
                            s[inverse] if spp else None))
        # Scatter back differentiably (index_put on fresh tensors keeps the autograd graph).
        log_probs = _scatter(log_probs, [(p, v) for p, v, _, _ in results])
        if entropy:
            ent = _scatter(ent, [(p, v) for p, _, v, _ in results])
        if spp:
            sq = _scatter(sq, [(p, v) for p, _, _, v in results])

        nested = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets)  # noqa: E731
        model_output = {"log_probs": nested(log_probs)}
        if entropy:
            model_output["entropy"] = nested(ent)
        if spp:
            model_output["sum_pi_squared"] = nested(sq)
        return model_output


def _scatter(into: torch.Tensor, parts) -> torch.Tensor:
    for pos, v in parts:
        into = into.index_put((pos,), v.to(into.dtype))
    return into


def _row_temperatures(temperature, rows: int) -> list[float]:
    if isinstance(temperature, torch.Tensor):
        values = temperature.reshape(-1).tolist()
        if len(values) == 1:
            values = values * rows
        if len(values) != rows:
            raise ValueError(f"temperature has {len(values)} entries for {rows} rows")
        return [float(v) for v in values]
    return [float(temperature)] * rows


def _refuse_micro_batch(micro_batch: TensorDict, get) -> None:
    problems = []
    if get("distillation_use_topk") or get("distillation_only"):
        problems.append("top-k distillation")
    if "routed_experts" in micro_batch.keys() and get("enable_routing_replay", True):
        problems.append("routing replay (routed_experts)")
    mm = micro_batch.get("multi_modal_inputs", None) if "multi_modal_inputs" in \
        micro_batch.keys() else None
    if mm is not None and len(mm) and any(x for x in mm):
        problems.append("multi-modal inputs")
    if problems:
        raise ValueError("treefx's verl engine does not support " + ", ".join(problems) +
                         " (text-only rows)")


def _check_positions(position_ids, lengths: list[int]) -> None:
    if position_ids.dim() == 3 or (position_ids.is_nested and position_ids.values().dim() != 1):
        raise ValueError("treefx's verl engine does not support 3-D (mRoPE) position ids: "
                         "text-only rows")
    got = position_ids.values() if position_ids.is_nested else position_ids.reshape(-1)
    want = torch.cat([torch.arange(n) for n in lengths]).to(got.device)
    if got.shape != want.shape or not bool((got == want).all()):
        raise ValueError("treefx's verl engine needs each row's position ids to be 0, 1, 2, ... "
                         "(a tree gives each token its offset in its own row); this micro-batch's "
                         "rows number their tokens otherwise")


def update_batch(rows, per_token: dict[str, torch.Tensor] | None = None, **metadata) -> TensorDict:
    """verl's batch for ``rows`` as its trainer hands it to the actor: ``rows`` are (prompt ids,
    response ids) pairs; they are laid out as verl's rollout returns them (prompts left-padded,
    responses right-padded, ``attention_mask``, ``position_ids`` 0, 1, ... per row,
    ``response_mask``), with ``per_token`` ([rows, longest response] tensors: ``old_log_probs``,
    ``advantages``, ``ref_log_prob``, ...) beside them, then made jagged by verl's
    ``left_right_2_no_padding``; ``metadata`` (``temperature``, ``global_batch_size``,
    ``micro_batch_size_per_gpu``, ...) is assigned as the worker assigns it. For examples,
    tests and benchmarks that drive an engine without verl's trainer."""
    from verl.workers.utils.padding import left_right_2_no_padding

    B = len(rows)
    P = max(len(p) for p, _ in rows)
    R = max(len(r) for _, r in rows)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    mask = torch.zeros(B, P + R, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        prompts[b, P - len(p):] = torch.as_tensor(p)
        responses[b, :len(r)] = torch.as_tensor(r)
        mask[b, P - len(p):P + len(r)] = 1
    fields = {"prompts": prompts, "responses": responses, "attention_mask": mask,
              "input_ids": torch.cat([prompts, responses], 1),
              "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
              "response_mask": mask[:, P:].clone()}
    for key, value in (per_token or {}).items():
        if tuple(value.shape[:2]) != (B, R):
            raise ValueError(f"update_batch: {key} has shape {tuple(value.shape)}, not the rows "
                             f"by the longest response ({B}, {R})")
        fields[key] = value
    td = left_right_2_no_padding(tu.get_tensordict(fields))
    if metadata:
        tu.assign_non_tensor(td, **metadata)
    return td


def register(compile_options: dict | None = None,
             devices: tuple[str, ...] = ("cuda", "cpu")) -> type[TreeFSDPEngine]:
    """Register :class:`TreeFSDPEngine` in verl's engine registry under model type
    :data:`MODEL_TYPE`, backend ``fsdp2``, on ``devices`` (done once when this module is
    imported; again only to change ``compile_options``, the :func:`treefx.compile` options)."""
    if compile_options is not None:
        TreeFSDPEngine.compile_options = dict(compile_options)
    table = EngineRegistry._engines.setdefault(MODEL_TYPE, {}).setdefault("fsdp2", {})
    for device in devices:
        table[device] = TreeFSDPEngine
    return TreeFSDPEngine


register()


def use_cpu_platform() -> None:
    """Give verl a CPU platform (verl 0.9.1 has none and falls back to CUDA's), so that its FSDP
    engines run on the CPU with gloo: for tests and CPU examples. Call before verl builds an
    engine. Leaves an accelerator machine alone."""
    from verl.plugin.platform import platform_manager
    from verl.plugin.platform.platform_base import PlatformBase

    if torch.cuda.is_available():
        return
    current = platform_manager._current_platform
    if current is None or current.device_name != "cpu":
        platform_manager._current_platform = _cpu_platform(PlatformBase)


class _CPUModule:
    """``torch.cpu`` with the memory statistics verl's workers read (zero on the CPU)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def max_memory_allocated(*_):
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    @staticmethod
    def get_device_name(*_):
        return "cpu"

    @staticmethod
    def mem_get_info(*_):
        import psutil

        vm = psutil.virtual_memory()
        return vm.available, vm.total


def _cpu_platform(base: type):
    """verl's platform for the CPU, a subclass of verl's ``PlatformBase`` (``base``)."""
    class CPUPlatform(base):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: _CPUModule())

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            pass

        profiler_stop = profiler_start

        def ray_resource_name(self):
            return "CPU"

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    return CPUPlatform()
