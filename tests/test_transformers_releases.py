"""Every transformers release a user can have runs the paths that depend on Hugging Face's code:
a sample of this suite in virtual environments that see this one's packages but another release
of transformers.

- The oldest release the package declares (``transformers>=X`` in pyproject.toml) runs the
  sample in the default run.
- The canary: the newest release on the package registry, where it is newer than the bound the
  package declares (``transformers<=Y``), runs the sample too, in the default run. The README's
  test command installs the newest release in range (``pip install -U ...
  --upgrade-strategy eager``), so a release inside the range is tested the day it is allowed;
  one above it is tried by the canary the day it lands. A release that fails the sample fails
  this test (users still get Y: the bound holds them back); one that passes says so in a
  warning, and the bound can move to it.
- The releases the RL frameworks pin (verl's newest 5.10, OpenRLHF's 5.15.0) and the GPU
  machine's (5.17.0): ``-m slow``.
- verl's engine (``tests/test_integration_verl.py``) in an environment of its own with verl
  0.9.1 and the transformers it pins (verl requires ``<5.11``, so this environment cannot hold
  it; verl 0.9.1 fails beside TRL 1.16, so this environment's packages are not visible there),
  this environment's torch and test tools: ``-m slow``; making it takes a few minutes (verl
  brings ray, about 300 MB).

Each environment is made once (``python -m venv``, a ``.pth`` file that adds this environment's
packages after its own, and ``pip install transformers==X``, about 20 s from the package
registry) and kept under ``~/.cache/treefx/`` (``TREEFX_FLOOR_VENV`` names another folder for the
floor's). Where the release does not require the ``kernels`` package, the environment hides
this one's (transformers before 5.15 pins an older ``kernels`` and fails to import beside a newer
one). Without a registry an environment cannot be made and the test fails saying so;
``TREEFX_SKIP_FLOOR=1`` skips the floor, ``TREEFX_SKIP_CANARY=1`` the canary, on such a machine.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import sysconfig
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Tests whose outcome depends on Hugging Face's code, about two minutes on 2 cores: model
# building, mask creation and packed-sequence inference, the recurrent kernels treefx
# recognises by signature (Gated DeltaNet, Mamba2), activation checkpointing, PEFT, the
# HF-style step, a mixture of experts, the zoo's configs.
SAMPLE = [
    "tests/test_step.py::test_hf_model_with_labels",
    "tests/test_step.py::test_hf_model_called_without_attention_mask",
    "tests/test_step.py::test_moe_with_router_logits_trains_its_cross_entropy_and_refuses_the_aux_loss",
    "tests/test_hybrid.py::test_hf_gated_deltanet_hybrids_match_oracle",
    "tests/test_hybrid.py::test_hf_bamba_mamba2_hybrid_matches_oracle",
    "tests/test_mamba.py::test_hf_mamba_family_matches_oracle",
    "tests/test_checkpointing.py::test_hf_gradient_checkpointing_is_exact",
    "tests/test_wrapped_models.py::test_peft_lora_matches_oracle",
    "tests/test_zoo.py::test_fast_models_are_exact",
    "tests/test_model_positions.py::test_token_index_grids_a_model_permutes_are_not_positions",
]


# The releases the RL frameworks pin and the GPU machine's (``-m slow``).
PINNED = {"5.10.4": "verl 0.9.1's newest (>=5.5.3,<5.11)", "5.15.0": "OpenRLHF 0.11.2's",
          "5.17.0": "the GPU machine's"}


def _bound(pattern: str, what: str) -> str:
    text = (ROOT / "pyproject.toml").read_text()
    found = re.findall(r'"transformers[^"]*' + pattern + r'([0-9][0-9.]*)', text)
    assert found, f"pyproject.toml declares no transformers {what} bound"
    assert len(set(found)) == 1, f"pyproject.toml declares several {what} bounds: {found}"
    return found[0]


def floor_version() -> str:
    """The lower bound of ``transformers`` in pyproject.toml's extras."""
    return _bound(">=", "lower")


def bound_version() -> str:
    """The upper bound of ``transformers`` in pyproject.toml's extras (``<=``: the newest
    release treefx was run against)."""
    return _bound("<=", "upper")


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def _venv(version: str, extra: tuple[str, ...] = ()) -> Path:
    """An environment with transformers ``version``. Without ``extra``: before this one's
    packages (only transformers is its own). With ``extra`` (a framework's requirements): an
    environment of its own, with this environment's torch and the test tools, so that none of
    this one's packages (TRL, say) stands in for what the framework brings."""
    # one per environment the suite runs in (its packages are the floor's, but transformers)
    tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:8]
    name = "-".join(["transformers", version, *(re.sub(r"[^A-Za-z0-9.]+", "", e) for e in extra)])
    default = (Path.home() / ".cache" / "treefx" /
               f"venv-{name}-py{sys.version_info[0]}{sys.version_info[1]}-{tag}")
    folder = Path(default if extra else os.environ.get("TREEFX_FLOOR_VENV", default))
    python = folder / "bin" / "python"
    ready = folder / ".treefx-ready"
    if python.exists() and _same(_transformers_version(python), version) and \
            (not extra or ready.exists()):
        return python
    _run([sys.executable, "-m", "venv", "--clear", str(folder)], folder, version)
    own = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
               folder, version).strip()
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if extra:
        import importlib.metadata as md

        tools = [f"{d}=={md.version(d)}" for d in ("torch", "pytest", "hypothesis", "numpy")]
        _run([*pip, *tools, f"transformers=={version}", *extra], folder, version)
    else:
        # This environment's packages (torch, peft, ...; a venv's or the interpreter's own),
        # after the new one's.
        outer = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
        (Path(own) / "_treefx_suite_packages.pth").write_text("\n".join(sorted(outer)) + "\n")
        _run([*pip, f"transformers=={version}"], folder, version)
        needs = _run([str(python), "-c", "import importlib.metadata as m; print(any(r.split(';')"
                      "[0].strip().startswith('kernels') and 'extra' not in r for r in "
                      "m.requires('transformers') or ()))"], folder, version).strip()
        if needs != "True":  # this environment's kernels is not the release's: hide it
            (Path(own) / "kernels.py").write_text(
                "raise ImportError('kernels is hidden: this transformers does not require it')\n")
    got = _transformers_version(python)
    assert _same(got, version), f"the environment in {folder} has transformers {got}"
    ready.write_text(" ".join([f"transformers=={version}", *extra]) + "\n")
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


