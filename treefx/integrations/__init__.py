"""Optional integrations of treefx with the trainers people run.

Each submodule imports its library at import time (an extra of the package: ``pip install
"treefx[hf]"`` / ``"treefx[trl]"`` / ``"treefx[verl]"``) and is imported by name, never by
``import treefx``: the core knows nothing of them.

- :mod:`treefx.integrations.hf`: Hugging Face's ``Trainer`` on prefix trees of each
  micro-batch's rows (``TreeTrainer``, ``TreeCollator``).
- :mod:`treefx.integrations.trl`: TRL's ``GRPOTrainer`` with every model call on prefix trees
  (``TreeGRPOTrainer``).
- :mod:`treefx.integrations.verl`: verl's FSDP training engine with each micro-batch run as a
  prefix tree (``TreeFSDPEngine``, model type ``tree_language_model``; the ``verl`` extra).
- :mod:`treefx.integrations.trl_sft`: TRL's ``SFTTrainer`` on prefix trees of each
  micro-batch's rows, with TRL's loss and metrics (``TreeSFTTrainer``).
"""
