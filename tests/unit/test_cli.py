"""The CLIs' shared plumbing: bad input is one sentence and exit code 2, before anything
heavy loads, in every entry point (generate and train.run have their own tests)."""

import importlib
import subprocess
import sys

import pytest

from infer.cli import cape_bins
from longspec_jax.cli import run_main

from helpers import run_cli


def run(module: str, argv, capsys) -> tuple[int, str]:
  main = importlib.import_module(module).main
  code = run_cli(main, argv, f"python -m {module}")
  return code, capsys.readouterr().err


@pytest.mark.parametrize(
  "module, argv, message",
  [
    ("infer.benchmark", ["--num-prompts", "0"], "--num-prompts: expected an integer >= 1, got '0'"),
    ("infer.benchmark", ["--lengths", "0"], "--lengths: expected an integer >= 1, got '0'"),
    ("infer.benchmark", ["--new-tokens", "-3"], "--new-tokens: expected an integer >= 1"),
    ("infer.benchmark", ["--lengths", "100000"], "exceeds the model's context of 8192 tokens"),
    ("infer.benchmark", ["--methods", "ar", "pld", "--tree-widths", "2,2"], "--tree-widths shapes a draft's trees"),
    ("infer.benchmark", ["--methods", "ar", "--draft", "random"], "--draft shapes a draft method"),
    ("infer.benchmark", ["--methods", "ar", "pld", "--draft-vocab", "10"], "--draft-vocab sets what a block draft"),
    ("infer.benchmark", ["--methods", "longspec", "--draft-vocab", "50000"], "exceeds the target's vocabulary"),
    ("train.rank_vocab", ["--draft", "default", "--data", "/no/such"], "no training files match '/no/such'"),
    ("infer.benchmark", ["--methods", "ar:4x2"], "pld, tokenswift METHOD:TOKENSxMATCHES"),
    ("infer.benchmark", ["--methods", "pld:16"], "expected pld:TOKENSxMATCHES with two integers >= 1, got 'pld:16'"),
    ("infer.benchmark", ["--methods", "ar", "--copy-matches", "2"], "--copy-matches shapes prompt lookup's"),
    ("infer.benchmark", ["--methods", "longspec", "--draft", "/no/such"], "the draft '/no/such' does not exist"),
    (
      "infer.benchmark",
      ["--methods", "longspec", "--tree-widths", "cape", "--cape-bins", "0.5:1,0.9:2"],
      "the last CAPE bin must end at confidence 1",
    ),
    ("infer.benchmark", ["--out", "/"], "the output / is a directory"),
    ("infer.benchmark", ["--temperature", "inf"], "--temperature: expected a finite number >= 0"),
    ("lab.profile", ["--out", "/etc/hostname"], "the output /etc/hostname is a file; give a directory"),
    ("lab.profile", ["--out", "x", "--length", "0"], "--length: expected an integer >= 1"),
    ("lab.profile", ["--out", "x", "--new-tokens", "1"], "--new-tokens: expected an integer >= 2"),
    ("lab.profile", ["--out", "x", "--method", "magic"], "invalid choice"),
    ("lab.profile", ["--out", "x", "--set", "poems"], "invalid choice"),
    ("lab.bench_target", ["--suite", "smollm2", "--out", "/"], "the output / is a directory"),
    ("lab.bench_target", ["--suite", "floor", "--contexts", "0"], "--contexts: expected an integer >= 1"),
    ("lab.bench_target", ["--suite", "smollm2", "--prompt-lengths", "9000"], "exceed SmolLM2's context of 8192"),
    ("lab.bench_target", ["--suite", "floor", "--contexts", "200000"], "--contexts must stay below"),
    ("lab.bench_target", ["--suite", "floor", "--methods", "ar", "glide"], "longspec and tokenswift rounds, not"),
    ("lab.bench_target", ["--suite", "floor", "--methods", "pld:24x0"], "with two integers >= 1"),
    ("lab.bench_step", ["--rollout", "1"], "expected passes like 5 or 5x4"),
    ("lab.bench_target", ["--suite", "floor", "--draft-inputs", "eagle"], "invalid choice"),
    ("lab.bench_kernels", ["--batches", "0"], "--batches: expected an integer >= 1"),
    ("lab.bench_kernels", ["--suites", "grid", "--out", "/"], "the output / is a directory"),
    ("infer.plots", ["/no/such.json"], "is not a readable result JSON"),
  ],
)
def test_bad_input_is_one_line_with_exit_2(module, argv, message, capsys, smollm2_gguf):
  # (the default model fetched first: its fetch prints a line of progress the first time)
  code, err = run(module, argv, capsys)
  assert code == 2
  assert err.count("\n") == 1 and err.startswith(f"python -m {module}: error: ") and message in err, err


