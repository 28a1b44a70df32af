"""Regional execution captured twice: a first batch small enough for Inductor's 32-bit indexing
(vocab x tokens < 2**31), then one past it, which fails that guard and is captured anew. Before
treefx compiled every backward with its forward, this case gave an infinite loss on the H100
(BENCHMARKS.md, "First step and compile time"). Loss and gradient norm of each batch against
the same model through treefx's eager backend (nothing compiled).

    python -m benchmarks.regional_recapture            # GPU, about a minute
    python -m benchmarks.regional_recapture --dry-run  # CPU, aot-eager, small sizes
"""

from __future__ import annotations

import argparse
import math
import os
import time

os.environ.setdefault("TREEFX_VERIFY", "0")

import torch  # noqa: E402

import treefx  # noqa: E402

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def forest(tokens: int, vocab: int, seed: int, prefix: int = 256, branch: int = 192):
    """Trees of 4 sequences sharing a ``prefix``-token prefix, each going on for ``branch``
    tokens: about ``tokens`` tokens in all."""
    g = torch.Generator().manual_seed(seed)
    trees, total = [], 0
    while total < tokens:
        shared = torch.randint(1, vocab, (prefix,), generator=g).tolist()
        seqs = [shared + torch.randint(1, vocab, (branch,), generator=g).tolist()
                for _ in range(4)]
        trees.append(treefx.Tree.from_sequences(seqs))
        total += prefix + 4 * branch
    return trees


def loss_and_grad_norm(tm, batch) -> tuple[float, float]:
    model = tm.model
    model.zero_grad(set_to_none=True)
    loss = treefx.tree_loss(tm(batch), batch)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in model.parameters()
                         if p.grad is not None))
    return float(loss), norm


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    import transformers

    cuda = torch.cuda.is_available() and not args.dry_run
    dev = "cuda" if cuda else "cpu"
    vocab = 151_936 if cuda else 512
    sizes = (4096, 16384) if cuda else (64, 200)  # 151936 x 16384 > 2**31
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(dev)
    if cuda:
        model = model.to(torch.bfloat16)
    backend = "inductor" if cuda else "aot-eager"
    tm = treefx.compile(model, backend=backend, regional=True, verify=False)
    ref = treefx.compile(model, backend="eager", verify=False)
    shape = {} if cuda else {"prefix": 16, "branch": 12}
    batches = [treefx.pack(forest(n, vocab, i, **shape)).to(dev) for i, n in enumerate(sizes)]
    failed = []
    for i, batch in enumerate(batches):
        say(f"batch {i}: {batch.num_tokens} tokens (vocab x tokens = "
            f"{vocab * batch.num_tokens:.3g}, 2**31 = {2**31:.3g})")
        got = loss_and_grad_norm(tm, batch)
        say(f"  regional: loss {got[0]:.6f}, gradient norm {got[1]:.6f}; "
            f"{len([g for gs in tm.engine._regional.values() for g in gs])} capture(s)")
        want = loss_and_grad_norm(ref, batch)
        say(f"  eager:    loss {want[0]:.6f}, gradient norm {want[1]:.6f}")
        tol = 2e-2 if cuda else 1e-4
        ok = all(math.isfinite(x) for x in got) and \
            abs(got[0] - want[0]) <= tol * abs(want[0]) and abs(got[1] - want[1]) <= 5 * tol * want[1]
        say(f"  {'agree' if ok else 'DIFFER'}")
        if not ok:
            failed.append(i)
    say("PASSED" if not failed else f"FAILED: batches {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
