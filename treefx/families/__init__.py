"""What treefx knows of particular model families, one module each, registered into the
compiler's registries on import (the compiler never imports a family): importing this
package registers them all."""

from . import hf_recurrent, minimax

__all__ = ["hf_recurrent", "minimax"]
