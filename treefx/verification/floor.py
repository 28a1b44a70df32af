"""The oracle's own floating-point floor: the per-sequence run compared with itself on sequences
extended by random tokens, one rounding more or less at each layer; and how causal the model
is (its log-probs when only later tokens change)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from .. import reference as oracle_mod
from ..tree import Tree
from .oracle import grads_of, model_state_kept, oracle_run
from .probe import probe_vocab_size

__all__ = ["causal_error", "extended_trees", "oracle_floor_gradients", "rounding_noise"]


@contextlib.contextmanager
def rounding_noise(model: torch.nn.Module, seed: int):
    """The outputs of the model's input embeddings and of every ``nn.Linear`` moved,
    relatively, by up to one unit roundoff of their dtype: one rounding more or less at each
    layer, as a tree run's other kernels and shapes give it. Its effect on the outputs is the
    spread the model's own rounding has, where the model amplifies it: an MoE router whose
    top-k flips at near ties moves its gate's gradient by ~10% in bfloat16 at
    DeepSeek-V2-Lite's shapes, for the plain per-sequence run against float32 as much as for
    the tree. Extending the sequences alone leaves most tokens' arithmetic as it was."""
    mods = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))]
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, torch.nn.Module) and emb not in mods:
            mods.append(emb)
    gens: dict = {}

    def hook(module, args, out):
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return None
        gen = gens.get(out.device)
        if gen is None:
            gen = gens[out.device] = torch.Generator(device=out.device).manual_seed(seed + 1)
        u = torch.rand(out.shape, generator=gen, device=out.device, dtype=torch.float32)
        eps = torch.finfo(out.dtype).eps / 2
        return out + (out.float() * (2 * u - 1) * eps).to(out.dtype)

    handles = [m.register_forward_hook(hook) for m in mods]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def causal_error(oracle, trees, vocab: int, seed: int, ref_lp) -> float:
    """The largest change of a sequence's log-probs when only the tokens after them change:
    each sequence run alone with two different random suffixes (no rounding noise, the same
    shapes). Zero up to rounding for a causal model. ``ref_lp``: the sequences' own
    log-probs (their lengths say where the suffixes start)."""
    a, b = (oracle_run(oracle, extended_trees(trees, vocab, s), "sum", [])[0]
            for s in (seed + 1, seed + 2))
    return max((float((x[:len(r)].double() - y[:len(r)].double()).abs().max())
                for r, x, y in zip(ref_lp, a, b) if len(r)), default=0.0)


def extended_trees(trees: list[Tree], vocab: int, seed: int, extra: int = 8) -> list[Tree]:
    """``trees`` with ``extra`` random tokens appended to every sequence, loss mask 0 on them
    (weights kept): for a causal model the same losses and gradients, in other shapes."""
    rng = np.random.default_rng(seed + 7919)
    out = []
    for t in trees:
        seqs = [list(s) + rng.integers(0, vocab, size=extra).tolist() for s in t.sequences]
        masks = [list(t.loss_mask(i)) + [0] * extra for i in range(t.num_sequences)]
        out.append(Tree.from_sequences(seqs, weights=t.weights, loss_masks=masks))
    return out


def oracle_floor_gradients(model: torch.nn.Module, trees, *, reduction: str = "mean",
                           num_sequences: int | None = None, seed: int = 0
                           ) -> dict[str, torch.Tensor]:
    """The per-sequence gradients once more, computed another way, to measure the oracle's own
    floating-point floor. Each sequence gets random tokens appended with no loss on them (for a
    causal model the same loss and gradients, in other kernel shapes) and every embedding and
    linear output is moved by up to one rounding of its dtype. The difference between these
    and the oracle's gradients is what rounding alone gives; a tolerance below it fails on
    some CPUs whatever treefx does (Hugging Face's Gated DeltaNet, which computes in float32
    with cancellation on ``A_log`` and ``dt_bias``). Returns ``{name: gradient}`` of the
    trainable parameters (zeros where the loss does not reach one); ``.grad`` is left as it
    was."""
    trees = [trees] if isinstance(trees, Tree) else list(trees)
    vocab = probe_vocab_size(model, max(int(seg.max()) for t in trees for seg in t.segments
                                        if len(seg)))
    extended = extended_trees(trees, vocab, seed)
    chosen = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with model_state_kept(model, chosen), rounding_noise(model, seed):
        got = grads_of(lambda: oracle_mod.sequence_loss(model, extended, reduction=reduction,
                                                      num_sequences=num_sequences),
                     chosen, model)
    return {n: torch.zeros_like(p) if g is None else g.detach()
            for (n, p), g in zip(chosen, got)}
