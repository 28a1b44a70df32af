"""MiniMax's lightning attention: a layer whose forward runs the recurrence in a block loop,
replaced during capture by one recurrence node (:class:`treefx.compiler.recurrences.
LayerFamily`)."""

from __future__ import annotations

import logging
import sys

import torch

from ..compiler.recurrences import (
    LayerFamily,
    Recurrence,
    UnsupportedLayerError,
    lookup,
    register_layer_family,
    register_recurrence,
)
from ..ops.lightning import lightning_attention

__all__ = ["LIGHTNING", "check_lightning_tables", "is_lightning_layer", "lightning_forward",
           "lightning_matches", "lightning_recurrence"]

log = logging.getLogger("treefx")


_LIGHTNING_PARTS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay", "block_size",
                    "qkv_proj", "output_gate", "out_proj", "norm", "act_fn",
                    "num_attention_heads", "head_dim")


def is_lightning_layer(m: torch.nn.Module) -> bool:
    """A layer built like Hugging Face's MiniMax lightning attention: per-head decay rates
    ``slope_rate`` and the block decay tables of its chunked loop."""
    return all(hasattr(m, a) for a in _LIGHTNING_PARTS) and "forward" in type(m).__dict__


def lightning_recurrence() -> Recurrence:
    if lookup("lightning_attention") is None:
        register_recurrence(Recurrence(
            name="lightning_attention", fn=lightning_attention,
            seq_args={"query": 1, "key": 1, "value": 1, "g": 1}, output_like="value",
            neutral={"g": 0.0}))  # no decay, zero keys and values: the state is unchanged
    return lookup("lightning_attention")


def lightning_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
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
    out, _ = lightning_recurrence().marker(q, k, v, g)
    out = self.norm(out.reshape(b, n, h * d))
    out = torch.sigmoid(self.output_gate(hidden_states)) * out
    return self.out_proj(out), None


def check_lightning_tables(name: str, m: torch.nn.Module) -> None:
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


def lightning_matches(m: torch.nn.Module) -> bool:
    """Whether the layer's own forward and :func:`lightning_forward` agree on a float64
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
                out = lightning_forward(twin, x, None, None)[0]
                # The layer's decay tables are built in float32: ~1e-7 apart from float64.
                if not torch.allclose(out, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max())):
                    return False
        return True
    except Exception as e:  # noqa: BLE001 - a layer that cannot be probed is left alone
        log.info("lightning attention probe failed: %s", e)
        return False


LIGHTNING = LayerFamily(name="lightning attention", is_layer=is_lightning_layer,
                        check=check_lightning_tables, matches=lightning_matches,
                        forward=lightning_forward, recurrence=lightning_recurrence)
register_layer_family(LIGHTNING)
