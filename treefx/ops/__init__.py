"""Tree ops, one folder per op as flash-linear-attention keeps them: ``reference.py`` (plain
torch), ``fast.py`` / ``flex.py`` (what runs fast) and ``part.py`` (the variant for a part of a
tree) side by side, the folder's ``__init__`` re-exporting its public names. An op with one
form is one module.

    attention/       tree attention: reference (SDPA, scored), flex (FlexAttention), part
    conv/            tree causal conv1d: reference, fast (the row's conv fixed at node
                     boundaries), part
    cross_entropy/   tree loss: reference (materialized logits), fast (fused, chunked)
    logprobs/        per-token log-probabilities: reference, fast (fused), site (graph node),
                     from_logits (read from materialized logits: Triton on the GPU)
    lightning/       MiniMax lightning attention: reference (per token), fast (chunked)
    recurrence/      recurrent kernels over the tree: reference (per depth), traced (custom
                     op), part
    scan/            tree cumsum: reference (loop), fast (pointer jumping)
    selective_scan   Mamba's selective scan with an initial state
    grad_into        a linear layer whose weight gradient is added into ``.grad``
    embedding        the input embedding of a part (its gradient to the part's rows)
    part_context     the context buffer of a part: every site's inputs as columns
    host_row         what eager ops in a traced graph derive from the parent row on the host
"""
