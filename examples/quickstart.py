"""Quickstart: build a tree, compile a model for it, take one training step.

On the CPU it takes about half a minute (importing torch and compiling, mostly)."""

import torch

import treefx
from treefx.models import tiny_decoder

sequences = [[1, 5, 9, 2, 7], [1, 5, 9, 4], [1, 5, 9, 4, 8, 8], [3, 6]]  # model calls of one task
tree = treefx.Tree.from_sequences(sequences)
batch = treefx.pack(tree, reduction="mean")
model = tiny_decoder(vocab_size=16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

tree_model = treefx.compile(model)  # the one line: attention and positions now follow the tree
loss = treefx.tree_loss(tree_model(batch), batch)
baseline = treefx.reference.sequence_loss(model, tree, reduction="mean")  # each sequence alone
loss.backward()
optimizer.step()

print(f"{tree}: bound {tree.bound:.2f}x")
print(f"tree loss {loss.item():.6f} = per-sequence loss {baseline.item():.6f}")
