"""From an inference engine's rollouts to one GRPO update (CPU, about half a minute).

An agent answers one task G = 4 times (a GRPO group); each rollout makes two model calls: a
tool call, then the answer. For every call the "engine" returns what it really ran: the prompt
ids (the chat template with the generation prompt), the completion ids it sampled, and their
sampling log-probabilities (here: the policy itself, call by call). The calls become one tree
(treefx.data.from_ids, group), go through a JSON Lines file and back with their metadata (task,
rollouts, rewards, log-probs), and one PPO-clip step runs on the tree against the sampling
log-probs, next to the same objective computed call by call. Before the step every ratio is 1
and the objective is 0 (a group's advantages sum to 0): both sides print rounding noise, so the
check there is the gradients; after the step the objective is compared again.
"""

import os
import tempfile

import numpy as np
import torch

import treefx
from treefx import data, rl
from treefx.models import tiny_chat_tokenizer, tiny_decoder

CLIP_EPS, LR = 0.2, 1e-3

tokenizer = tiny_chat_tokenizer()
torch.manual_seed(0)
model = tiny_decoder(vocab_size=len(tokenizer))
question = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 12 * 7?"}]


def chats(plan, answer):
    call = {"role": "assistant", "reasoning_content": plan, "tool_calls": [
        {"function": {"name": "calculator", "arguments": {"expression": "12 * 7"}}}]}
    done = {"role": "assistant", "reasoning_content": "The calculator says 84.",
            "content": answer}
    return [[*question, call], [*question, call, {"role": "tool", "content": "84"}, done]]


def engine(messages):
    """What an inference engine returns for one call: ids as the model saw them, and the
    sampling log-prob of each completion token."""
    call = data.chat_call(messages, tokenizer)
    with torch.no_grad():
        (lp,) = treefx.reference.sequence_logprobs(model,
                                                   treefx.Tree.from_sequences([call.ids]))
    return data.Call(call.prompt_ids, call.completion_ids,
                     logprobs=lp[len(call.prompt_ids) - 1:].tolist())


plans = ["Use the calculator.", "Call it.", "Use the calculator.", "Compute it."]
answers = ["It is 84.", "84", "I think 80.", "The answer is 84."]
rewards = [1.0, 1.0, 0.0, 1.0]
group = data.group([data.from_ids([engine(m) for m in chats(p, a)])
                    for p, a in zip(plans, answers)], rewards=rewards, task="mul-12-7")

with tempfile.TemporaryDirectory() as tmp:  # rollouts are usually stored between the steps
    path = os.path.join(tmp, "rollouts.jsonl")
    treefx.write_jsonl(path, [group])
    (tree,) = treefx.read_jsonl(path)
assert tree == group  # tokens, masks and metadata, log-probs included

batch = treefx.pack(tree, reduction="mean")
old = rl.from_metadata(batch, "logprobs")  # per call, NaN on prompt tokens
advantages = rl.grpo_advantages(batch)      # per call, from its rollout's reward

optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
tree_model = treefx.compile(model)


def tree_objective():
    return rl.ppo_clip_loss(tree_model(batch).token_logprobs, batch, advantages, old,
                            clip_eps=CLIP_EPS, return_stats=True)


def per_call_objective():
    """The same objective call by call, each call run alone:
    (1/P) Σ_p (1/|m_p|) Σ_j m_p(j) · −min(ρA_p, clip(ρ)A_p)."""
    total = torch.zeros(())
    for p, lp in enumerate(treefx.reference.sequence_logprobs(model, tree)):
        m = torch.as_tensor(tree.loss_mask(p)[1:], dtype=lp.dtype)
        sampled = torch.nan_to_num(old[p].to(lp.dtype))  # prompt tokens: masked out anyway
        ratio = torch.exp(lp - sampled)
        a = float(advantages[p])
        surrogate = torch.minimum(ratio * a, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * a)
        total = total - (m * surrogate).sum() / m.sum()
    return total / tree.num_sequences


loss, _ = tree_objective()
loss.backward()
g_tree = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
per_call = per_call_objective()
per_call.backward()
grad_err = max(float((a - p.grad).norm() / p.grad.norm().clamp_min(1e-30))
               for a, p in zip(g_tree, model.parameters()))
for p, g in zip(model.parameters(), g_tree):
    p.grad = g
optimizer.step()
optimizer.zero_grad()

# The same group after the step (a second PPO epoch would start here): the ratios move off 1.
after, stats = tree_objective()
after_per_call = per_call_objective()

# Before the step the policy is the one that sampled: every ratio is 1 and the objective is
# −(1/P) Σ_p A_p, 0 here (each rollout makes two calls and a group's advantages sum to 0). What
# the tree and the calls print then is float32 rounding of terms of size |A_p| that cancel:
# their difference is measured against that size. The gradient, (1/P) Σ_p A_p · mean ∇(−log π),
# is not 0, and after the step the ratios move off 1 and the objective with them.
at_ratio_1 = round(-float(advantages.sum()) / tree.num_sequences, 12) + 0.0
scale = float(advantages.abs().mean())
diff_before = abs(loss.item() - per_call.item())
diff_after = abs(after.item() - after_per_call.item())

print(f"GRPO group: {len(rewards)} rollouts, {tree.num_sequences} calls, {tree.num_tokens} tree "
      f"tokens for {tree.num_baseline_tokens} per-call tokens: POR {tree.por:.3f}, "
      f"bound {tree.bound:.2f}x")
print(f"advantages per call {np.round(advantages.numpy(), 3).tolist()}")
print(f"{'':26}{'tree':>12}{'per call':>12}{'difference':>12}")
print(f"{'objective before the step':26}{loss.item():12.1e}{per_call.item():12.1e}"
      f"{diff_before:12.1e}")
print(f"{'objective after the step':26}{after.item():12.6f}{after_per_call.item():12.6f}"
      f"{diff_after:12.1e}")
print(f"Before the step every ratio is 1, so the objective is -(1/P) Σ_p A_p = {at_ratio_1:.3g}: "
      f"both values are\nfloat32 rounding of terms of size mean |A_p| = {scale:.3f} "
      f"(differences {diff_before / scale:.1e} and {diff_after / scale:.1e} of it).")
print(f"max relative gradient difference {grad_err:.1e} (the gradient at ratio 1 is not 0)")
print(f"after the step: clip fraction {stats['clip_fraction'].item():.3f}, "
      f"approx KL(old || new) {stats['approx_kl'].item():.2e}")
