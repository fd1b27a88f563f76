"""Sharding by logical axis (`longspec_jax.sharding`): each weight split as its meaning
says, and the sharded train step equal to the single-device step (8 CPU devices, in a
subprocess so that the device count can be set before JAX starts)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    jax.config.update("jax_default_matmul_precision", "highest")
    from longspec_jax.config import DraftConfig, TargetConfig
    from longspec_jax.draft import random_draft
    from longspec_jax.target import random_model
    from longspec_jax.sharding import batch_sharding, make_mesh, param_shardings
    from train.step import TrainConfig, make_optimizer, make_train_step

    assert len(jax.devices()) == 8
    target_config = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                                 num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
    target_graphdef, target_params = nnx.split(random_model(target_config, jnp.float32))
    draft_graphdef, draft_params = nnx.split(random_draft(DraftConfig.for_target(target_config, window=8), jnp.float32))
    config = TrainConfig(compute_dtype="float32", loss_chunk=8, warmup_steps=1, max_position=2048)
    optimizer = make_optimizer(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (8, 24)), jnp.int32)
    mask = jnp.ones_like(tokens)

    def run(step, params, state, target):
        for i in range(3):
            params, state, metrics = step(params, state, jax.random.key(i), tokens, mask, target)
        return params, metrics

    single_params, single_metrics = run(make_train_step(draft_graphdef, target_graphdef, optimizer, config),
                                        jax.tree.map(jnp.copy, draft_params), optimizer.init(draft_params),
                                        target_params)
    mesh = make_mesh(model=2)
    opt_state = optimizer.init(draft_params)
    shardings = (param_shardings(mesh, draft_params), param_shardings(mesh, opt_state), batch_sharding(mesh),
                 param_shardings(mesh, target_params))
    place = lambda tree, sharding: jax.device_put(tree, sharding)
    sharded_step = make_train_step(draft_graphdef, target_graphdef, optimizer, config, shardings)
    sharded_params, sharded_metrics = run(sharded_step, place(draft_params, shardings[0]),
                                          place(opt_state, shardings[1]), place(target_params, shardings[3]))
    assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
               for leaf in jax.tree.leaves(sharded_params))
    # Megatron's pairs by meaning: q/k/v by KV head [L, E, K, G + 2, D], o by query head,
    # gate/up by the intermediate dimension, down by its input; vocabulary-split embedding;
    # norms whole; the optimizer's moments as their parameters.
    M = "model"
    specs = {jax.tree_util.keystr(path): tuple(s.spec) for path, s in
             jax.tree_util.tree_leaves_with_path(shardings[3])}
    assert specs["['layers']['qkv'].value"] == (None, None, M, None, None), specs
    assert specs["['layers']['o'].value"] == (None, M, None, None)
    assert specs["['layers']['gate_up'].value"] == (None, None, None, M)
    assert specs["['layers']['down'].value"] == (None, M, None)
    assert specs["['layers']['attn_norm'].value"] == (None, None) and specs["['embed'].value"] == (M, None)
    draft_specs = {tuple(s.spec) for s in jax.tree.leaves(shardings[1])}
    assert (None, None, None, M) in draft_specs  # the moments of the draft's gate/up
    odd = make_mesh(model=8)  # 2 KV heads on 8 devices: q/k/v and o whole, the MLP (96) split
    odd_specs = {jax.tree_util.keystr(path): tuple(s.spec) for path, s in
                 jax.tree_util.tree_leaves_with_path(param_shardings(odd, target_params))}
    assert odd_specs["['layers']['qkv'].value"] == (None,) * 5 and odd_specs["['layers']['o'].value"] == (None,) * 4
    assert odd_specs["['layers']['gate_up'].value"] == (None, None, None, M)
    for a, b in zip(jax.tree.leaves(single_params), jax.tree.leaves(sharded_params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)  # Adam amplifies summation order
    np.testing.assert_allclose(float(single_metrics["loss"]), float(sharded_metrics["loss"]), rtol=1e-5)
    print("ok")
''')


def test_sharded_step_equals_single_device():
  proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
