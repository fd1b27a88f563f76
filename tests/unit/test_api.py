"""The public API: every exported name resolves, and importing the package starts no JAX."""

import subprocess
import sys

import longspec_jax


def test_every_exported_name_resolves():
  for name in longspec_jax.__all__:
    assert getattr(longspec_jax, name) is not None, name


def test_importing_the_package_starts_no_jax():
  code = "import sys, longspec_jax; longspec_jax.Method; assert 'jax' not in sys.modules"
  subprocess.run([sys.executable, "-c", code], check=True)
