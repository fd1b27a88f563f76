"""`python -m lab.check_invariance`: does batch-invariant verification compute, bit for
bit, what AR steps compute? On a real target and a real prompt (`--target`, `--set`) or
on a random-weight model of a known shape and a random prompt (`--shape`), in bf16: AR
decodes `--starts + 10` steps after the prompt; then, from each of the first `--starts`
AR states, one verification of the 11-token chain AR went on to emit; every node's
logits must equal the AR step's at its position. Also: the prompt's cached K/V and last
hidden state for two cache allocations (AR's and a tree method's differ). Prints counts,
writes JSON (`--out`).

Random weights alone can pass where a real model does not: bf16 values of similar
magnitude give exact float32 sums, whatever their order, while a real model's outlier
dimensions make them inexact.

  python -m lab.check_invariance --target smollm2-135m --set docs --context 4000 --starts 30 --out inv.json
  python -m lab.check_invariance --shape llama-3.1-8b --context 4000 --starts 8 --gemm cublas
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer.prompts import PROMPT_SETS
from lab.shapes import SHAPES
from longspec_jax import cli
from longspec_jax.decoding.tree import chain
from longspec_jax.decoding.verify import verify
from longspec_jax.engine import prefill
from longspec_jax.models.target import Transformer, random_model
from longspec_jax.ops.gemm import Compilation, Gemm
from longspec_jax.weights import load_target, load_tokenizer, read_target_config, resolve_target

CHAIN = 10  # drafted tokens per verified chain (PLD's default)


def check(model: Transformer, prompt: list[int], starts: int, gemm: Gemm, exact: bool, room: int = 640) -> dict:
  """The counts (module docstring) for `model` (made batch-invariant) after `prompt`."""
  model = model.with_numerics(batch_invariant=True)
  graphdef, params = nnx.split(model)
  run = jax.jit(
    lambda params, tree, cache: verify(nnx.merge(graphdef, params), tree, cache)[::2],
    compiler_options=Compilation(gemm, exact).compiler_options(),
  )
  context = len(prompt)
  prompt = [prompt]
  size = context + starts + CHAIN + 128
  cache, last = prefill(model, prompt, size)
  other, other_last = prefill(model, prompt, size + room)
  prefill_same = bool(jnp.array_equal(last, other_last)) and all(
    bool(jnp.array_equal(a[:, :, :context], b[:, :, :context])) for a, b in ((cache.k, other.k), (cache.v, other.v))
  )
  del other
  empty = jnp.zeros((1, 0), jnp.int32)
  tokens, ar_logits, states = [jnp.argmax(model.logits(last), -1).astype(jnp.int32)], [], []
  for _ in range(starts + CHAIN):
    states.append(cache)
    logits, cache = run(params, chain(tokens[-1], empty), cache)
    cache = cache.advance(1)
    ar_logits.append(logits[0, 0])
    tokens.append(jnp.argmax(logits[:, 0], -1).astype(jnp.int32))
  differing = []
  for j in range(starts):
    logits, _ = run(params, chain(tokens[j], jnp.stack(tokens[j + 1 : j + 1 + CHAIN], axis=1)), states[j])
    for i in range(CHAIN + 1):
      diff = float(jnp.max(jnp.abs(logits[0, i] - ar_logits[j + i])))
      if diff:
        differing.append({"start": j, "node": i, "position": context + j + i, "max_abs_diff": diff})
  return {
    "context": context,
    "starts": starts,
    "gemm": gemm.value,
    "exact": exact,
    "chain_nodes": starts * (CHAIN + 1),
    "nodes_differing": len(differing),
    "differing": differing[:20],
    "prefill_same_for_two_allocations": prefill_same,
  }


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.check_invariance", description=__doc__.splitlines()[0])
  model_flags = p.add_mutually_exclusive_group()
  model_flags.add_argument(
    "--target", help="a real target (a name or a path, as infer.generate takes) and a real prompt"
  )
  model_flags.add_argument(
    "--shape",
    choices=sorted(SHAPES),
    help="a random-weight model of this shape and a random prompt (the default: smollm2-135m)",
  )
  p.add_argument("--set", choices=sorted(PROMPT_SETS), help="the real prompt's set (with --target; default docs)")
  p.add_argument("--context", type=cli.positive_int, default=4000, help="prompt tokens")
  p.add_argument("--starts", type=cli.positive_int, default=30, help="chains verified, one per AR state")
  p.add_argument(
    "--gemm",
    choices=cli.GEMM,
    default="xla",
    help="compile option of the verification (the engine compiles batch-invariant rounds with xla)",
  )
  p.add_argument(
    "--excess-precision",
    action="store_true",
    help="let XLA keep bf16 intermediates in float32 where its fusions allow (its default; the engine"
    " compiles batch-invariant decoding without it)",
  )
  p.add_argument("--out", type=Path, help="results JSON")
  args = p.parse_args(argv)
  if args.out:
    cli.output_path(args.out)
  if args.set and args.target is None:
    p.error("--set picks a real prompt for a real target; give --target as well")
  args.set = args.set or "docs"
  if args.target is None:
    args.shape = args.shape or "smollm2-135m"
    name, config = args.shape, SHAPES[args.shape]
  else:
    path = resolve_target(args.target)
    name, config = args.target, read_target_config(path)
  if args.context + args.starts + CHAIN + 128 > config.max_position_embeddings:
    p.error(f"--context {args.context} plus the chains exceed {name}'s context")
  if args.target is None:
    model = random_model(config, jnp.bfloat16)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, args.context).tolist()
  else:
    target = load_target(path, jnp.bfloat16, load_tokenizer(path))
    model, prompt = target.model, PROMPT_SETS[args.set](target.tokenizer, args.context, 1)[0]
  result = {
    "device": jax.devices()[0].device_kind,
    "jax": jax.__version__,
    "argv": sys.argv[1:],
    "model": name,
    "weights": "random" if args.target is None else "real",
    **({"set": args.set} if args.target else {}),
    **check(model, prompt, args.starts, Gemm(args.gemm), not args.excess_precision),
  }
  print(
    f"{name} ({result['weights']} weights), context {result['context']}, verification compiled with {args.gemm}"
    f"{' and excess precision' if args.excess_precision else ', exact bf16 rounding'}:"
    f" {result['nodes_differing']} of {result['chain_nodes']} chain nodes differ from the AR step's logits;"
    f" prefill the same for two cache allocations: {'yes' if result['prefill_same_for_two_allocations'] else 'no'}"
  )
  for row in result["differing"][:5]:
    print(f"  start {row['start']} node {row['node']} (position {row['position']}): max diff {row['max_abs_diff']}")
  if args.out:
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.check_invariance")
