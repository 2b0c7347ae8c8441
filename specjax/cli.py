"""`specjax` command line: models, generate."""

from __future__ import annotations

import argparse
import json
import sys

from specjax.registry import DEFAULT_MODEL, MODELS, MissingWeightsError, UnknownModelError


def _cmd_models(args: argparse.Namespace) -> int:
  from specjax.registry import is_installed

  rows = [("name", "arch", "installed", "get it with")]
  for spec in MODELS.values():
    rows.append((
        spec.name,
        spec.arch,
        "yes" if is_installed(spec) else "no",
        spec.install or "(built in: random init)",
    ))
  widths = [max(len(r[i]) for r in rows) for i in range(3)]
  for r in rows:
    print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
  return 0


def _cmd_generate(args: argparse.Namespace) -> int:
  from specjax.generate import TextStream, generate
  from specjax.loader import load_model
  from specjax.sampling import SamplingParams

  sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p)
  if not args.prompt.strip():
    raise ValueError("the prompt is empty")
  model = load_model(args.model)
  tok = model.tokenizer
  ids = tok.encode_prompt(args.prompt, chat=False if args.no_chat else None)
  stream = TextStream(lambda ids: tok.decode(ids, skip_special=True))
  on_token = None
  if not args.quiet:
    on_token = lambda t: print(stream.push(t), end="", flush=True)
  result = generate(
      model.graphdef, model.state, model.config, ids,
      max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed, on_token=on_token,
  )
  if not args.quiet:
    print()
  stats = {
      "model": args.model,
      "prompt_tokens": len(ids),
      "new_tokens": len(result.tokens),
      "compile_s": round(result.compile_s, 3),
      "prefill_s": round(result.prefill_s, 4),
      "decode_tokens_per_s": round(result.decode_tokens_per_s, 2),
      "stopped_on_eos": result.stopped_on_eos,
  }
  print(
      f"[{stats['new_tokens']} tokens, compile {result.compile_s:.1f} s, "
      f"prefill {result.prefill_s:.2f} s, "
      f"decode {stats['decode_tokens_per_s']:.1f} tok/s]",
      file=sys.stderr,
  )
  if args.json:
    print(json.dumps(stats))
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="specjax", description="Self-speculative decoding in JAX/Flax."
  )
  sub = parser.add_subparsers(dest="command", required=True)

  p = sub.add_parser("models", help="list the models and how to install their weights")
  p.set_defaults(func=_cmd_models)

  p = sub.add_parser("generate", help="autoregressive generation, streamed")
  p.add_argument("--model", default=DEFAULT_MODEL)
  p.add_argument("--prompt", required=True)
  p.add_argument("--max-new-tokens", type=int, default=64)
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
  p.add_argument("--top-p", type=float, default=1.0)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  p.add_argument("--quiet", action="store_true", help="do not stream the text")
  p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
  p.set_defaults(func=_cmd_generate)
  return parser


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.func(args)
  except (UnknownModelError, MissingWeightsError, ValueError) as err:
    print(f"specjax: error: {err}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
