"""Tokenizer and chat template, read from the same GGUF file as the weights, or from a
Hugging Face checkpoint folder (`tokenizer_from_folder`).

GGUF carries the vocabulary, merges (byte-level BPE: gpt2 family) or scores
(SentencePiece BPE: llama family, used by gemma), the special tokens and the Jinja chat
template. We rebuild an equivalent HF `tokenizers` pipeline from those fields; the
result is cached as tokenizer.json next to the converted params.
"""

from __future__ import annotations

import datetime
import functools
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

  def token_id(self, token: str) -> int | None:
    """The id of a token's string (a special token's), None if the vocabulary lacks it."""
    return self._tok.token_to_id(token)

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
    """Apply the model's own chat template as transformers does: sandboxed Jinja with
    trimmed blocks and loop controls, `raise_exception`, `strftime_now` (Llama 3.1's
    templates date the system prompt), a `tojson` that keeps non-ASCII text, and the
    special tokens' strings."""
    if self.chat_template is None:
      raise ConfigError("this model has no chat template (a base model): pass raw text")
    return _template(self.chat_template).render(
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


@functools.lru_cache(maxsize=8)
def _template(source: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.filters["tojson"] = tojson
  return env.from_string(source)


class FolderTokenizer(TextTokenizer):
  """A Hugging Face checkpoint's tokenizer (`tokenizer.json`), encoding as transformers
  does: its post-processor adds the special tokens of plain text (BOS where the model has
  one), and a chat is encoded without them, since the template writes its own."""

  def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_bos is not False).ids

  def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
    return self._tok.encode(self.render_chat(messages), add_special_tokens=False).ids

  def save(self, directory: Path) -> None:
    raise NotImplementedError("a checkpoint folder's tokenizer is read from the folder")


def tokenizer_from_folder(folder: Path) -> FolderTokenizer:
  """`tokenizer.json` through `tokenizers`; the chat template from `chat_template.jinja`
  (transformers 5) or `tokenizer_config.json` (its default, when it lists several); the
  special tokens' strings from `tokenizer_config.json` and `special_tokens_map.json`."""
  folder = Path(folder)
  if not (folder / "tokenizer.json").is_file():
    raise ConfigError(f"{folder} has no tokenizer.json (a slow-tokenizer-only checkpoint: "
                      f"save it again with transformers' AutoTokenizer.save_pretrained)")
  tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
  config = _json(folder / "tokenizer_config.json")
  special = {}
  for source in (_json(folder / "special_tokens_map.json"), config):
    for key, value in source.items():
      if key.endswith("_token") and value is not None:
        special[key] = value["content"] if isinstance(value, dict) else str(value)
  template = config.get("chat_template")
  if isinstance(template, list):  # [{"name": ..., "template": ...}]
    template = {t["name"]: t["template"] for t in template}.get("default")
  if (folder / "chat_template.jinja").is_file():
    template = (folder / "chat_template.jinja").read_text()
  bos = special.get("bos_token")
  bos_id = tok.token_to_id(bos) if bos else None
  return FolderTokenizer(tok, bos_id=bos_id, add_bos=bool(config.get("add_bos_token", True)),
                         chat_template=template, special=special)


def _json(path: Path) -> dict:
  return json.loads(path.read_text()) if path.is_file() else {}


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
