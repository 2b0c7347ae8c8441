"""The standing experiment scripts run end to end on tiny inputs, so a session with a real
model or a GPU only has to run them (the others have their own tests beside the code they
measure). Each is run as a reader runs it, `python -m experiments.NAME`, in a child."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_data import write_spec_bench

ROOT = Path(__file__).resolve().parent.parent
STANDING = ["bench_attention", "bench_cpu_kernels", "bench_forward", "bench_gguf_kernel",
            "bench_gpu", "bench_jax_versions", "bench_knn_streams", "bench_layer_dp",
            "bench_load", "bench_long_context", "bench_loops", "bench_quant_steps",
            "bench_quantspec", "bench_vocab", "gpu_bundle", "hf_real_weights", "kernels_gpu",
            "profile_round", "router_ablation"]


def _fresh_cache(tmp_path: Path, monkeypatch) -> None:
  """An empty cache for the child, which builds its counts, libraries and profiles afresh,
  holding only the suite's trained tiny models: a child that trained tiny-llama again spent
  15 of its 37 s on it (bench_long_context's test, 2026-12-07)."""
  from specjax.storage import cache_root

  trained = Path(cache_root()) / "tiny"
  trained.mkdir(parents=True, exist_ok=True)
  (tmp_path / "cache").mkdir()
  (tmp_path / "cache" / "tiny").symlink_to(trained, target_is_directory=True)
  monkeypatch.setenv("SPECJAX_CACHE", str(tmp_path / "cache"))


def _run(name: str, *args: str, timeout: int = 900) -> str:
  out = subprocess.run([sys.executable, "-m", f"experiments.{name}", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout


def test_the_index_lists_every_script_and_each_answers_help():
  """experiments/README.md names every script there is; each parses its arguments
  without running (no import-time work, no sys.path edit)."""
  scripts = sorted(p.stem for p in (ROOT / "experiments").glob("*.py")
                   if p.stem not in ("__init__", "report"))
  assert scripts == sorted(STANDING)
  index = (ROOT / "experiments" / "README.md").read_text()
  for name in scripts:
    assert f"`{name}`" in index, name
    assert "sys.path" not in (ROOT / "experiments" / f"{name}.py").read_text(), name
  for name in ("bench_loops", "bench_load", "hf_real_weights", "bench_vocab"):
    assert "usage:" in _run(name, "--help", timeout=120)


def test_bench_loops_commits_the_same_tokens_in_both_loops(tmp_path):
  """The device loop against the host loop on a tiny model: identical tokens, AR's tokens
  (0 mismatches), a speed for each loop and AR, one JSON line at the end."""
  data = write_spec_bench(tmp_path / "data", per_category=1)
  out = _run("bench_loops", "--model", "tiny-llama", "--drafters", "8bit,clasp",
             "--categories", "writing,coding", "--max-new-tokens", "8", "--repeats", "1",
             "--data-dir", str(data))
  figures = json.loads(out.strip().splitlines()[-1])
  assert figures["prompts"] == 2 and figures["ar_tok_s"] > 0
  for name in ("8bit", "clasp"):
    row = figures["drafters"][name]
    assert row["same_tokens"] is True and row["mismatches"] == 0, (name, row)
    assert row["host_tok_s"] > 0 and row["device_tok_s"] > 0


def test_bench_load_loads_a_written_checkpoint(tmp_path):
  """A checkpoint of the tiny shape written in shards with its index, loaded by specjax in
  a child process: the load's time and memory figures, the model's bytes."""
  out = _run("bench_load", "--shape", "tiny-qwen2", "--repeats", "1", "--loaders", "specjax",
             "--dir", str(tmp_path / "ckpt"))
  figures = json.loads(out.strip().splitlines()[-1])
  loaded = figures["loaders"]["specjax"]
  assert figures["checkpoint_bytes"] > 0 and loaded["seconds"] > 0
  index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
  assert loaded["model_bytes"] == index["metadata"]["total_size"]  # bf16 in, bf16 held
  assert 0 < figures["checkpoint_bytes"] - loaded["model_bytes"] < 1 << 16  # the headers


SHARED = ROOT.parent / "shared" / "data"


@pytest.mark.skipif(not (SHARED / "gsm8k" / "train.parquet").exists(),
                    reason="FR-Spec's counts are built from GSM8K in ../shared/data")
def test_bench_vocab_builds_its_shortlists_and_decodes_losslessly(tmp_path, monkeypatch):
  """Counts, clusters and a router built for a tiny model from training prompts, then the
  full head, FR-Spec and DynaSpec (the paper's router input, and h_t on a router trained on
  the same text) decode the evaluation prompts with AR's tokens; the
  router's recall and the shortlists' verdicts are reported. Then the router ablation
  trains a router of each input on that build's text and scores both on the same
  held-out positions."""
  _fresh_cache(tmp_path, monkeypatch)
  out = _run("bench_vocab", "--model", "tiny-llama", "--categories", "writing,coding",
             "--max-new-tokens", "8", "--repeats", "1", "--train-prompts", "4",
             "--clusters", "8", "--k-max", "2", "--router-prompts", "8",
             "--methods", "full-vocab,frspec-1k,dynaspec,dynaspec-ht", "--data-dir",
             str(SHARED), "--out", str(tmp_path / "out"))
  figures = json.loads(out.strip().splitlines()[-1])
  for name in ("full-vocab", "frspec-1k", "dynaspec", "dynaspec-ht"):
    assert figures["methods"][name]["mismatches"] == 0, name
    assert figures["methods"][name]["M"] >= 1
  assert 0 <= figures["router_recall"]["1"] <= 1
  # FR-Spec at 1k and the h_t router are our variants: only DynaSpec's defaults are judged
  assert {v["subject"] for v in figures["verdicts"]} == {"DynaSpec"}
  assert all(v["evidence"].startswith("dynaspec ") for v in figures["verdicts"])
  out = _run("router_ablation", "--model", "tiny-llama", "--clusters", "8", "--prompts", "4",
             "--router-prompts", "8", "--sizes", "6", "--weights", "", "--epochs", "1",
             "--hidden", "16", "--data-dir", str(SHARED), "--out", str(tmp_path / "ablation"))
  ablation = json.loads(out.strip().splitlines()[-1])
  assert [v["inputs"] for v in ablation["variants"]] == ["embed_prev", "hidden"]
  assert ablation["eval_positions"]["outputs"] > 0
  for v in ablation["variants"]:
    assert 0 <= v["outputs"]["2"] <= 1 and v["sequences"] == 6
  assert "A router reading hidden instead of embed_prev moves it by" in ablation["findings"]


def test_bench_knn_streams_builds_a_library_and_decodes_its_streams(tmp_path, monkeypatch):
  """A KNN-SSD library for a tiny model over the default five domains (timed searches of
  two candidates), then SSD-F, SSD-M and KNN-SSD on streams at two mix ratios and one
  HumanEval prompt: every decode is AR's, the library's rank agreement is reported per
  domain, and the verdict leaves stability unjudged: two ratios are too few."""
  _fresh_cache(tmp_path, monkeypatch)
  data = write_spec_bench(tmp_path / "data", per_category=12)
  out = _run("bench_knn_streams", "--model", "tiny-llama", "--data-dir", str(data),
             "--search-iterations", "3", "--knn-search-prompts", "2", "--stream-length", "2",
             "--ratios", "0,1", "--classify-per-domain", "2", "--ood", "1",
             "--max-new-tokens", "6", "--out", str(tmp_path / "out"))
  figures = json.loads(out.strip().splitlines()[-1])
  assert figures["mismatches"] == 0
  assert set(figures["rank_agreement"]) == {"summarization", "math_reasoning", "translation",
                                            "qa", "rag"}
  assert all(-1 <= r <= 1 for r in figures["rank_agreement"].values())
  for ratio in ("0.0", "1.0"):
    assert {"ssd_f", "ssd_m", "knn"} <= set(figures["streams"][ratio])
  (verdict,) = figures["verdicts"]
  assert "stability needs 3 mix ratios or more, the run has 2" in verdict["evidence"]


@pytest.mark.skipif(not (SHARED / "spec_bench").exists(),
                    reason="long prompts are built from Spec-Bench documents in ../shared/data")
def test_bench_long_context_keeps_each_methods_median_pass(tmp_path, monkeypatch):
  """CLaSp and budgeted KnapSpec on two long prompts of a tiny model (real Spec-Bench
  questions overflow its context of 512), two passes over each prompt, each from a copy of
  the drafters' carried states (the second prompt's passes copy real ones): every decode
  is AR's and every method has its figures."""
  _fresh_cache(tmp_path, monkeypatch)
  out = _run("bench_long_context", "--model", "tiny-llama", "--contexts", "96,192",
             "--prompts", "1", "--spec-bench", "0", "--drafters", "clasp,knapspec-budget",
             "--max-new-tokens", "8", "--passes", "2", "--tpt-candidates", "0",
             "--data-dir", str(SHARED), "--out", str(tmp_path / "out"))
  figures = json.loads(out.strip().splitlines()[-1])
  assert figures["mismatches"] == 0
  assert set(figures["workloads"]) == {"ctx-96", "ctx-192"}
  for workload in figures["workloads"].values():
    assert {"ar", "clasp", "knapspec-budget"} <= set(workload)
    assert all(m["tokens_per_s"] > 0 for m in workload.values())
