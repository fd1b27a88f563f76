"""Command-line pieces of the inference CLIs (generate, benchmark, profile): the sampling
flags, trees (beam widths or CAPE's) and the prompt. The plumbing every CLI shares
(the method names included) is `longspec_jax.cli`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

from longspec_jax.cli import any_int, nonnegative_float, nonnegative_int, number_type, positive_int
from longspec_jax.errors import UserError
from longspec_jax.methods.registry import Method

TOKENSWIFT_PENALTY = 1.2  # theta of TokenSwift's paper (Table 11, Llama 3.1 8B), its method's default


def plural(n: int, noun: str) -> str:
  """'1 token', '2 tokens': a count as the CLIs' messages write it."""
  return f"{n} {noun}{'' if n == 1 else 's'}"


class MethodSpec(NamedTuple):
  """A method and, for one that copies, its own prompt-lookup continuations (their length
  and number; None: the flags' or the method's)."""

  method: Method
  tokens: int | None = None
  matches: int | None = None

  def __str__(self) -> str:  # as written on the command line
    return self.method.value + (f":{self.tokens}x{self.matches}" if self.tokens else "")


def method_spec(text: str) -> MethodSpec:
  """An argparse type: a method, or for one that copies (pld, longspec, glide, auto,
  tokenswift) METHOD:TOKENSxMATCHES, prompt lookup's continuations (TokenSwift's n-grams)
  for that method's run alone (e.g. pld:16x4, four of 16 tokens), over --copy-tokens and
  --copy-matches."""
  name, _, copies = text.partition(":")
  method = next((m for m in Method if m.value == name), None)
  if method is None or (copies and not method.copies):
    copying = sorted(m.value for m in Method if m.copies)
    raise argparse.ArgumentTypeError(
      f"expected one of {', '.join(sorted(m.value for m in Method))}, or for one of {', '.join(copying)}"
      f" METHOD:TOKENSxMATCHES, got {text!r}"
    )
  if not copies:
    return MethodSpec(method)
  tokens, _, matches = copies.partition("x")
  if not (tokens.isdigit() and matches.isdigit() and int(tokens) >= 1 and int(matches) >= 1):
    raise argparse.ArgumentTypeError(f"expected {method}:TOKENSxMATCHES with two integers >= 1, got {text!r}")
  return MethodSpec(method, int(tokens), int(matches))


# --sparse-verify's P: the share of the draft's attention whose chunks the verifier reads.
sparse_fraction = number_type(float, lambda x: 0 < x <= 1, "a fraction 0 < P <= 1 of the draft's attention")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
  """The logit processors' flags (`longspec_jax.decoding.sampling.SamplingConfig`)."""
  p.add_argument("--temperature", type=nonnegative_float, default=0.0, help="0 (default): greedy")
  p.add_argument("--top-k", type=nonnegative_int, default=0, help="keep the k most likely tokens (0: off)")
  p.add_argument(
    "--top-p",
    type=number_type(float, lambda x: 0 < x <= 1, "a number in (0, 1]"),
    default=1.0,
    help="keep the most likely tokens of mass p (1: off)",
  )
  p.add_argument(
    "--min-p",
    type=number_type(float, lambda x: 0 <= x < 1, "a number in [0, 1)"),
    default=0.0,
    help="keep tokens >= min_p x the most likely (0: off)",
  )
  p.add_argument(
    "--penalty",
    type=number_type(float, lambda x: x >= 1, "a finite number >= 1"),
    help="TokenSwift's contextual penalty theta: divide the logits of recent tokens (default: 1, off;"
    f" with --method tokenswift alone, its paper's {TOKENSWIFT_PENALTY})",
  )
  p.add_argument("--penalty-window", type=positive_int, default=1024, help="how many recent tokens the penalty sees")
  p.add_argument(
    "--seed",
    type=any_int,
    default=0,
    help="the random draws of sampling (T > 0); the same seed, the same text, with every method",
  )
  p.add_argument(
    "--draw",
    choices=("position", "stream"),
    default="position",
    help="how sampling draws (T > 0): 'position' (default), Gumbel-max noise keyed by the seed and each"
    " token's position, so the text depends on the seed alone, never on the method; 'stream', one random"
    " stream split per round with speculative sampling's walk, so each method writes its own text",
  )


def sampling_config(args, method: Method | None = None):
  """The logit processors the flags give; a `--penalty` left unset is off, or TokenSwift's
  paper's where `method` is tokenswift (the output then is AR's under that penalty)."""
  from longspec_jax.decoding.sampling import Draw, SamplingConfig

  penalty = args.penalty if args.penalty is not None else TOKENSWIFT_PENALTY if method is Method.TOKENSWIFT else 1.0
  return SamplingConfig(
    temperature=args.temperature,
    top_k=args.top_k,
    top_p=args.top_p,
    min_p=args.min_p,
    penalty=penalty,
    penalty_window=args.penalty_window,
    draw=Draw(args.draw),
  )


