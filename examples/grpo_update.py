"""One GRPO update on a tree (CPU, about 15 s).

A GRPO group: one prompt, G = 8 sampled rollouts of an agent (multi-turn, think-mode, parallel
tool calls), each rollout several model calls. All calls of the group form one prefix tree. One
reward per rollout gives group-normalized advantages A_g = (R_g − mean R) / std R, shared by
every call of rollout g. One PPO-clip step (plus a k3 KL penalty to the reference policy) with
AdamW, on the tree, next to the same objective computed call by call.

Timings on the CPU are only indicative: the eager backend attends with a dense N x N tree mask
and a tiny model, so attention dominates; the GPU path uses block-sparse FlexAttention.
"""

import time

import numpy as np
import torch

import treefx
from treefx import rl
from treefx.models import tiny_decoder

SEED, GROUP, VOCAB = 0, 8, 512
SHAPE = dict(vocab_size=VOCAB, system_len=(60, 100), prompt_len=(20, 40), turns=(2, 3),
             think_len=(10, 30), answer_len=(5, 15), tool_len=(10, 30), mask_outputs=True)
CLIP_EPS, KL_COEF, LR = 0.2, 0.04, 3e-3


def rollout_of_each_sequence(seed: int, group: int, **shape) -> np.ndarray:
    """Which rollout each sequence (model call) of ``agent_tree(seed, rollouts=group)`` is from.

    agent_tree records no rollout ids, but it draws rollout after rollout, so the first k
    rollouts of the group are exactly the tree of ``rollouts=k``: count its sequences."""
    full = treefx.synth.agent_tree(seed, rollouts=group, **shape).sequences
    ends = []
    for k in range(1, group + 1):
        seqs = treefx.synth.agent_tree(seed, rollouts=k, **shape).sequences
        assert seqs == full[: len(seqs)], "agent_tree no longer generates rollouts in order"
        ends.append(len(seqs))
    return np.repeat(np.arange(group), np.diff([0, *ends]))


def per_branch_objective(model, tree, advantages, old, ref, reduction):
    """The same objective, one model call at a time, averaged over the P model calls:
    (1/P) Σ_p ω_p r_p Σ_{j≥1} m_p(j) [−min(ρA_p, clip(ρ)A_p) + β·k3(log π_ref − log π)]."""
    total = torch.zeros(())
    for p, lp in enumerate(treefx.reference.sequence_logprobs(model, tree)):
        m = torch.as_tensor(tree.loss_mask(p)[1:], dtype=lp.dtype)
        n = float(m.sum())
        r = 1.0 if reduction == "sum" else (1.0 / n if n > 0 else 0.0)
        ratio = torch.exp(lp - old[p])
        surrogate = torch.minimum(ratio * advantages[p],
                                  ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * advantages[p])
        d = ref[p] - lp
        kl = torch.exp(d) - d - 1
        total = total + float(tree.weights[p]) * r * (m * (-surrogate + KL_COEF * kl)).sum()
    return total / tree.num_sequences


def grads(model):
    out = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


# A model this small runs fastest on one CPU thread; with several, on a busy machine, the
# thread pool stalled for seconds and made the timings below meaningless.
torch.set_num_threads(1)

tree = treefx.synth.agent_tree(SEED, rollouts=GROUP, **SHAPE)
rollout = rollout_of_each_sequence(SEED, GROUP, **SHAPE)
rewards = np.random.default_rng(SEED).normal(size=GROUP)
group_adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
advantages = torch.tensor(group_adv[rollout], dtype=torch.float32)  # [P]: one per model call
batch = treefx.pack(tree, reduction="mean")

torch.manual_seed(SEED)
model = tiny_decoder(vocab_size=VOCAB)
optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
tree_model = treefx.compile(model)

with torch.no_grad():  # the policy that sampled the group (here also the KL reference)
    old = tree_model(batch).token_logprobs
# Per call, for the per-branch objective: the same numbers read along each call's path.
old_per_call = [old[batch.sequence_index(p)[1:]] for p in range(batch.num_sequences)]


def tree_objective():
    lp = tree_model(batch).token_logprobs
    loss, stats = rl.ppo_clip_loss(lp, batch, advantages, old, clip_eps=CLIP_EPS,
                                   return_stats=True)
    return loss + rl.kl_penalty(lp, batch, old, estimator="k3", coef=KL_COEF), stats


def branch_objective():
    return per_branch_objective(model, tree, advantages, old_per_call, old_per_call,
                                batch.reduction)


def timed_gradients(objective):
    t0 = time.perf_counter()
    value = objective()
    value = value[0] if isinstance(value, tuple) else value
    value.backward()
    return value.detach(), grads(model), time.perf_counter() - t0


# Warm-up, kept out of the timings: Dynamo compiles the tree graph (once more for grad mode),
# and the CPU picks kernels for every new shape (each call of the per-branch run is one).
warm_s = sum(timed_gradients(f)[2] for f in (tree_objective, branch_objective))
loss, g_tree, tree_s = timed_gradients(tree_objective)
baseline, g_branch, branch_s = timed_gradients(branch_objective)
grad_err = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(g_tree, g_branch))

for p, g in zip(model.parameters(), g_tree):
    p.grad = g
optimizer.step()
optimizer.zero_grad(set_to_none=True)

# The same group after the step (the next PPO epoch would start here): ratios now move.
with torch.no_grad():
    after, stats = tree_objective()
    after_branch = branch_objective()

print(f"GRPO group: {GROUP} rollouts, {tree.num_sequences} model calls, {tree.num_tokens} tree "
      f"tokens for {tree.num_baseline_tokens} per-call tokens: POR {tree.por:.3f}, "
      f"bound {tree.bound:.2f}x")
print(f"rewards {np.round(rewards, 2).tolist()} -> advantages {np.round(group_adv, 2).tolist()}")
print(f"{'':28}{'tree':>14}{'per-branch':>14}")
print(f"{'objective before the step':28}{loss.item():14.8f}{baseline.item():14.8f}")
print(f"{'objective after the step':28}{after.item():14.8f}{after_branch.item():14.8f}")
print(f"{'forward + backward':28}{tree_s:13.3f}s{branch_s:13.3f}s")
print(f"max relative gradient difference {grad_err:.1e} (float32); warm-up {warm_s:.1f}s")
print(f"after the step: clip fraction {stats['clip_fraction'].item():.3f}, "
      f"approx KL(old || new) {stats['approx_kl'].item():.2e}")
