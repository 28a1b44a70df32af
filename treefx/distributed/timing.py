"""Timed training steps, for :meth:`CostModel.measure <treefx.distributed.CostModel.measure>`:
the sample batches (synthetic agent trees of given sizes, or the caller's), the steps timed,
and the non-negative least-squares fit of their times."""

from __future__ import annotations

import logging
import math
import numbers
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .. import layout
from ..agent_trees import agent_tree
from ..layout import TreeBatch
from ..tree import Tree
from .sizes import attended_pairs, tree_list

__all__ = ["fit_nonnegative", "sample_batches", "time_steps"]

log = logging.getLogger("treefx")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        accelerator = getattr(torch, "accelerator", None)
        if accelerator is not None:
            accelerator.synchronize(device)


def scaled_tree(shape: str, tokens: int, *, seed: int, vocab_size: int) -> Tree:
    """A synthetic agent tree of about ``tokens`` unique tokens: ``"deep"`` is one rollout whose
    calls each extend the last (one path: ~N²/2 pairs), ``"wide"`` eight rollouts of a short
    prompt with the reasoning dropped between calls (far fewer pairs per token)."""
    def make(f: float) -> Tree:
        def r(n):
            k = max(1, round(n * f))
            return (k, k)
        if shape == "deep":
            return agent_tree(seed, vocab_size=vocab_size, system_len=r(100), prompt_len=r(50),
                              rollouts=1, turns=(4, 4), answer_len=r(40), tool_len=r(60),
                              think_mode=False, branch_prob=0.0)
        return agent_tree(seed, vocab_size=vocab_size, system_len=r(30), prompt_len=r(10),
                          rollouts=8, turns=(2, 2), think_len=r(30), answer_len=r(15),
                          tool_len=r(20), think_mode=True, branch_prob=0.0)

    f = tokens / 500.0
    tree = make(f)
    for _ in range(8):
        if abs(tree.num_tokens - tokens) <= 0.05 * tokens:
            break
        f *= tokens / tree.num_tokens
        tree = make(f)
    return tree


def sample_batches(samples, *, vocab_size: int, seed: int) -> list[list[Tree]]:
    if samples is None:
        samples = (1024, 2048, 4096, 8192)
    if isinstance(samples, Tree):
        samples = [samples]
    if not isinstance(samples, Sequence) or isinstance(samples, (str, bytes)) or not samples:
        raise TypeError("samples must be None, a non-empty sequence of token sizes (ints), or "
                        "of trees / lists of trees")
    if all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in samples):
        batches = []
        for k, n in enumerate(samples):
            if n < 16:
                raise ValueError(f"samples[{k}] = {n}: token sizes must be at least 16")
            s = seed + 1000 * k
            batches.append([scaled_tree("deep", int(n), seed=s, vocab_size=vocab_size)])
            batches.append([scaled_tree("wide", int(n), seed=s + 1, vocab_size=vocab_size)])
            batches.append([scaled_tree("deep", int(n) // 2, seed=s + 2, vocab_size=vocab_size),
                            scaled_tree("wide", int(n) // 2, seed=s + 3, vocab_size=vocab_size)])
        return batches
    batches = []
    for k, s in enumerate(samples):
        if isinstance(s, numbers.Integral) and not isinstance(s, bool):
            raise TypeError("samples mixes token sizes and trees; give one kind")
        batch = tree_list(s, f"samples[{k}]")
        if not batch:
            raise ValueError(f"samples[{k}] is empty")
        batches.append(batch)
    return batches


def fit_nonnegative(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Coefficients β ≥ 0 (one per column of ``x``) and a free intercept minimizing
    Σ ((x β + c − t) / t)²; exact for a few columns: every subset of them is solved by least
    squares and the best solution with all its coefficients ≥ 0 kept."""
    n, k = x.shape
    w = 1.0 / np.maximum(t, np.finfo(np.float64).tiny)
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    best, best_err = np.zeros(k), math.inf
    for mask in range(1 << k):
        cols = [j for j in range(k) if mask >> j & 1]
        a = np.column_stack([xs[:, cols], np.ones(n)]) * w[:, None]
        sol, *_ = np.linalg.lstsq(a, t * w, rcond=None)
        if np.any(sol[:-1] < 0) or not np.all(np.isfinite(sol)):
            continue
        err = float(np.sum((a @ sol - t * w) ** 2))
        if err < best_err:
            beta = np.zeros(k)
            beta[cols] = sol[:-1]
            best, best_err = beta, err
    return best / scale


def time_steps(step_fn: Callable[[TreeBatch], None], batches: list[list[Tree]],
               device: torch.device, *, repeats: int, warmup: int,
               pack_kwargs: dict) -> tuple[list[list[int]], list[float]]:
    """Each batch packed and moved to ``device``, its step run ``warmup`` times, then timed
    ``repeats`` times: per batch its (tokens, attended pairs, trees) and the median time."""
    rows, times = [], []
    for trees in batches:
        batch = layout.pack(trees, **pack_kwargs).to(device)
        for _ in range(warmup):
            step_fn(batch)
        samples_t = []
        for _ in range(repeats):
            synchronize(device)
            t0 = time.perf_counter()
            step_fn(batch)
            synchronize(device)
            samples_t.append(time.perf_counter() - t0)
        t = statistics.median(samples_t)
        rows.append([sum(x.num_tokens for x in trees), sum(attended_pairs(x) for x in trees),
                     len(trees)])
        times.append(t)
        log.debug("CostModel.measure: %d tokens, %d pairs, %d trees: %.6f s",
                  *rows[-1], t)
    return rows, times
