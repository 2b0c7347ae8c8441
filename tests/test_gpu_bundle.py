"""experiments/gpu_bundle.py and the run.sh it puts in each part: the parts, staged one by
one (a damaged one refused, then replaced), unpack into a place where the real SmolLM2 GGUF
file, the carried wheels, data and artefacts are found as specjax looks for them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specjax.models.registry import get_spec, is_installed

ROOT = Path(__file__).resolve().parents[1]
from experiments import gpu_bundle

MODEL = "smollm2-135m-instruct"

# Run inside the unpacked bundle: what specjax would find there.
PROBE = """
import hashlib, json, os, sjprobe
from pathlib import Path
from specjax.models.registry import get_spec
gguf = get_spec("smollm2-135m-instruct").locate()
print(json.dumps({"gguf": str(gguf), "sha": hashlib.sha256(gguf.read_bytes()).hexdigest(),
                  "cache": sorted(str(p.relative_to(os.environ["SPECJAX_CACHE"]))
                                  for p in Path(os.environ["SPECJAX_CACHE"]).rglob("*")
                                  if p.is_file()),
                  "data": os.environ["SPECJAX_DATA_DIR"]}))
"""


def _wheel(folder: Path) -> None:
  """A one-module wheel (no network here): proof that run.sh installs what it carries."""
  folder.mkdir()
  info = "sjprobe-0.1.dist-info"
  with zipfile.ZipFile(folder / "sjprobe-0.1-py3-none-any.whl", "w") as z:
    z.writestr("sjprobe/__init__.py", "OK = True\n")
    z.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: sjprobe\nVersion: 0.1\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                "Tag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", "")


def _run(part: Path, *command: str) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k not in ("SPECJAX_CACHE", "PYTHONPATH")}
  env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # python3 = ours
  return subprocess.run(["bash", str(part / "run.sh"), *command], check=False, cwd=ROOT,
                        env=env, capture_output=True, text=True)


def test_parts_staged_one_by_one_unpack_what_specjax_needs(tmp_path, monkeypatch, capsys):
  if not is_installed(get_spec(MODEL)):
    pytest.skip(f"{MODEL} weights package not installed")
  from specjax.models.source import resolve

  gguf = get_spec(MODEL).locate()
  key = resolve(MODEL).key  # artefacts are kept under the file's fingerprint
  cache, data, stage = tmp_path / "cache", tmp_path / "data", tmp_path / "stage"
  (cache / "shortlists" / key).mkdir(parents=True)
  (cache / "shortlists" / key / "counts.npz").write_bytes(b"counts")
  (data / "spec_bench").mkdir(parents=True)
  (data / "spec_bench" / "question.jsonl").write_text("{}\n")
  plan = tmp_path / "self_sd_plan-abc.json"
  plan.write_text("{}")
  _wheel(tmp_path / "wheels")
  monkeypatch.setenv("SPECJAX_CACHE", str(cache))

  size = gguf.stat().st_size
  mib = size / 2**20 / 2.5  # three parts
  assert gpu_bundle.main(["--out", str(tmp_path / "b"), "--data-dir", str(data), "--plan",
                          str(plan), "--part-mib", str(mib), "--wheels-from",
                          str(tmp_path / "wheels"), "--stage", str(stage)]) == 0
  printed = capsys.readouterr()
  manifest = json.loads(printed.out.strip().splitlines()[-1])
  assert manifest["parts"] == 3 and "no knn" in printed.err  # not built: said, not carried
  assert manifest["artefacts"] == [f"plans/{plan.name}", f"shortlists/{key}"]
  parts = [tmp_path / "b" / f"part{i}" for i in (1, 2, 3)]
  assert all((p / "run.sh").exists() and (p / "manifest.json").exists() for p in parts)

  assert json.loads(_run(parts[0]).stdout)["staged"] == 1
  early = _run(parts[2], "true")
  assert early.returncode == 3 and "every part" in early.stderr  # nothing runs half-staged
  (stage / "chunk.001").write_bytes(b"damaged")
  assert _run(parts[1]).returncode != 0  # the last part in: the tar's SHA-256 refuses it
  assert json.loads(_run(parts[0]).stdout)["ready"]  # sent again: unpacked
  probe = _run(parts[2], "python3", "-c", PROBE)
  assert probe.returncode == 0, probe.stderr
  found = json.loads(probe.stdout.strip().splitlines()[-1])
  assert Path(found["gguf"]).is_relative_to(stage)
  assert found["sha"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
  assert found["cache"] == [f"plans/{plan.name}", f"shortlists/{key}/counts.npz"]
  assert (Path(found["data"]) / "spec_bench" / "question.jsonl").exists()
  assert not list(stage.glob("chunk.*"))  # unpacked once, chunks dropped
  again = _run(stage, "python3", "-c", PROBE)  # later calls carry no part
  assert again.returncode == 0 and json.loads(again.stdout.strip().splitlines()[-1]) == found


def test_the_checks_script_parses_and_refuses_an_unknown_step(tmp_path):
  script = ROOT / "experiments" / "gpu_checks.sh"
  assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
  env = {**os.environ, "OUT": str(tmp_path), "RUNS": str(tmp_path / "runs")}
  out = subprocess.run(["bash", str(script), "nope"], check=False, capture_output=True,
                       text=True, env=env)
  assert out.returncode == 2 and "unknown step 'nope'" in out.stderr


def test_the_forward_step_runs_bench_gpu_without_a_bundle(tmp_path):
  """`forward` on a random-init shape: specjax found from the checkout (no bundle sets its
  path), the draft rows FORWARD_DRAFTS names (one with a space) timed, the model's JSON
  line written under $OUT, and the script's own JSON last."""
  env = {**os.environ, "OUT": str(tmp_path), "RUNS": str(tmp_path / "runs"),
         "FORWARD_MODELS": "shape:tiny",
         "FORWARD_DRAFTS": "0.5,0.5 early stop", "FORWARD_S": "300", "PYTHONPATH": "",
         "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # ours
  out = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_checks.sh"), "forward"],
                       check=False, capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stderr
  (row,) = [json.loads(line) for line in (tmp_path / "forward-bf16.jsonl").read_text()
            .splitlines()]
  assert row["model"] == "shape:tiny" and row["loop_ar_ms"] > 0
  assert set(row["loop_draft_over_ar"]) == {"0.5", "0.5 early stop"}
  assert json.loads(out.stdout.strip().splitlines()[-1])["steps"] == ["forward"]


def test_the_profile_step_saves_a_printed_profile_where_knapspec_looks(tmp_path):
  """PROFILE_FROM: the last line `specjax profile` printed on an earlier run (its log),
  saved into the cache instead of measuring again on the GPU's clock."""
  from specjax.selection import profiler

  prof = profiler.LatencyProfile("tiny-llama", profiler.device_name(), "mixed", 6, 5,
                                 (64, 128), (1e-4, 2e-4), (3e-4, 3e-4), (1e-3, 1e-3),
                                 (5e-3, 6e-3), (4e-3, 4e-3))
  log = tmp_path / "profile.json"
  log.write_text("| a table |\n" + json.dumps({**prof.to_json(), "path": "/elsewhere"}))
  env = {**os.environ, "OUT": str(tmp_path / "out"), "RUNS": str(tmp_path / "runs"),
         "SPECJAX_CACHE": str(tmp_path / "cache"),
         "PROFILE_FROM": str(log),
         "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}  # ours
  out = subprocess.run(["bash", str(ROOT / "experiments" / "gpu_checks.sh"), "profile"],
                       check=False, capture_output=True, text=True, env=env, cwd=ROOT)
  assert out.returncode == 0, out.stderr
  saved = tmp_path / "cache" / "profiles" / f"tiny-llama__{prof.device}__mixed.json"
  assert profiler.load_profile("tiny-llama", 6, saved) == prof


@pytest.mark.parametrize("model, says", [("tiny-llama", "needs no bundle"),
                                         ("qwen2.5-coder-0.5b-instruct", "inside one package")])
def test_a_model_that_cannot_be_bundled_is_refused_before_anything_is_written(tmp_path, model,
                                                                               says):
  with pytest.raises(SystemExit, match=says):
    gpu_bundle.main(["--model", model, "--out", str(tmp_path / "b")])
  assert not (tmp_path / "b").exists()
