"""Models and checks the tests share: tiny Hugging Face configs, small modules that treefx
must refuse, the oracle check (values and gradients through :func:`treefx.verify`), and a
module run under Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import treefx
from treefx.verification import Tolerance

transformers = pytest.importorskip("transformers")


VOCAB = 64


HF_CONFIGS = {
    "qwen3": dict(model_type="qwen3", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "llama": dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2),
    # A window of 3 positions: shorter than most sequences here, so it matters.
    "mistral": dict(model_type="mistral", hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, sliding_window=3),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0),
    # Scores and logits the model transforms itself: softcaps, and a window of 5.
    "gemma2": dict(model_type="gemma2", hidden_size=32, intermediate_size=64,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   sliding_window=5),
}


def hf_model(name: str, impl: str, dtype=torch.float32) -> torch.nn.Module:
    cfg = dict(HF_CONFIGS[name])
    cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), vocab_size=VOCAB, **cfg)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(dtype)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def check_against_oracle(tm: treefx.TreeModel, trees, *, atol=1e-4, rtol=1e-4):
    """Log-probs per token and every gradient, with both reductions, equal the per-branch
    oracle (:func:`treefx.verify`: log-probs within ``atol``, each parameter's gradient
    within ``rtol`` relative); the logits cover the row and the loss equals the oracle's."""
    model = tm.model
    for reduction in ("sum", "mean"):
        report = treefx.verify(tm, trees, reduction=reduction, params="all",
                               tolerance=Tolerance(logprob=atol, grad=rtol))
        assert report.passed, f"{reduction}: {report}"
        assert report.compared_params == report.total_params > 0
        batch = treefx.pack(trees, reduction=reduction)
        out = tm(batch)
        assert out.logits.shape[:2] == (1, batch.num_tokens)
        assert torch.all(out.token_logprobs[batch.parent_token < 0] == 0)
        ref_loss = treefx.reference.sequence_loss(model, trees, reduction=reduction)
        torch.testing.assert_close(treefx.tree_loss(out, batch), ref_loss, atol=atol, rtol=rtol)


class EinsumAttention(torch.nn.Module):
    """Attention written with einsum: looks like attention, matches no pattern."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.mixer = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        q, k, v = self.mixer(x).chunk(3, dim=-1)
        att = torch.einsum("bqd,bkd->bqk", q, k).softmax(dim=-1)
        return self.head(torch.einsum("bqk,bkd->bqd", att, v))


class MaskedAttention(torch.nn.Module):
    """One attention layer with a mask of the model's own: :meth:`mask` builds it ([B or 1,
    1, n, n] bool, True where a query may attend) from index grids ``b``, ``qi``, ``ki``
    ([B, 1, 1, 1], [1, 1, n, 1], [1, 1, 1, n]) as masking utilities do (the mask-lifting
    tests' models)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, VOCAB)

    def embed(self, input_ids):
        return self.emb(input_ids)

    def mask(self, input_ids, x, b, qi, ki):
        raise NotImplementedError

    def forward(self, input_ids, position_ids=None):
        x = self.embed(input_ids)
        q, k, v = (t[:, None] for t in self.qkv(x).chunk(3, dim=-1))
        ar = torch.arange(x.shape[1])
        grids = (torch.arange(x.shape[0])[:, None, None, None], ar[None, None, :, None],
                 ar[None, None, None, :])
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=self.mask(input_ids, x, *grids))
        return self.head(out[:, 0])


class Wrapper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = EinsumAttention()

    def forward(self, input_ids):
        return self.block(input_ids)


class BreaksGraph(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if x.sum().item() > 0:  # data-dependent Python control flow: a graph break
            x = x * 2
        return self.head(x)


def run_under_tritons_interpreter(*module_args: str) -> str:
    """``python -m <module_args>`` with ``TRITON_INTERPRET=1`` (Triton's kernels run on the
    CPU, program by program): its standard output, after asserting it exited 0. Skips where
    Triton is absent (the CPU build of torch) or NumPy is 2.3 or newer (the interpreter turns
    one-element arrays into Python numbers, which newer NumPy refuses)."""
    pytest.importorskip("triton")
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 3):
        pytest.skip(f"Triton's interpreter needs NumPy < 2.3 (found {np.__version__})")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", *module_args], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