CAPE = "cape"  # a --tree-widths value: CAPE's tree (--cape-gamma, --cape-bins) instead of a beam search


def tree_widths(text: str) -> tuple[int, ...] | str:
  """argparse type for `--tree-widths 4,16,16`: beam widths per depth, or `cape`."""
  from longspec_jax.models.config import check_tree_widths

  if text == CAPE:
    return CAPE
  try:
    widths = tuple(int(w) for w in text.split(","))
    check_tree_widths(widths)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers like 4,16,16, got {text!r}") from None
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return widths


def cape_bins(text: str) -> tuple[tuple[float, ...], tuple[int, ...]]:
  """argparse type for `--cape-bins 0.3:7,0.6:5,0.8:3,1:1`: each bin's highest confidence
  and its leaves per position, the last bin ending at 1 -> (edges, sizes)."""
  from longspec_jax.models.config import CapeConfig

  try:
    pairs = [(float(p), int(k)) for p, k in (pair.split(":") for pair in text.split(","))]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected confidence:leaves pairs like 0.3:7,1:1, got {text!r}") from None
  if pairs[-1][0] != 1.0:
    raise argparse.ArgumentTypeError(f"the last CAPE bin must end at confidence 1, got {text!r}")
  edges, sizes = tuple(p for p, _ in pairs[:-1]), tuple(k for _, k in pairs)
  try:
    CapeConfig(edges=edges, sizes=sizes)
  except UserError as e:
    raise argparse.ArgumentTypeError(str(e)) from None
  return edges, sizes


def add_tree_flags(p: argparse.ArgumentParser, many: bool = False) -> None:
  """--tree-widths (beam widths per depth, or `cape`; `many`: several, one run each) and
  CAPE's settings."""
  p.add_argument(
    "--tree-widths",
    type=tree_widths,
    nargs="+" if many else None,
    help="longspec, auto: beam widths per tree depth like 4,16,16, or 'cape' for CAPE's tree (a greedy"
    " chain with the draft's next-best tokens as leaves, as many as its confidence asks for;"
    " default: the draft's); tokenswift: children per node at each depth of its full tree, one"
    " more than its heads (default: the heads', 1,3,3,3)" + ("; several: one run each" if many else ""),
  )
  p.add_argument("--cape-gamma", type=positive_int, default=5, help="CAPE: draft tokens in its chain")
  p.add_argument(
    "--cape-bins",
    type=cape_bins,
    default=((0.3, 0.6, 0.8), (7, 5, 3, 1)),
    help="CAPE: confidence bins as highest-confidence:leaves pairs, the paper's 0.3:7,0.6:5,0.8:3,1:1",
  )


def add_copy_flags(p: argparse.ArgumentParser, many: bool = False) -> None:
  """--copy-tokens and --copy-matches: prompt lookup's continuations (`many`: several
  values, one run each)."""
  nargs, each = ("+", "; several: one run each") if many else (None, "")
  p.add_argument(
    "--copy-tokens",
    type=nonnegative_int,
    nargs=nargs,
    help="pld and auto: the length of prompt lookup's continuations; longspec: graft continuations of"
    " this many tokens into each tree (default: the draft's tree, else none for longspec, 10 for"
    " pld, and for auto 24 on a GPU, 10 elsewhere, fewer for a batch); tokenswift: the length of its"
    " n-gram branches (default 4; 0: none)" + each,
  )
  p.add_argument(
    "--copy-matches",
    type=positive_int,
    nargs=nargs,
    help="pld, longspec and auto: how many prompt-lookup continuations (the most recent distinct ones)"
    " a round proposes, as a trie (default 1; auto: 4 on a GPU); tokenswift: how many of its most"
    " frequent n-grams a round grafts (default 20, at most 32)" + each,
  )


def add_past_flag(p: argparse.ArgumentParser, corpus: bool = True) -> None:
  """--past-tokens: the ring of earlier outputs prompt lookup searches (`methods.past`), and
  (`corpus`) --corpus, files written into it first."""
  p.add_argument(
    "--past-tokens",
    type=nonnegative_int,
    default=0,
    help="pld and auto: prompt lookup also searches the latest N tokens that earlier requests of this"
    " process wrote (a batch file's records, the server's requests), and proposes what followed there"
    " in the continuations the context's own matches leave empty (default 0: off)",
  )
  if not corpus:
    return
  p.add_argument(
    "--corpus",
    type=Path,
    nargs="+",
    default=[],
    help="with --past-tokens: text files written into those past outputs before the first request (a"
    " repository's sources, documentation), each tokenized once and cached",
  )


