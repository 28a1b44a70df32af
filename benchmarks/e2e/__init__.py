"""End-to-end training-step benchmark: treefx against sequence packing, one-by-one and a
hand-written tree step, on synthetic agent trees.

    python -m benchmarks.e2e                 # GPU, ~6-8 min on an H200
    python -m benchmarks.e2e --quick         # hidden 1024 only, fewer reps
    python -m benchmarks.e2e --dry-run       # CPU: tiny, float32, checks

One training step = layout (packing) + mask building + forward + loss + backward, timed with
CUDA events (median of --reps after --warmup steps on the same tree). Every method runs on the
same trees, the same model and the same loss (each sequence's mean token cross-entropy,
averaged over the sequences); each lives in its own module of :mod:`benchmarks.e2e.methods`.

Also: BlockMask building for a 64k-token tree on the GPU (:mod:`.mask_build`), a stream of
trees of different sizes through the warmed-up treefx model (further compilations), and, with
``--profile``, GPU time by kernel kind and the GPU's idle gaps (:mod:`.profile`). A table is
printed last; JSON (written after every measurement) goes to --out.

``--dry-run`` runs the same code on the CPU with a tiny float32 model: eager/aot_eager
backends, SDPA with a dense 4-D mask instead of FlexAttention for the steps (FlexAttention has
no CPU backward), a FlexAttention forward check of the packed and tree BlockMasks against the
dense masks, and every method's loss and gradients against the per-sequence oracle
(:mod:`.dry_checks`).
"""
