"""Where compiled programs are kept between processes."""

import jax

from longspec_jax import backend


def test_compiled_programs_are_kept_under_the_cache_root_unless_a_cache_is_chosen(tmp_path, monkeypatch):
  chosen = jax.config.jax_compilation_cache_dir  # (the suite's own, set before any test)
  assert chosen and backend.keep_compiled_programs(tmp_path / "other") == type(tmp_path)(chosen)
  monkeypatch.setenv("LONGSPEC_CACHE", str(tmp_path))
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert backend.keep_compiled_programs() == tmp_path / "xla"
    assert jax.config.jax_persistent_cache_min_compile_time_secs == backend.MIN_COMPILE_SECONDS
  finally:
    jax.config.update("jax_compilation_cache_dir", chosen)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
