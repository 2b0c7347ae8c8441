"""`specjax bench` end to end on a tiny model: outputs, losslessness check, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_data import write_spec_bench

from specjax.bench import metrics
from specjax.cli import main

ARGS = ["--model", "tiny-qwen3", "--categories", "writing,qa,translation", "--per-category", "1",
        "--max-new-tokens", "12", "--search-iterations", "4", "--gamma", "3"]


def test_bench_end_to_end_then_resume(tmp_path, capsys):
  root = write_spec_bench(tmp_path / "data")
  out = tmp_path / "run"
  argv = ["bench", *ARGS, "--data-dir", str(root), "--out", str(out)]
  assert main(argv) == 0
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  methods = {"ar", "early_exit", "self_sd", "swift", "8bit", "self_sd+8bit"}  # the defaults
  assert set(figures["methods"]) == methods
  assert figures["methods"]["ar"]["mismatches"] is None  # the reference
  assert all(r["mismatches"] == 0 for m, r in figures["methods"].items() if m != "ar")
  assert figures["prompts"] == 3
  # Compiling is booked apart, per method, less the prefill every method shares (which
  # each generation counts in its own): never negative. The warm-up compiled the rest.
  assert all(0 <= r["compile_s"] < 5 for r in figures["methods"].values())
  assert "| compile s |" in (out / "summary.md").read_text()
  for f in ("results.jsonl", "settings.json", "summary.md", "speedup.png"):
    assert (out / f).exists()
  # The searches, kept for a resume: self_sd's, and self_sd+8bit's, made at 8 bits.
  plans = sorted(p.name.endswith("-8bit.json") for p in out.glob("self_sd_plan-*.json"))
  assert plans == [False, True]
  lines = (out / "results.jsonl").read_text().splitlines()
  assert len(lines) == 3  # one line per prompt, all its methods in it
  assert {r["method"] for r in json.loads(lines[0])["records"]} == methods
  # A crash mid-write: the first prompt kept, half a line of the second.
  (out / "results.jsonl").write_text(lines[0] + "\n" + lines[1][:25])
  assert main(argv) == 2  # refuses to overwrite without --resume
  assert "--resume" in capsys.readouterr().err
  assert main(argv + ["--resume"]) == 0
  again = (out / "results.jsonl").read_text().splitlines()
  assert again[0] == lines[0]  # finished prompts are neither redone nor lost
  assert [json.loads(l)["unit"] for l in again] == [json.loads(l)["unit"] for l in lines]
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["prompts"] == 3
  # A resume with a setting that changes the numbers is refused, and says which.
  assert main([*argv, "--resume", "--gamma", "2"]) == 2
  assert "gamma: 3 -> 2" in capsys.readouterr().err


def test_bench_bad_input(tmp_path, capsys):
  out = str(tmp_path / "run")
  assert main(["bench", *ARGS, "--data-dir", str(tmp_path), "--out", out]) == 2
  assert "specjax data fetch" in capsys.readouterr().err
  root = str(write_spec_bench(tmp_path / "d"))
  assert main(["bench", *ARGS, "--drafters", "medusa", "--data-dir", root, "--out", out + "2"]) == 2
  assert "unknown drafter 'medusa'" in capsys.readouterr().err
  assert main(["bench", *ARGS, "--drafters", "medusa+8bit", "--data-dir", root, "--out",
               out + "4"]) == 2
  assert "unknown drafter 'medusa'" in capsys.readouterr().err
  assert main(["bench", *ARGS, "--drafters", "early_exit+swift", "--data-dir", root, "--out",
               out + "5"]) == 2
  assert "'swift' is a layer drafter" in capsys.readouterr().err
  assert main(["bench", *ARGS, "--option", "knapspec.taux=1", "--drafters", "knapspec",
               "--data-dir", root, "--out", out + "6"]) == 2
  assert "knapspec has no option 'taux'" in capsys.readouterr().err
  assert main(["bench", *ARGS, "--gamma", "0", "--data-dir", root, "--out", out + "3"]) == 2
  assert "gamma" in capsys.readouterr().err


def test_metrics_are_ratios_of_sums():
  recs = [
      dict(method="ar", category="a", decode_tokens=10, decode_s=1.0),
      dict(method="ar", category="b", decode_tokens=30, decode_s=1.0),
      dict(method="x", category="a", decode_tokens=10, decode_s=0.5, rounds=5, drafted=12,
           accepted=6, committed=10, draft_s=0.1, verify_s=0.3, selection_s=0.05, other_s=0.05,
           matches_ar=True),
      dict(method="x", category="b", decode_tokens=30, decode_s=0.5, rounds=10, drafted=20,
           accepted=18, committed=28, draft_s=0.15, verify_s=0.3, selection_s=0.0, other_s=0.05,
           matches_ar=False),
  ]
  s = metrics.summarize(recs)
  assert s["ar"]["tokens_per_s"] == pytest.approx(20.0)
  assert s["x"]["tokens_per_s"] == pytest.approx(40.0)
  assert s["x"]["speedup"] == pytest.approx(2.0)
  assert s["x"]["M"] == pytest.approx(38 / 15)
  assert s["x"]["alpha"] == pytest.approx(24 / 32)
  assert s["x"]["mismatches"] == 1
  assert s["x"]["draft_share"] == pytest.approx(0.25) and s["x"]["verify_share"] == 0.6
  assert metrics.by_category(recs)["a"]["x"]["speedup"] == pytest.approx(2.0)
  assert s["x"]["compile_s"] is None  # records from before compile seconds were kept
  for r, seconds in zip(recs, (1.0, 0.0, 2.5, 0.5)):
    r["compile_s"] = seconds
  s = metrics.summarize(recs)
  assert (s["ar"]["compile_s"], s["x"]["compile_s"]) == (1.0, 3.0)


def test_the_median_per_prompt_speedup_shows_a_slow_ar_prompt():
  """One prompt whose AR ran at a third of its speed (machine noise, seen in a real run)
  lifts the total-time speedup of every method; the median of per-prompt speedups, each
  against AR on the same prompt, stays with the other prompts."""
  recs = []
  for i, ar_s in enumerate([1.0, 1.0, 3.0, 1.0]):
    recs += [dict(method="ar", prompt_id=f"p{i}", category="a", decode_tokens=10,
                  decode_s=ar_s),
             dict(method="x", prompt_id=f"p{i}", category="a", decode_tokens=10, decode_s=0.5,
                  rounds=5, drafted=8, accepted=4, committed=10, matches_ar=True)]
  s = metrics.summarize(recs)
  assert s["x"]["speedup"] == pytest.approx(3.0)  # 40 tokens in 2 s against 40 in 6 s
  assert s["x"]["median_speedup"] == pytest.approx(2.0)
  assert s["ar"]["median_speedup"] == pytest.approx(1.0)
  no_ids = [{k: v for k, v in r.items() if k != "prompt_id"} for r in recs]
  assert metrics.summarize(no_ids)["x"]["median_speedup"] is None  # nothing to pair


def test_mismatches_cannot_read_zero_by_omission():
  """A drafter record without its AR comparison is an error; sampled records (None) are
  'not compared', never 0; a mix of the two is refused."""
  ar = dict(method="ar", category="a", decode_tokens=10, decode_s=1.0)
  run = dict(method="x", category="a", decode_tokens=10, decode_s=0.5, rounds=5, drafted=8,
             accepted=4, committed=9)
  with pytest.raises(metrics.MissingComparisonError, match="x record of prompt 'p1'"):
    metrics.summarize([ar, dict(run, prompt_id="p1")])
  sampled = metrics.summarize([ar, dict(run, matches_ar=None)])
  assert sampled["x"]["mismatches"] is None and sampled["ar"]["mismatches"] is None
  assert metrics.mismatch_text(sampled["x"]["mismatches"]) == "not compared"
  assert metrics.total_mismatches(sampled) is None
  with pytest.raises(metrics.MissingComparisonError, match="mixes"):
    metrics.summarize([ar, dict(run, matches_ar=None), dict(run, matches_ar=True)])
  greedy = metrics.summarize([ar, dict(run, matches_ar=True), dict(run, matches_ar=False)])
  assert greedy["x"]["mismatches"] == 1 and metrics.total_mismatches(greedy) == 1


def test_the_docs_command_reproduces_the_options_and_the_section():
  from specjax import data
  from specjax.bench.runner import BenchConfig, _command
  from specjax.drafters.names import parse_options

  cfg = BenchConfig(model="m", drafters=("knapspec",), per_category=1,
                    categories=data.SPEC_BENCH_CATEGORIES, max_new_tokens=64, max_turns=1,
                    gamma=4, threshold=None, temperature=0.0, top_p=1.0, seed=0,
                    search_iterations=60, plan_file=None,
                    options={"knapspec": {"coupled": True, "objective": "cosine", "tau": 0.3}})
  cmd = _command(cfg, "bench-m-knapspec")
  given = [w.split(" ", 1)[0] for w in cmd.split("--option ")[1:]]
  assert parse_options(given) == cfg.options  # the CLI reads back the same options
  assert cmd.endswith("--write-docs --docs-section bench-m-knapspec")


def test_the_docs_command_parses_back_to_the_run_it_records():
  """Every setting that changes the figures survives the round trip through the command
  line, the weights' precision among them (a `--dtype gguf` run once read as float32)."""
  import shlex

  from specjax.bench.runner import BenchConfig, _command
  from specjax.cli import build_parser

  cfg = BenchConfig(model="m", drafters=("8bit", "self_sd+frspec"), per_category=2,
                    categories=("coding", "math"), max_new_tokens=32, max_turns=2, gamma=6,
                    threshold=0.3, temperature=0.7, top_p=0.9, seed=3, search_iterations=40,
                    plan_file="plan.json", dtype="gguf", auto_gamma=True, llama_cpp=True)
  args = build_parser().parse_args(shlex.split(_command(cfg))[1:])
  assert (args.model, args.drafters, args.per_category, args.categories) == (
      "m", "8bit,self_sd+frspec", 2, "coding,math")
  assert (args.max_new_tokens, args.max_turns, args.gamma, args.threshold) == (32, 2, 6, 0.3)
  assert (args.temperature, args.top_p, args.seed, args.search_iterations) == (0.7, 0.9, 3, 40)
  assert (args.plan, args.dtype, args.auto_gamma, args.llama_cpp) == (
      "plan.json", "gguf", True, True)