def add_draft_vocab_flag(p: argparse.ArgumentParser, many: bool = False) -> None:
  """--draft-vocab: how many tokens a block draft scores (`many`: several, one run each)."""
  p.add_argument(
    "--draft-vocab",
    type=nonnegative_int,
    nargs="+" if many else None,
    help="longspec, glide, auto with a draft: the draft scores only this many tokens, the most frequent"
    " of its training text (FR-Spec; the target still checks every token, so the text is unchanged);"
    " 0: the whole vocabulary (default: the draft's own setting)" + ("; several: one run each" if many else ""),
  )


def tree_choice(spec, args):
  """(beam widths, CapeConfig) of one --tree-widths value: one of them None (both: the
  draft's default tree)."""
  from longspec_jax.models.config import CapeConfig

  if spec == CAPE:
    edges, sizes = args.cape_bins
    return None, CapeConfig(gamma=args.cape_gamma, edges=edges, sizes=sizes)
  return spec, None


def batch_tree_choice(config, method: Method, batch: int, widths, cape, copy_tokens):
  """(beam widths, copy tokens) of LongSpec's draft (longspec, auto with a draft) decoding
  `batch` sequences: where the flags name no tree (neither widths nor CAPE's), the tree
  priced for the target's shape at that batch size if the table of trees has one
  (`weights.drafts.batch_tree`; the flags' copy tokens over its), else those given (None:
  the draft's own)."""
  from longspec_jax.weights.drafts import batch_tree

  if widths is not None or cape is not None or method not in (Method.LONGSPEC, Method.AUTO):
    return widths, copy_tokens
  priced = batch_tree(config, batch)
  return priced.get("tree_widths"), copy_tokens if copy_tokens is not None else priced.get("copy_tokens")


def check_tree(widths, cape, vocab_size: int, copy_tokens: int) -> None:
  """Raises UserError unless the tree `tree_choice` gave (beam widths or CAPE's, with
  `copy_tokens` copied nodes grafted) fits the vocabulary and this machine's node budget."""
  from longspec_jax.decoding.tree import node_budget
  from longspec_jax.models.config import check_tree_widths

  if widths:
    check_tree_widths(widths, vocab_size, node_budget(vocab_size), copy_tokens)
  if cape:
    cape.check_fits(vocab_size, node_budget(vocab_size), copy_tokens)


def read_text(path: Path, what: str) -> str:
  """The text of the file `path`; a missing or unreadable one is a `UserError` that calls it
  `what`."""
  try:
    return path.read_text()
  except FileNotFoundError:
    raise UserError(f"{what} {path} does not exist.") from None
  except (OSError, UnicodeDecodeError) as e:
    raise UserError(f"{what} {path} is not readable text ({type(e).__name__}).") from None


def read_prompt(prompt: str | None, prompt_file: str | None) -> str:
  """The prompt's text, from the flag, a file or stdin ('-'); an empty one is refused."""
  if prompt_file == "-":
    prompt = sys.stdin.read()
  elif prompt_file is not None:
    prompt = read_text(Path(prompt_file), "prompt file")
  if not prompt.strip():
    raise UserError("the prompt is empty; give at least one token of text.")
  return prompt


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
  """Token ids of the prompt, through the model's chat template with `chat`."""
  if chat:
    if not getattr(tokenizer, "chat_template", None):
      raise UserError("--chat was given but the target's tokenizer has no chat template.")
    text = tokenizer.apply_chat_template(
      [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids
  return tokenizer(text).input_ids


class CompileNotice:
  """While open, says once on stderr that XLA is compiling when a compilation takes longer
  than `after` seconds: a first run of these shapes stops there (the decode loop: 11-22 s
  on a CPU) and a reader should know why. Compiled programs are kept in `cache` (see
  `backend.keep_compiled_programs`), so a later run with the same shapes does not stop."""

  COMPILE_STARTS = "/jax/compilation_cache/compile_requests_use_cache"
  COMPILE_ENDS = "/jax/core/compile/backend_compile_duration"

  def __init__(self, cache: Path, after: float = 1.0):
    self.cache, self.after = cache, after
    self.timer, self.said = None, False

  def _say(self) -> None:
    if not self.said:
      self.said = True
      print(f"compiling (once for these shapes: kept in {self.cache}) ...", file=sys.stderr, flush=True)

  def _started(self, event: str, **_) -> None:
    import threading

    if event == self.COMPILE_STARTS and not self.said:
      self._cancel()
      self.timer = threading.Timer(self.after, self._say)
      self.timer.daemon = True
      self.timer.start()

  def _ended(self, event: str, seconds: float, **_) -> None:
    if event == self.COMPILE_ENDS:
      self._cancel()

  def _cancel(self) -> None:
    if self.timer is not None:
      self.timer.cancel()
      self.timer = None

  def __enter__(self) -> CompileNotice:
    import jax

    jax.monitoring.register_event_listener(self._started)
    jax.monitoring.register_event_duration_secs_listener(self._ended)
    return self

  def __exit__(self, *exc) -> None:
    import jax

    self._cancel()
    jax.monitoring.unregister_event_listener(self._started)
    jax.monitoring.unregister_event_duration_listener(self._ended)
