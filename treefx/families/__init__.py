"""What treefx knows of particular model families, one module each, registered into the
compiler's registries on import (the compiler never imports a family): importing this
package registers them all."""

from . import (
    deepseek_indexer,
    fla,
    gpt_oss_sinks,
    hf_kernels,
    hf_recurrent,
    merged_heads,
    minimax,
    position_tables,
)

__all__ = ["deepseek_indexer", "fla", "gpt_oss_sinks", "hf_kernels", "hf_recurrent",
           "merged_heads", "minimax", "position_tables"]