def test_the_machine_line_names_the_cpus_widest_vector_extension():
  """Two CPUs sold as "AMD EPYC" (AVX2 only; AVX-512) take different kernel tiles: the
  record tells them apart."""
  import jax

  from specjax.bench.docs import machine, vector_extension

  assert vector_extension("fpu sse4_2 avx avx2 fma") == "AVX2"
  assert vector_extension("fpu avx avx2 avx512f avx512bw") == "AVX-512"
  assert vector_extension("fp asimd") == ""  # an aarch64 line: none named
  line = machine()
  assert line.endswith(f"cores, jax {jax.__version__}")
  info = Path("/proc/cpuinfo")
  lines = info.read_text().splitlines() if info.exists() else []
  flags = next((ln for ln in lines if ln.startswith("flags")), "")
  assert (f"({vector_extension(flags)})" in line) == bool(vector_extension(flags))


class _FakeLlama:
  """llama_cpp.Llama's few calls the baseline makes: it answers every prompt with the
  tokens 5, 6, 7, ... and notes how it was made."""

  made: dict = {}

  def __init__(self, **kw):
    _FakeLlama.made = kw

  def reset(self):
    pass

  def generate(self, ids, temp):
    assert temp == 0.0
    t = 5
    while True:
      yield t
      t += 1


