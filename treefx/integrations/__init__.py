"""treefx inside the trainers people run: ``treefx.integrations.hf`` (Hugging Face ``Trainer``).

Each module imports its trainer library at import time; the core (``import treefx``) imports
none of them.
"""
