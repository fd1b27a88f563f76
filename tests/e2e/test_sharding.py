"""Sharding by logical axis (`longspec_jax.ops.sharding`): each weight split as its meaning
says, the sharded train step equal to the single-device step, and tensor-parallel
decoding token for token what one device decodes (CPU devices, in subprocesses so that
the device count can be set before JAX starts)."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_num_cpu_devices", 8)
    from flax import nnx
    jax.config.update("jax_default_matmul_precision", "highest")
    from longspec_jax.models.config import DraftConfig, TargetConfig
    from longspec_jax.models.draft import random_draft
    from longspec_jax.models.target import random_model
    from longspec_jax.ops.sharding import batch_sharding, make_mesh, param_shardings
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
""")


def test_sharded_step_equals_single_device():
  proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


DECODING = textwrap.dedent("""
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_default_matmul_precision", "highest")
    import jax.numpy as jnp, numpy as np
    from longspec_jax.ops import sharding
    from longspec_jax.ops import topk
    from longspec_jax.ops.attention import Impl
    from longspec_jax.models.config import DraftConfig, HeadsConfig, TargetConfig
    from longspec_jax.models.draft import random_draft
    from longspec_jax.engine import Decoding, generate
    from longspec_jax.models.heads import random_heads
    from longspec_jax.models.layers import embed_tokens
    from longspec_jax.methods.factory import make_proposer
    from longspec_jax.methods.registry import ProposerOptions
    from longspec_jax.decoding.sampling import SamplingConfig
    from longspec_jax.models.target import random_model

    # 2 KV heads: split over 2 devices, whole over 4 (the MLP's 96 columns and the 128-token
    # vocabulary split either way); a tied head, so the embedding is the LM head too.
    config = TargetConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                          qkv_bias=True)
    target = random_model(config, jnp.float32)
    # (fused target features and parents' outputs: their projections split by KV head too)
    draft_config = DraftConfig.for_target(config, window=16, feature_layers=(0, 1), parent_features=True)
    draft = random_draft(draft_config, jnp.float32, seed=1)
    heads = random_heads(HeadsConfig.for_target(config, gamma=2, tree_widths=(1, 2, 2)), jnp.float32)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 128, 30).tolist() * 2  # (repeats: prompt lookup has matches)
    methods = {
        "ar": lambda: (None, None),
        "pld": lambda: make_proposer("pld", None, ProposerOptions(copy_tokens=4, copy_matches=2)),
        "longspec": lambda: make_proposer("longspec", draft, ProposerOptions(tree_widths=(2, 2), copy_tokens=3)),
        "tokenswift": lambda: make_proposer("tokenswift", heads, ProposerOptions(tree_widths=(1, 2, 2))),
    }

    sampled = SamplingConfig(temperature=0.8, top_k=20)

    def run(model, method, sampling=SamplingConfig()):
        proposer, params = methods[method]()
        decoding = Decoding(sampling=sampling) if proposer is None else Decoding(proposer, sampling)
        return generate(model, [prompt], 12, decoding, params, seed=3)

    one = {m: run(target, m).token_ids for m in methods}
    one["sampled"] = run(target, "longspec", sampled).token_ids
    pallas = target.with_numerics(attention=Impl.PALLAS)
    one["pallas"] = run(pallas, "longspec").token_ids
    assert one["pallas"] == one["longspec"] == one["ar"]
    ties = jnp.asarray(rng.normal(size=(3, 128)).round(1), jnp.float32)
    hidden = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
    for devices in (4, 2):  # (2 last: the weights stay placed for the runs after)
        with jax.set_mesh(sharding.make_mesh(model=devices, devices=jax.devices()[:devices])):
            for model in (target, draft, heads):
                sharding.placed(model)
            split = (None, None, "model", None, None) if devices == 2 else (None,) * 5
            assert tuple(target.layers.qkv[...].sharding.spec) == split
            assert tuple(target.embed[...].sharding.spec) == ("model", None)
            tokens = jnp.asarray([[0, 127, 64, 63, 31]])
            assert jnp.array_equal(jax.jit(embed_tokens)(target.embed[...], tokens), target.embed[...][tokens])
            assert all(jnp.array_equal(a, b) for a, b in zip(jax.jit(topk.top_k, static_argnums=1)(ties, 5),
                                                             jax.lax.top_k(ties, 5)))  # ties: lower index first
            fused = jax.jit(lambda h: topk.head_top_log_probs(h, target.embed[...], 4, transposed=True))(hidden)
            plain = topk.top_k(jax.nn.log_softmax(hidden @ target.embed[...].T), 4)
            np.testing.assert_allclose(fused[0], plain[0], rtol=1e-5, atol=1e-5)
            assert jnp.array_equal(fused[1], plain[1])
            for method in methods if devices == 2 else ("longspec",):
                result = run(target, method)
                assert result.token_ids == one[method], (devices, method)
            cache_heads = (tuple(result.state.cache.k.sharding.spec) + (None,) * 5)[3]
            assert cache_heads == ("model" if devices == 2 else None), devices
    with jax.set_mesh(sharding.make_mesh(model=2, devices=jax.devices()[:2])):
        assert run(target, "longspec", sampled).token_ids == one["sampled"]  # (the same draws)
        assert run(pallas, "longspec").token_ids == one["pallas"]  # the kernels per device, on its KV heads
    print("ok")
""")


@pytest.mark.slow  # (every proposer over 2 and 4 devices; one step and `--devices`: this file and test_generate.py)
def test_tensor_parallel_decoding_is_token_identical():
  """Every kind of proposer (AR, prompt lookup, LongSpec with copies, TokenSwift; `auto`'s
  AR and copy rounds in test_generate's `--devices` run) and the Pallas kernels decode over 2 devices (and
  LongSpec over 4, where the 2 KV heads stay whole) exactly the tokens of one (float32):
  weights by head, MLP column and vocabulary, caches by KV head, the embedding lookup and
  top-k vocabulary-parallel."""
  proc = subprocess.run([sys.executable, "-c", DECODING], capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