def test_bench_llama_cpp_baseline_row(tmp_path, capsys, monkeypatch):
  """`--llama-cpp` adds a reference row decoded by llama.cpp on every prompt, beside AR
  (a fake binding over a tiny model given a GGUF path: the row's plumbing, not its speed)."""
  import os
  import sys
  import types

  from specjax.bench import llama_cpp

  monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_FakeLlama))
  monkeypatch.setattr(llama_cpp, "gguf_file", lambda name: tmp_path / "m.gguf")
  root = write_spec_bench(tmp_path / "data")
  out = tmp_path / "run"
  assert main(["bench", *ARGS, "--drafters", "early_exit", "--llama-cpp", "--data-dir",
               str(root), "--out", str(out)]) == 0
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  row = figures["methods"]["llama.cpp"]
  assert row["mismatches"] is None and "M" not in row and row["speedup"] > 0
  assert figures["over_llama_cpp"]["ar"] == pytest.approx(1 / row["speedup"], abs=1e-4)  # rounded
  assert _FakeLlama.made["model_path"] == str(tmp_path / "m.gguf")
  assert _FakeLlama.made["n_threads"] == _FakeLlama.made["n_threads_batch"] == os.cpu_count()
  records = [r for line in (out / "results.jsonl").read_text().splitlines()
             for r in json.loads(line)["records"] if r["method"] == "llama.cpp"]
  assert len(records) == 3
  assert all(r["tokens"][0] == list(range(5, 17)) and r["decode_tokens"] == 11
             for r in records)
  summary = (out / "summary.md").read_text()
  assert "| llama.cpp |" in summary and "decoded greedily by llama.cpp" in summary


