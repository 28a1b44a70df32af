"""Model families: one file per model family's knowledge; a family imports the compiler, never
the reverse."""

__all__ = []
