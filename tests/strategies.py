"""Hypothesis strategies shared by the layout and tree tests."""

from hypothesis import strategies as st


@st.composite
def sequence_sets(draw, max_seqs=10, max_len=8, alphabet=4):
    """1..max_seqs token lists of length 1..max_len over a small alphabet, many of them built
    by extending (a prefix of) an earlier one, so that prefixes, duplicates and branch points
    are common."""
    n = draw(st.integers(1, max_seqs))
    seqs: list[list[int]] = []
    for _ in range(n):
        prefix: list[int] = []
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            prefix = base[: draw(st.integers(0, len(base)))]
        rest = draw(
            st.lists(
                st.integers(0, alphabet - 1),
                min_size=0 if prefix else 1,
                max_size=max_len - len(prefix),
            )
        )
        seqs.append(prefix + rest)
    return seqs
