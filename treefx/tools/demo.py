"""``treefx demo``: train a small decoder on synthetic agent trees, side by side with the
per-sequence baseline it must reproduce."""

from __future__ import annotations

import time

import torch

from .. import reference
from ..layout import pack
from ..models import tiny_decoder
from ..run.model import compile, tree_loss
from . import synth


def run_demo(steps: int = 5, seed: int = 0, device: str | None = None) -> int:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    vocab = 512
    trees = synth.dataset(steps, seed, vocab_size=vocab, rollouts=3, system_len=(60, 120),
                          prompt_len=(10, 40), think_len=(20, 80), answer_len=(5, 30),
                          tool_len=(10, 60), mask_outputs=True)
    torch.manual_seed(seed)
    model = tiny_decoder(vocab_size=vocab).to(device)
    tm = compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    unique = sum(t.num_tokens for t in trees)
    baseline = sum(t.num_baseline_tokens for t in trees)
    print(f"treefx demo: {len(trees)} synthetic agent trees, {unique} unique tokens, {baseline} "
          f"tokens over all sequences (POR {1 - unique / baseline:.3f}, bound "
          f"{baseline / unique:.2f}x), device {device}")
    print(f"{'step':>4}  {'seqs':>4}  {'tree loss':>10}  {'per-branch':>10}  {'|diff|':>8}  "
          f"{'tree ms':>8}  {'branch ms':>9}")
    worst = 0.0
    for step, tree in enumerate(trees):
        batch = pack(tree, reduction="mean").to(device)
        t0 = time.perf_counter()
        loss = tree_loss(tm(batch), batch)
        loss.backward()
        t_tree = time.perf_counter() - t0
        g_tree = [p.grad.clone() for p in model.parameters()]
        opt.zero_grad()
        t0 = time.perf_counter()
        ref = reference.sequence_loss(model, tree, reduction="mean")
        ref.backward()
        t_ref = time.perf_counter() - t0
        g_err = max(((g - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()
                    for g, p in zip(g_tree, model.parameters()))
        worst = max(worst, g_err)
        for g, p in zip(g_tree, model.parameters()):
            p.grad.copy_(g)
        opt.step()
        opt.zero_grad()
        note = "  (includes compile)" if step == 0 else ""
        print(f"{step:>4}  {tree.num_sequences:>4}  {loss.item():>10.5f}  {ref.item():>10.5f}  "
              f"{abs(loss.item() - ref.item()):>8.1e}  {1e3 * t_tree:>8.0f}  "
              f"{1e3 * t_ref:>9.0f}{note}")
    print(f"largest relative gradient difference, tree vs per-branch: {worst:.1e}")
    print("Step times here are a tiny model on the eager backend (a dense N x N mask on the CPU); "
          "speed is measured on the GPU: see BENCHMARKS.md.")
    return 0
