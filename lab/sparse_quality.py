"""`python -m lab.sparse_quality`: what SpecAttn's sparse verification costs in quality
(the paper's Table 1).

Each document (the start of a held-out file, `--length` tokens) is prefilled but for its
last `--eval-tokens`, which are then teacher-forced through the target in blocks of
`--block` tokens, as verification rounds that accept every node of a chain would run
them: per block, the draft catches up on the tokens before it (its ring, as in
decoding), one draft pass over the block's tokens after its first gives its
cross-attention mass per chunk of the target's cache, the chunks holding p of it are
kept per KV head (`attention.select_chunks`), and the target runs the block reading
only those in its layers from `--dense-layers` on, writing the block's K/V into its cache
from that sparse pass (errors carry forward, as in decoding). p = 1 reads everything:
the dense run, the baseline of the same script.

`--oracle` adds the per-layer oracle: each target layer keeps the chunks holding p of its
own attention in a dense pass of the block (a measurement of the selection only: that
pass reads everything), what the one-layer draft's single selection for all layers
approximates (SpecAttn's layer mapping gives a one-layer draft no choice).

With `--oracle` each row also gives SpecAttn's layer similarity (section 3.3) on these
blocks: S[0, j] = -KL(target layer j's attention per chunk || the draft's), and the
monotone mapping it gives (every layer to the one draft layer).

Reported per set, guide, chunk size and p: perplexity of the teacher-forced tokens and its
increase over dense, the share of the cached K/V the verifier read (layer-weighted,
`verify.fraction_read`), and how often the target's greedy token differs from dense's
(a greedy decode diverges from AR at the first such token). Writes JSON and a plot of
KV fraction read against the perplexity increase.

  python -m lab.sparse_quality --sets c-code perl-code --length 4096 --eval-tokens 512 \\
      --p 0.9 0.95 0.97 --out quality.json
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from infer import plots
from infer.prompts import PROMPT_SETS
from infer.timing import environment
from longspec_jax import cli
from longspec_jax.decoding.verify import fraction_read
from longspec_jax.engine import prefill
from longspec_jax.methods.layer_map import kl_similarity, monotone_map
from longspec_jax.methods.longspec import LongSpecDraft
from longspec_jax.models.config import DraftKind, SparseVerify
from longspec_jax.models.draft import CrossAttend, SelfAttend
from longspec_jax.ops import attention
from longspec_jax.ops.attention import causal_block_mask
from longspec_jax.weights import default, load_target, load_tokenizer, read_target_config, resolve_target
from longspec_jax.weights.drafts import load_draft, resolve_draft

COMPLETION_SETS = ("code", "c-code", "cpp-code", "perl-code")  # raw files: their tokens are the document's


@functools.partial(
  jax.jit, static_argnames=("graphdef", "proposer", "block", "oracle"), donate_argnames=("cache", "ring")
)
def _forced_block(
  graphdef, params, proposer: LongSpecDraft, draft_params, cache, ring, history, block: int, oracle: bool = False
):
  """Teacher-forces history's next `block` tokens (the first at slot cache.lengths)
  through the target, sparsely as `proposer.sparse` says (None: dense), the chunks chosen
  by the draft's attention or, with `oracle`, by each target layer's own in a dense pass
  of the block. Returns the cache and ring advanced past them, the negative
  log-likelihood of each block token's next token [B, T], the target's argmax after each
  [B, T], the share of the K/V read [B], and with `oracle` the draft's mass [B, K, C] and
  each layer's [L, B, K, C] (for their similarity; else None)."""
  target = nnx.merge(graphdef, params)
  lengths = cache.lengths
  positions = lengths[:, None] + jnp.arange(block)[None, :]  # [B, T]
  tokens = jnp.take_along_axis(history, positions, axis=1)
  mask = causal_block_mask(positions, jnp.ones(positions.shape, bool))
  sparse, kept, mass, masses = proposer.sparse, None, None, None
  if sparse is not None:
    draft = nnx.merge(proposer.graphdef, draft_params)
    _, ring = proposer.catch_up(draft, target, cache, history, ring)  # the ring through the block's first token
    chain = block - 1  # the block after its first token, as a tree's draft passes see their nodes
    _, _, mass = draft.forward(
      target,
      tokens[:, 1:],
      positions[:, 1:],
      SelfAttend(
        mask=jnp.broadcast_to(jnp.tril(jnp.ones((chain, chain), bool)), (tokens.shape[0], chain, chain)),
        ring=ring,
        ring_limit=lengths + 1,
      ),
      CrossAttend(k=cache.k, v=cache.v, limits=jnp.broadcast_to(lengths[:, None], (tokens.shape[0], chain))),
      chunk=sparse.chunk,
    )  # [B, K, C]
    if oracle:
      masses = target.prefix_masses(tokens, positions, mask, cache, sparse.chunk)  # [L, B, K, C]
    kept = attention.select_chunks(mass if masses is None else masses, sparse.p, impl=draft.attention)
  hidden, cache = target(tokens, positions, mask, cache, kept=kept, sparse=sparse)
  log_probs = jax.nn.log_softmax(target.logits(hidden), axis=-1)  # [B, T, V]
  following = jnp.take_along_axis(history, positions + 1, axis=1)
  nll = -jnp.take_along_axis(log_probs, following[..., None], axis=-1)[..., 0]
  read = fraction_read(kept, lengths, sparse, target.config.num_layers)
  return cache.advance(block), ring, nll, jnp.argmax(log_probs, axis=-1), read, (mass, masses) if oracle else None


