"""Tree ops: a plain-torch reference and a fast version of each."""
