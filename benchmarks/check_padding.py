"""The first-call check's probe padded in root chains against one root a pad token (CPU):

    python -m benchmarks.check_padding

A tiny hybrid (Gated DeltaNet, attention, Gated DeltaNet; eager) checked with its probe padded
to 17,187 tokens (the e2e tree's length, as the check pads on Inductor): the check's time
and stages each way. The recurrence runs per node, so 16k one-token pad roots cost it 16k
sequences; chains as long as the probe's longest sequence make a few (``pack``'s
``pad_node_tokens``, which ``verify_compiled`` sets).
"""

import time, torch, treefx
from treefx.models import tiny_hybrid
from treefx.verification import verify_compiled, probe_forest
torch.manual_seed(0)
model = tiny_hybrid(("gdn", "attention", "gdn"), vocab_size=1000)
tm = treefx.compile(model, backend="eager", verify=False)
import treefx.verification as V
orig = V.pack
for node in ("one root a pad token", "chains"):  # the first: pack as before the change
    if node == "one root a pad token":
        V.pack = lambda *a, **k: orig(*a, **{**k, "pad_node_tokens": 1})
    else:
        V.pack = orig
    t0 = time.perf_counter()
    rep = verify_compiled(tm, grads=True, pad_to=17187)
    print(node, f"{time.perf_counter() - t0:.1f} s", rep.passed, rep.stage_seconds)
