"""Tokenizer and chat template read from the same GGUF file as the weights.

GGUF carries the vocabulary, merges (byte-level BPE: gpt2 family) or scores
(SentencePiece BPE: llama family, used by gemma), the special tokens and the Jinja chat
template. We rebuild an equivalent HF `tokenizers` pipeline from those fields; the
result is cached as tokenizer.json next to the converted params.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from specjax.errors import ConfigError
from specjax.models.gguf import GGUFFormatError, _field

# GGUF token types (llama.cpp): 3 = control, 4 = user-defined, 6 = byte.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns, from the upstream tokenizer.json of each family.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TextTokenizer:
  """encode / decode / chat template, the interface every model's tokenizer offers."""

  def __init__(
      self,
      tokenizer: Tokenizer,
      *,
      bos_id: int | None,
      add_bos: bool,
      chat_template: str | None,
      special: dict[str, str],
  ):
    self._tok = tokenizer
    self.bos_id = bos_id
    self.add_bos = add_bos
    self.chat_template = chat_template
    self.special = special  # bos_token / eos_token strings for the template

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def is_chat(self) -> bool:
    return self.chat_template is not None

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
      ids = [self.bos_id] + ids
    return ids

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special)

  def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Apply the model's own chat template (as HF does: sandboxed Jinja, trimmed blocks)."""
    if self.chat_template is None:
      raise ConfigError("this model has no chat template (a base model): pass raw text")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message):
      raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(self.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **self.special
    )

  def encode_prompt(self, prompt: str, chat: bool | None = None) -> list[int]:
    """A user prompt -> ids: through the chat template for instruct models."""
    use_chat = self.is_chat if chat is None else chat
    if use_chat:
      return self.encode_chat([{"role": "user", "content": prompt}])
    return self.encode(prompt)

  def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
    """A conversation -> ids, ending with the assistant's turn to speak."""
    text = self.render_chat(messages)
    # Templates that write the BOS themselves must not get a second one.
    bos = self.special.get("bos_token")
    return self.encode(text, add_bos=self.add_bos and not (bos and text.startswith(bos)))

  def save(self, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(directory / "tokenizer.json"))
    meta = dict(
        bos_id=self.bos_id, add_bos=self.add_bos, chat_template=self.chat_template,
        special=self.special,
    )
    (directory / "tokenizer_meta.json").write_text(json.dumps(meta))

  @classmethod
  def load(cls, directory: Path) -> TextTokenizer:
    meta = json.loads((directory / "tokenizer_meta.json").read_text())
    return cls(Tokenizer.from_file(str(directory / "tokenizer.json")), **meta)


def tokenizer_from_gguf(reader) -> TextTokenizer:
  kind = _field(reader, "tokenizer.ggml.model")
  tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  if kind == "gpt2":
    tok = _byte_level_bpe(reader, tokens)
  elif kind == "llama":
    tok = _sentencepiece_bpe(reader, tokens)
  else:
    raise GGUFFormatError(f"tokenizer model {kind!r} is not supported (gpt2 or llama)")
  # Control and user-defined tokens must match as whole strings, never split.
  specials = [t for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED)]
  from tokenizers import AddedToken

  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
  bos = _field(reader, "tokenizer.ggml.bos_token_id")
  eos = _field(reader, "tokenizer.ggml.eos_token_id")
  special = {}
  if bos is not None:
    special["bos_token"] = tokens[int(bos)]
  if eos is not None:
    special["eos_token"] = tokens[int(eos)]
  return TextTokenizer(
      tok,
      bos_id=None if bos is None else int(bos),
      add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")),
      chat_template=_field(reader, "tokenizer.chat_template"),
      special=special,
  )


def _byte_level_bpe(reader, tokens: list[str]) -> Tokenizer:
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
  pre = _field(reader, "tokenizer.ggml.pre", "default")
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in ("qwen2",))
  if pre == "qwen2":
    split = pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated")
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
  elif pre == "smollm":
    digits = pre_tokenizers.Digits(individual_digits=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  return tok


def _sentencepiece_bpe(reader, tokens: list[str]) -> Tokenizer:
  """SentencePiece BPE as ranked merges: a pair merges in order of its result's score."""
  scores = list(_field(reader, "tokenizer.ggml.scores"))
  vocab = {t: i for i, t in enumerate(tokens)}
  ranked = []
  for piece, score in zip(tokens, scores):
    for cut in range(1, len(piece)):
      left, right = piece[:cut], piece[cut:]
      if left in vocab and right in vocab:
        ranked.append((-score, vocab[left], vocab[right], left, right))
  ranked.sort()
  merges = [(left, right) for *_, left, right in ranked]
  unk = _field(reader, "tokenizer.ggml.unknown_token_id")
  tok = Tokenizer(
      models.BPE(
          vocab, merges, byte_fallback=True, fuse_unk=True,
          unk_token=None if unk is None else tokens[int(unk)],
      )
  )
  prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
  norms = [normalizers.Prepend("▁")] if prefix else []
  tok.normalizer = normalizers.Sequence(norms + [normalizers.Replace(" ", "▁")])
  tok.decoder = decoders.Sequence(
      [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(" ", 1, 0)] if prefix else [])
  )
  return tok


class ByteTokenizer:
  """UTF-8 bytes as ids 3..258 (0 pad, 1 BOS, 2 EOS): the tokenizer of the tiny models."""

  OFFSET = 3
  bos_id = 1
  add_bos = True
  chat_template = None
  is_chat = False
  vocab_size = 259

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    ids = [b + self.OFFSET for b in text.encode("utf-8")]
    return [self.bos_id] + ids if (self.add_bos if add_bos is None else add_bos) else ids

  def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
    data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
    return data.decode("utf-8", errors="replace")

  def encode_prompt(self, prompt: str, chat: bool | None = None) -> list[int]:
    return self.encode(prompt)