def test_missing_optional_package_is_one_line(monkeypatch, capsys):
  def main():
    import optax  # noqa: F401

  monkeypatch.setitem(sys.modules, "optax", None)  # as if it were not installed
  with pytest.raises(SystemExit) as e:
    run_main(main, "python -m train.run")
  assert e.value.code == 2
  assert capsys.readouterr().err == (
    "python -m train.run: error: this command needs the package 'optax', which is not"
    " installed (pip install 'longspec-jax[train]').\n"
  )


def test_the_method_registry_and_flag_plumbing_import_without_jax():
  """The CLIs check their flags, methods included, before JAX is imported."""
  code = (
    "import sys, longspec_jax.cli, longspec_jax.methods.registry; assert 'jax' not in sys.modules, sorted(sys.modules)"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


def test_attention_choices_are_the_impls():
  from longspec_jax.cli import ATTENTION
  from longspec_jax.ops.attention import Impl

  assert set(ATTENTION) == {impl.value for impl in Impl if impl is not Impl.FLASH}  # (training passes only)


def test_gemm_choices_are_the_gemms():
  from longspec_jax.cli import GEMM
  from longspec_jax.ops.gemm import Gemm

  assert set(GEMM) == {gemm.value for gemm in Gemm}


@pytest.mark.parametrize(
  "module, argv",
  [
    ("infer.generate", ["--prompt", "x"]),
    ("train.run", ["--stage", "pretrain", "--data", "x", "--out", "y"]),
  ],
)
def test_flags_are_parsed_before_jax_loads(module, argv):
  """A bad flag is reported in a fraction of a second: parsing imports no JAX."""
  import subprocess

  script = f"import sys, {module} as m; m.parse_args({argv!r}); print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == "False"


def test_cape_bins_are_confidence_leaves_pairs():
  """The paper's bins; one bin is the paper's fixed-size ablation (4 leaves everywhere)."""
  assert cape_bins("0.3:7,0.6:5,0.8:3,1:1") == ((0.3, 0.6, 0.8), (7, 5, 3, 1))
  assert cape_bins("1:4") == ((), (4,))


def test_a_long_compilation_is_announced_once(capsys, tmp_path):
  """A compilation that outlasts `after` says "compiling" once on stderr; one that ends in
  time says nothing."""
  import time

  import jax
  import jax.numpy as jnp

  from infer.cli import CompileNotice

  with CompileNotice(tmp_path, after=3600.0):
    jax.jit(lambda x: x * 3.0 + 1.0)(jnp.ones(3))  # (ends long before the hour)
  assert capsys.readouterr().err == ""
  with CompileNotice(tmp_path, after=0.05) as notice:
    for _ in range(2):  # (a compilation starts and runs on past `after`, twice)
      notice._started(CompileNotice.COMPILE_STARTS)
      time.sleep(0.5)
      notice._ended(CompileNotice.COMPILE_ENDS, 0.5)
  assert capsys.readouterr().err == f"compiling (once for these shapes: kept in {tmp_path}) ...\n"


def test_an_output_is_checked_and_its_directories_made_before_any_work(tmp_path):
  from longspec_jax.cli import output_path
  from longspec_jax.errors import UserError

  out = output_path(tmp_path / "new" / "deeper" / "results.json")
  assert out.parent.is_dir() and not out.exists()
  with pytest.raises(UserError, match="is a directory"):
    output_path(tmp_path / "new")