def _distributions(mass: np.ndarray) -> np.ndarray:
  """mass [..., C] -> each row normalised to sum 1, the leading axes but the first one
  flattened: [lead, rows, C] (a draft's [B, K, C] becomes [1, B * K, C])."""
  mass = np.asarray(mass, np.float64)
  mass = mass.reshape(1 if mass.ndim == 3 else mass.shape[0], -1, mass.shape[-1])
  return mass / np.maximum(mass.sum(axis=-1, keepdims=True), 1e-30)


def teacher_forced(
  target,
  proposer: LongSpecDraft,
  draft_params,
  documents: np.ndarray,
  eval_tokens: int,
  block: int,
  oracle: bool = False,
) -> dict:
  """documents [B, L]: the first L - eval_tokens tokens prefilled, the rest teacher-forced
  in blocks (`_forced_block`). Returns nll and argmax [B, E'] (E' = the whole blocks that
  fit), the mean share of the K/V read, and with `oracle` SpecAttn's layer similarity
  (`layer_map.kl_similarity`, [draft layers = 1, target layers], averaged over the blocks:
  how well the draft's attention per chunk predicts each target layer's)."""
  batch, length = documents.shape
  start = length - eval_tokens
  cache, _ = prefill(target, documents[:, :start].tolist(), length + block)
  history = jnp.asarray(np.pad(documents, ((0, 0), (0, block))))
  drafted = proposer.sparse is not None
  ring = proposer.start(draft_params, target=target, cache=cache, history=history).ring if drafted else None
  graphdef, params = nnx.split(target)
  nll, top, read, similarity = [], [], [], []
  for _ in range((eval_tokens - 1) // block):  # (the last block's last token needs a next one)
    cache, ring, block_nll, block_top, block_read, both = _forced_block(
      graphdef, params, proposer, draft_params, cache, ring, history, block, oracle
    )
    nll.append(block_nll)
    top.append(block_top)
    read.append(block_read)
    if both is not None:
      similarity.append(kl_similarity(_distributions(both[1]), _distributions(both[0])))
  result = {
    "nll": np.asarray(jnp.concatenate(nll, axis=1)),
    "top": np.asarray(jnp.concatenate(top, axis=1)),
    "kv_fraction_read": float(np.mean(np.stack(read))),
  }
  if similarity:
    result["layer_similarity"] = np.mean(similarity, axis=0)  # [1, L]
  return result


def main(argv=None):
  p = cli.ArgumentParser(prog="python -m lab.sparse_quality", description=__doc__.splitlines()[0])
  p.add_argument(
    "--sets",
    nargs="+",
    choices=COMPLETION_SETS,
    default=["c-code", "perl-code"],
    help="documents: files of these sets (held out: c-code, cpp-code, perl-code)",
  )
  p.add_argument("--length", type=cli.positive_int, default=4096, help="tokens per document")
  p.add_argument("--eval-tokens", type=cli.positive_int, default=512, help="the documents' last tokens, teacher-forced")
  p.add_argument("--num-docs", type=cli.positive_int, default=4, help="documents per set (one batch)")
  p.add_argument("--block", type=cli.positive_int, default=6, help="tokens per verification (>= 2)")
  p.add_argument(
    "--p",
    type=cli.number_type(float, lambda x: 0 < x < 1, "a number in (0, 1)"),
    nargs="+",
    default=[0.9, 0.95, 0.97],
    help="fractions of the draft's attention mass kept",
  )
  p.add_argument("--chunks", type=cli.positive_int, nargs="+", default=[64, 16], help="slots per chunk")
  p.add_argument("--dense-layers", type=cli.nonnegative_int, default=2)
  p.add_argument(
    "--oracle",
    action="store_true",
    help="also select each target layer's chunks from its own attention (a dense pass of the block):"
    " the per-layer oracle the draft's one selection for every layer approximates",
  )
  p.add_argument("--target", default=default.NAME)
  p.add_argument("--draft", default="default", help="LongSpec's draft: 'default', 'random' or a checkpoint dir")
  p.add_argument("--dtype", choices=("float32", "bfloat16"))
  cli.add_attention_flag(p)
  p.add_argument("--out", type=Path, help="results JSON (a PNG of them is written beside it)")
  args = p.parse_args(argv)
  if args.block < 2:
    p.error("--block must be at least 2: a block's draft pass runs over its tokens after the first")
  if not args.block < args.eval_tokens < args.length:
    p.error(f"--eval-tokens must lie between --block ({args.block}) and --length ({args.length})")
  if args.out:
    cli.output_path(args.out)
  path = resolve_target(args.target)
  config = read_target_config(path)
  if args.length + args.block > config.max_position_embeddings:
    p.error(f"--length {args.length} does not fit the target's context of {config.max_position_embeddings} tokens")
  resolve_draft(args.draft, args.target, DraftKind.LONGSPEC)
  impl = cli.attention_impl(args.attention)
  target = load_target(path, cli.resolve_dtype(args.dtype), load_tokenizer(path), numerics=cli.numerics(args))
  draft = load_draft(args.draft, target.config, target.model.dtype, args.target, attention=impl)
  graphdef, draft_params = nnx.split(draft)
  device = jax.devices()[0].device_kind
  print(
    f"device: {device}, target {args.target}, {jnp.dtype(target.model.dtype).name}, {args.num_docs} documents of"
    f" {args.length} tokens per set, the last {args.eval_tokens} teacher-forced in blocks of {args.block}"
  )
  print("set        | guide  | chunk | p     | perplexity | vs dense | K/V read | top-1 differs", flush=True)
  rows = []

  def save() -> None:  # after every row: a crash loses nothing measured
    if args.out:
      result = {
        "kind": "sparse_quality",
        **environment(),
        "argv": sys.argv[1:],
        "target": args.target,
        "draft": args.draft,
        "dtype": jnp.dtype(target.model.dtype).name,
        "attention": impl.value,
        "length": args.length,
        "eval_tokens": args.eval_tokens,
        "block": args.block,
        "rows": rows,
      }
      plots.save(result, args.out)

  # (widths as deep as a block: its catch-up pass then spans the block before)
  proposer = LongSpecDraft(graphdef, widths=(1,) * (args.block - 1))
  for set_name in args.sets:
    documents = np.asarray(PROMPT_SETS[set_name](target.tokenizer, args.length, args.num_docs), np.int32)
    dense = teacher_forced(target.model, proposer, draft_params, documents, args.eval_tokens, args.block)
    dense_ppl = math.exp(float(dense["nll"].mean()))
    runs = [(None, None, None, dense)]
    for guide in ("draft", "oracle") if args.oracle else ("draft",):
      for chunk in args.chunks:
        for p_kept in args.p:
          sparse = SparseVerify(p_kept, chunk=chunk, dense_layers=args.dense_layers)
          runs.append(
            (
              guide,
              chunk,
              p_kept,
              teacher_forced(
                target.model,
                dataclasses.replace(proposer, sparse=sparse),
                draft_params,
                documents,
                args.eval_tokens,
                args.block,
                oracle=guide == "oracle",
              ),
            )
          )
    for guide, chunk, p_kept, run in runs:
      ppl = math.exp(float(run["nll"].mean()))
      row = {
        "set": set_name,
        "guide": guide,
        "chunk": chunk,
        "p": p_kept,
        "perplexity": ppl,
        "dense_perplexity": dense_ppl,
        "relative_increase": ppl / dense_ppl - 1,
        "kv_fraction_read": run["kv_fraction_read"],
        "top1_differs": float(np.mean(run["top"] != dense["top"])),
        "tokens": int(run["nll"].size),
        "per_document_perplexity": np.exp(run["nll"].mean(axis=1)).tolist(),
      }
      if "layer_similarity" in run:  # S[i, j] = -KL(target layer j || draft layer i), and the mapping it gives
        row["layer_similarity"] = run["layer_similarity"].tolist()
        row["layer_map"] = list(monotone_map(run["layer_similarity"]))
      rows.append(row)
      save()
      print(
        f"{set_name:10} | {guide or 'dense':6} | {chunk or '-':>5} | {p_kept or 1:5.2f} | {ppl:10.3f} |"
        f" {100 * row['relative_increase']:+7.2f}% | {100 * row['kv_fraction_read']:7.1f}% |"
        f" {100 * row['top1_differs']:12.2f}%",
        flush=True,
      )
      if "layer_similarity" in row:
        kl = -np.asarray(row["layer_similarity"][0])
        order = np.argsort(kl)
        print(
          f"  KL(target layer || draft) per chunk: {kl.min():.2f} (layer {order[0]}) .. {kl.max():.2f}"
          f" (layer {order[-1]}), median {np.median(kl):.2f}",
          flush=True,
        )


if __name__ == "__main__":
  cli.run_main(main, "python -m lab.sparse_quality")