def test_llama_cpp_record_counts_the_tokens_it_shares_with_ar():
  from specjax.bench import llama_cpp

  fake = _namespace(threads=2, generate=lambda ids, n: {
      "tokens": [4, 5, 6, 9], "prefill_s": 0.5, "decode_s": 1.5})
  rec = llama_cpp.record(fake, [1, 2], 4, [4, 5, 7, 9], {"prompt_id": "p"})
  assert rec["agreeing_tokens"] == 2 and rec["decode_tokens"] == 3 and rec["is_reference"]
  assert rec["prompt_id"] == "p" and rec["tokens"] == [[4, 5, 6, 9]]
  assert llama_cpp.record(fake, [1], 4, [4, 5, 6, 9], {})["agreeing_tokens"] == 4


def _namespace(**kw):
  import types

  return types.SimpleNamespace(**kw)


def test_llama_cpp_baseline_bad_input(tmp_path, capsys, monkeypatch):
  """No binding: the exact pip install; a tiny model: no GGUF; sampling or several turns:
  refused before anything is loaded."""
  import sys

  root = str(write_spec_bench(tmp_path / "d"))
  out = str(tmp_path / "run")
  monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
  assert main(["bench", *ARGS, "--llama-cpp", "--data-dir", root, "--out", out]) == 2
  assert "pip install llama-cpp-python" in capsys.readouterr().err
  monkeypatch.setitem(sys.modules, "llama_cpp", _namespace())
  assert main(["bench", *ARGS, "--llama-cpp", "--data-dir", root, "--out", out]) == 2
  assert "reads a GGUF file: tiny-qwen3 has no GGUF file" in capsys.readouterr().err
  base = ["bench", "--model", "smollm2-135m-instruct", "--llama-cpp", "--data-dir", root,
          "--out", out]
  assert main([*base, "--temperature", "0.7"]) == 2
  assert "decodes greedily" in capsys.readouterr().err
  assert main([*base, "--max-turns", "2"]) == 2
  assert "first turn only" in capsys.readouterr().err


def test_results_made_before_the_llama_cpp_option_still_resume():
  """A run or sweep point without `--llama-cpp` fingerprints as it did before the option
  existed (no `llama_cpp` key), so its results folder resumes; with it, the key counts."""
  import dataclasses

  from specjax.bench.runner import BenchConfig, settings_of
  from specjax.bench.sweep import Point

  cfg = BenchConfig(model="m", drafters=("8bit",), per_category=1, categories=("qa",),
                    max_new_tokens=8, max_turns=1, gamma=4, threshold=None, temperature=0.0,
                    top_p=1.0, seed=0, search_iterations=4, plan_file=None)
  assert "llama_cpp" not in settings_of(cfg)
  assert "llama_cpp" not in Point(cfg, None, ()).settings()
  assert settings_of(dataclasses.replace(cfg, llama_cpp=True))["llama_cpp"] is True


