"""The oldest transformers the package declares (``transformers>=X`` in pyproject.toml; the GPU
machine's release) runs the paths that depend on Hugging Face's code: a sample of this suite in
a virtual environment that sees this one's packages but that release of transformers.

The suite itself runs on whatever transformers is installed: the README's test command resolves
the newest release in range (``pip install -U ... --upgrade-strategy eager``), so a release that
breaks a documented path fails the day it lands, and this test keeps the other end of the range.

The environment is made once (``python -m venv``, a ``.pth`` file that adds this environment's
packages after its own, and ``pip install transformers==X``, about 20 s from the package
registry) and kept under
``~/.cache/treefx/`` (``TREEFX_FLOOR_VENV`` names another folder). Without a registry it
cannot be made and the test fails saying so; ``TREEFX_SKIP_FLOOR=1`` skips it on such a
machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Tests whose outcome depends on Hugging Face's code, about two minutes on 2 cores: model
# building, mask creation and packed-sequence inference, the recurrent kernels treefx
# recognises by signature (Gated DeltaNet, Mamba2), activation checkpointing, PEFT, the
# HF-style step, the zoo's configs. The whole suite on that release: the note in
# docs/debugging.md ("Tests") says where and when it last ran.
SAMPLE = [
    "tests/test_step.py::test_hf_model_with_labels",
    "tests/test_step.py::test_hf_model_called_without_attention_mask",
    "tests/test_step.py::test_moe_with_router_logits_trains_its_cross_entropy_and_refuses_the_aux_loss",
    "tests/test_hybrid.py::test_hf_gated_deltanet_hybrids_match_oracle",
    "tests/test_hybrid.py::test_hf_bamba_mamba2_hybrid_matches_oracle",
    "tests/test_checkpointing.py::test_hf_gradient_checkpointing_is_exact",
    "tests/test_wrapped_models.py::test_peft_lora_matches_oracle",
    "tests/test_zoo.py::test_fast_models_are_exact",
]


def floor_version() -> str:
    """The lower bound of ``transformers`` in pyproject.toml's test extra."""
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"transformers>=([0-9][0-9.]*)', text)
    assert found, "pyproject.toml declares no transformers>= bound"
    assert len(set(found)) == 1, f"pyproject.toml declares several lower bounds: {found}"
    return found[0]


def _venv(version: str) -> Path:
    # one per environment the suite runs in (its packages are the floor's, but transformers)
    tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    default = (Path.home() / ".cache" / "treefx" / f"venv-transformers-{version}-"
               f"py{sys.version_info[0]}{sys.version_info[1]}-{tag}")
    folder = Path(os.environ.get("TREEFX_FLOOR_VENV", default))
    python = folder / "bin" / "python"
    if python.exists() and _same(_transformers_version(python), version):
        return python
    _run([sys.executable, "-m", "venv", "--clear", str(folder)], folder, version)
    # This environment's packages (torch, peft, ...; a venv's or the interpreter's own), after
    # the new one's: only transformers is its own.
    own = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               folder, version).strip()
    outer = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    (Path(own) / "_treefx_suite_packages.pth").write_text("\n".join(sorted(outer)) + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
          f"transformers=={version}"], folder, version)
    got = _transformers_version(python)
    assert _same(got, version), f"the environment in {folder} has transformers {got}"
    return python


def _run(cmd: list[str], folder: Path, version: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"could not make the environment with transformers {version} in {folder} "
                    f"({' '.join(cmd[:4])} ...): {done.stderr.strip()[-500:]}; set "
                    "TREEFX_SKIP_FLOOR=1 on a machine without the package registry",
                    pytrace=False)
    return done.stdout


def _same(got: str | None, version: str) -> bool:
    """``5.17.0`` is the release ``5.17`` names."""
    if got is None:
        return False
    a, b = got.split("+")[0].split("."), version.split(".")
    return a[:len(b)] == b and all(x == "0" for x in a[len(b):])


def _transformers_version(python: Path) -> str | None:
    done = subprocess.run([str(python), "-c", "import transformers; print(transformers.__version__)"],
                          capture_output=True, text=True, timeout=300)
    return done.stdout.strip() if done.returncode == 0 else None


@pytest.mark.skipif(os.environ.get("TREEFX_SKIP_FLOOR") == "1", reason="TREEFX_SKIP_FLOOR=1")
@pytest.mark.skipif(os.environ.get("TREEFX_FLOOR_RUN") == "1", reason="inside the floor run")
def test_sample_passes_on_the_oldest_transformers():
    version = floor_version()
    python = _venv(version)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TREEFX_FLOOR_RUN="1")
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           *SAMPLE]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"with transformers {version}:\n{tail}"
    assert re.search(r"\d+ passed", done.stdout), tail
    # what ran really was the floor release (not the suite's own, through the system site)
    probe = subprocess.run([str(python), "-c", "import transformers, treefx; "
                            "print(transformers.__version__, treefx.__file__)"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ver, where = probe.stdout.split()
    assert _same(ver, version) and Path(where).resolve().is_relative_to(ROOT), probe.stdout
