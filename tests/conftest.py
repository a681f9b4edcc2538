"""Shared pytest setup.

* marker `gpu`: tests that need a CUDA device; skipped automatically when torch.cuda.is_available()
  is False (CI has no GPU).
* without a GPU, TORCH_CUDA_ARCH_LIST defaults to 9.0 (the H200) and CUDA_HOME to /usr/local/cuda,
  so importing a kernel file still builds its extension with nvcc.
* fixtures: `repo_root` (absolute path of the repository), `load_module` (imports a Python file by
  path, relative to the repository root or absolute: `mod = load_module("contact_map.py")`; the
  same function as harness.load_module, so importing a kernel file builds it), `kernel_module`
  (load_module for a kernel file, skipping the test when no CUDA toolkit is found), `run_harness`
  (harness.main(argv) in-process, returns (exit code, captured stdout)).
"""
import os
import shutil
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

HAVE_CUDA = torch.cuda.is_available()
if not HAVE_CUDA:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    if os.path.isdir("/usr/local/cuda"):
        os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")

import harness  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if HAVE_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def repo_root():
    """Absolute path of the repository root."""
    return ROOT


@pytest.fixture(scope="module")
def load_module():
    """harness.load_module(path, name=None): import a file by path (relative to the repo root or absolute)."""
    return harness.load_module


@pytest.fixture(scope="module")
def kernel_module():
    """kernel_module(path, name): import a kernel file (builds its CUDA extension, a minute or more the
    first time); skips the test when there is no CUDA toolkit (no CUDA_HOME, no nvcc on PATH)."""

    def load(path, name):
        if not (os.environ.get("CUDA_HOME") or shutil.which("nvcc")):
            pytest.skip("no CUDA toolkit (set CUDA_HOME): cannot build the kernel")
        return harness.load_module(path, name)

    return load


@pytest.fixture
def run_harness(capsys):
    """Run harness.main(argv) in this process; returns (exit code, stdout text)."""

    def run(*argv):
        code = harness.main([str(a) for a in argv])
        return code, capsys.readouterr().out

    return run