def _run_sample(version: str) -> str:
    """The sample under transformers ``version``: pytest's output; fails with its tail."""
    python = _venv(version)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TREEFX_FLOOR_RUN="1")
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
           *SAMPLE]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"with transformers {version}:\n{tail}"
    assert re.search(r"\d+ passed", done.stdout), tail
    # what ran really was that release (not the suite's own, through the system site)
    probe = subprocess.run([str(python), "-c", "import transformers, treefx; "
                            "print(transformers.__version__, treefx.__file__)"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    ver, where = probe.stdout.split()
    assert _same(ver, version) and Path(where).resolve().is_relative_to(ROOT), probe.stdout
    return done.stdout


inside_a_release_run = pytest.mark.skipif(os.environ.get("TREEFX_FLOOR_RUN") == "1",
                                          reason="inside a release's run")


@pytest.mark.skipif(os.environ.get("TREEFX_SKIP_FLOOR") == "1", reason="TREEFX_SKIP_FLOOR=1")
@inside_a_release_run
def test_sample_passes_on_the_oldest_transformers():
    _run_sample(floor_version())


def newest_release() -> str:
    """The newest transformers release on the package registry (``pip index versions``)."""
    done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "transformers",
                           "--disable-pip-version-check"], capture_output=True, text=True,
                          timeout=300)
    found = re.search(r"transformers \(([0-9][0-9.]*)\)", done.stdout)
    if done.returncode != 0 or not found:
        pytest.fail("cannot ask the package registry for transformers' newest release "
                    f"({done.stderr.strip()[-300:]}); set TREEFX_SKIP_CANARY=1 on a machine "
                    "without the registry", pytrace=False)
    return found.group(1)


@pytest.mark.skipif(os.environ.get("TREEFX_SKIP_CANARY") == "1", reason="TREEFX_SKIP_CANARY=1")
@inside_a_release_run
def test_canary_the_newest_release_passes_the_sample_or_is_above_the_bound():
    """A release newer than the declared bound is tried the day it lands: it must pass the
    sample before the bound moves to it (until then users get the bound's release)."""
    newest, bound = newest_release(), bound_version()
    assert _key(bound) >= _key(floor_version())
    if _key(newest) <= _key(bound):
        return  # the README's test command installs it: the whole suite runs on it
    _run_sample(newest)
    warnings.warn(f"transformers {newest} is newer than the declared bound {bound} and passes "
                  "the HF sample: run the whole suite on it, then raise the bound in "
                  "pyproject.toml", stacklevel=1)


@pytest.mark.slow
@inside_a_release_run
@pytest.mark.parametrize("version", sorted(PINNED, key=_key))
def test_sample_passes_on_the_releases_the_rl_frameworks_pin(version):
    _run_sample(version)


@pytest.mark.slow
@inside_a_release_run
def test_verl_engine_in_verls_own_environment():
    """tests/test_integration_verl.py (treefx's verl engine against verl's own) with verl and
    the transformers release it pins installed."""
    extra = re.search(r"^verl = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra, "pyproject.toml has no verl extra"
    requirements = tuple(re.findall(r'"([^"]+)"', extra.group(1)))
    version = next(v for v, why in PINNED.items() if why.startswith("verl"))
    python = _venv(version, requirements)
    env = dict(os.environ, PYTHONPATH=str(ROOT), TREEFX_FLOOR_RUN="1")
    done = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_integration_verl.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, tail
    assert re.search(r"\d+ passed", done.stdout) and "skipped" not in done.stdout, tail


def test_the_declared_range_is_the_one_treefx_warns_outside():
    from treefx._version import TESTED_TRANSFORMERS

    assert (floor_version(), bound_version()) == TESTED_TRANSFORMERS


def test_a_release_outside_the_range_is_warned_about(monkeypatch, caplog):
    import transformers

    from treefx.families import hf_kernels

    assert hf_kernels.check_release() == (
        _key(floor_version()) <= _key(transformers.__version__) <= _key(bound_version()))
    monkeypatch.setattr(transformers, "__version__", "99.0.0")
    with caplog.at_level("WARNING", logger="treefx"):
        assert not hf_kernels.check_release()
    assert "99.0.0 is installed" in caplog.text