def _spec_bench_read(path: Path, task: str = "overall") -> list[dict]:
  """The questions of an answer file that Spec-Bench's evaluation/speed.py keeps for
  `task` ("overall", "mt_bench", or one category)."""
  mt_bench = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities"}
  rows = [json.loads(line) for line in path.read_text().splitlines()]
  if task == "overall":
    return rows
  return [r for r in rows if (r["category"] in mt_bench if task == "mt_bench"
                              else r["category"] == task)]


def test_spec_bench_answer_files_read_as_spec_bench_reads_them(tmp_path, capsys):
  """`--specbench-out`: one file per method that Spec-Bench's speed.py and equal.py read
  (their reading redone here from the repository's logic): per question the tokens over
  the seconds of every turn, accept lengths whose mean is the run's M, the baseline's
  tokens counted from its text, and texts equal wherever the run was lossless."""
  from specjax.models.loader import load_model

  root = write_spec_bench(tmp_path / "data")
  out, answers = tmp_path / "run", tmp_path / "answers"
  argv = ["bench", "--model", "tiny-qwen3", "--categories", "writing,qa", "--per-category",
          "1", "--max-new-tokens", "12", "--max-turns", "2", "--gamma", "3",
          "--drafters", "early_exit,8bit", "--data-dir", str(root), "--out", str(out),
          "--specbench-out", str(answers)]
  assert main(argv) == 0
  figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  files = {m: Path(p) for m, p in figures["spec_bench_answers"].items()}
  assert set(files) == {"ar", "early_exit", "8bit"}
  assert files["ar"].name == "tiny-qwen3-ar-float32-temperature-0.0.jsonl"
  records = {(r["method"], r["prompt_id"]): r
             for line in (out / "results.jsonl").read_text().splitlines()
             for r in json.loads(line)["records"]}
  tok = load_model("tiny-qwen3").tokenizer
  texts = {}
  for method, path in files.items():
    rows = _spec_bench_read(path)
    assert [r["category"] for r in rows] == ["writing", "qa"]
    assert [r["category"] for r in _spec_bench_read(path, "mt_bench")] == ["writing"]
    accepts = []
    for row in rows:
      rec = records[(method, f"spec_bench/{row['question_id']}")]
      choice = row["choices"][0]
      n_turns = 2 if row["category"] == "writing" else 1
      assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) \
          == len(rec["tokens"]) == n_turns
      assert choice["turns"] == [tok.decode(t, skip_special=True) for t in rec["tokens"]]
      assert choice["new_tokens"] == [len(t) for t in rec["tokens"]]
      # speed.py: a question's speed is its tokens over its seconds, every turn summed.
      speed = sum(choice["new_tokens"]) / sum(choice["wall_time"])
      assert speed == pytest.approx(sum(map(len, rec["tokens"]))
                                    / (rec["prefill_s"] + rec["decode_s"]), rel=1e-4)
      if method == "ar":
        assert choice["accept_lengths"] == [1] * sum(choice["new_tokens"])
      else:  # every verification round's tokens: the decoded tokens, every turn
        assert sum(choice["accept_lengths"]) == rec["decode_tokens"] == rec["committed"]
        assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"]) == rec["rounds"]
        assert all(1 <= n <= 4 for n in choice["accept_lengths"])  # γ + 1 at most
      accepts += choice["accept_lengths"]
      texts.setdefault(method, []).append(str(choice["turns"]))
    if method != "ar":
      assert sum(accepts) / len(accepts) == pytest.approx(figures["methods"][method]["M"],
                                                       abs=1e-4)  # figures: 4 places
  # equal.py: the answers, question by question, as text.
  assert texts["early_exit"] == texts["ar"] == texts["8bit"]


def test_spec_bench_answers_refuse_records_without_rounds(tmp_path):
  """Records made before the answers' fields existed are refused, naming the fix (a run
  without --resume), and no file is left half written."""
  from specjax.bench import spec_bench_answers
  from specjax.errors import ConfigError

  old = {"method": "8bit", "prompt_id": "spec_bench/1", "category": "qa", "tokens": [[1, 2]],
         "decode_s": 0.1, "prefill_s": 0.0}
  with pytest.raises(ConfigError, match="without --resume"):
    spec_bench_answers.write([old], str, tmp_path, model_id="m", dtype="float32",
                             temperature=0.0)
  assert list(tmp_path.iterdir()) == []
