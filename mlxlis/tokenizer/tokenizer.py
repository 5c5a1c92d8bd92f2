"""Tokenizers from a model folder (tokenizer.json / tokenizer.model) or a GGUF vocabulary.

Which library runs what, and why:
- tokenizer.json: `tokenizers`, whose own format it is (added tokens, post-processor and all).
- tokenizer.model: `sentencepiece`, whose own format it is.
- GGUF vocabularies ("gpt2", "llama", "gemma4"): the encoders llama.cpp would run, built in
  `tokenizer.gguf` (the proto for a "llama" one takes ~0.5 s, Gemma 4's BPE ~1.2 s).
- Special / user-defined token text is cut out first (`vocab.TableVocab`), as llama.cpp does;
  ids -> text for GGUF / SentencePiece vocabularies is `vocab.PieceTable`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlxlis.errors import TokenizerError
from mlxlis.tokenizer import vocab as tt  # token types: tt.CONTROL, ...
from mlxlis.tokenizer.gguf import IGNORE_MERGES, array, gguf_bpe, gguf_gemma4, gguf_spm
from mlxlis.tokenizer.gguf import K as _K  # GGUF metadata key prefix
from mlxlis.tokenizer.gguf_encoder import ENCODER_VOCABS
from mlxlis.tokenizer.vocab import EOG_TEXTS, JsonVocab, PieceTable, TableVocab, spm_proto

import numpy as np
import tokenizers
from sentencepiece import SentencePieceProcessor
from sentencepiece import sentencepiece_model_pb2 as spm_pb2

__all__ = ["Tokenizer", "spm_proto"]


_Backend = TableVocab | JsonVocab


class Tokenizer:
    """Text <-> ids for one model, with its BOS / EOS conventions.

    encode(special=False) reads special-token text ("<|im_start|>") as plain text; user-defined
    tokens (GGUF type 4, tokenizer.json's non-special added tokens) are matched whole either
    way, as llama.cpp and transformers do. Generation stops on `stop_ids` (eos_ids + eot_ids).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_id: int | None,
        eos_ids: Sequence[int],
        eot_ids: Sequence[int] = (),
        pad_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        source: str = "",
    ):
        self._backend = backend
        self.vocab_size: int = backend.vocab_size
        self.special_tokens: dict[str, int] = dict(backend.special_tokens)
        self.bos_id, self.pad_id = bos_id, pad_id
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.eot_ids = tuple(i for i in dict.fromkeys(eot_ids) if i not in self.eos_ids)
        self.add_bos = bool(add_bos) and bos_id is not None
        self.add_eos = bool(add_eos) and bool(self.eos_ids)
        self.bos_token = None if bos_id is None else self.id_to_token(bos_id)
        self.eos_token = self.id_to_token(self.eos_ids[0]) if self.eos_ids else None
        self.source = source  # the file or folder the vocabulary came from

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self.eos_ids + self.eot_ids)

    def encode(
        self,
        text: str,
        special: bool = False,
        add_bos: bool | None = None,
        add_eos: bool | None = None,
    ) -> list[int]:
        if not isinstance(text, str):
            raise TokenizerError(f"encode expects str, got {type(text).__name__}", path=self.source)
        ids = self._backend.encode(text, special)
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            if not (special and ids[:1] == [self.bos_id]):
                ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_ids:
            if not (special and ids[-1:] == [self.eos_ids[0]]):
                ids.append(self.eos_ids[0])
        return ids

    def decode(
        self, ids: Sequence[int], skip_special: bool = False, clean_spaces: bool = True
    ) -> str:
        """ids -> text. clean_spaces: apply the vocabulary's own clean-up pass where it has one
        (llama.cpp's detokenize does for Gemma 4 GGUF vocabularies: " ," -> "," and so on);
        False gives the tokens' pieces as they are, which is what streaming shows."""
        return self._backend.decode(ids, skip_special, clean_spaces)

    def id_to_token(self, i: int) -> str:
        if not 0 <= int(i) < self.vocab_size:
            raise TokenizerError(f"token id {i} is outside the vocabulary ({self.vocab_size})")
        return self._backend.id_to_token(int(i)) or ""

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for on its own (part of a UTF-8 character for some)."""
        if not 0 <= int(i) < self.vocab_size:
            raise TokenizerError(f"token id {i} is outside the vocabulary ({self.vocab_size})")
        return self._backend.token_bytes(int(i))

    def __repr__(self) -> str:
        return f"Tokenizer({self.source!r}, vocab_size={self.vocab_size})"

    @classmethod
    def from_folder(cls, folder: Path | str) -> Tokenizer:
        """tokenizer.json (else tokenizer.model, else Mistral's tekken.json) plus the HF
        config files beside it."""
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerError("not a folder", path=folder)
        cfg_path = folder / "tokenizer_config.json"
        cfg, smap = _read_json(cfg_path), _read_json(folder / "special_tokens_map.json")
        gen, conf = (_read_json(folder / n) for n in ("generation_config.json", "config.json"))
        sp_ids: tuple[int | None, int | None] = (None, None)  # tokenizer.model's own bos / eos
        if (folder / "tokenizer.json").is_file():
            backend: _Backend = _load_json(folder / "tokenizer.json")
        elif (folder / "tokenizer.model").is_file():
            backend, sp_ids = _load_spm(folder / "tokenizer.model", cfg)
        elif (folder / "tekken.json").is_file():  # Mistral's own format
            from mlxlis.tokenizer.tekken import load_tekken

            backend = JsonVocab(load_tekken(folder / "tekken.json"))
        else:
            raise TokenizerError(
                "missing (so are tokenizer.model and tekken.json)",
                path=folder,
                field="tokenizer.json",
            )
        for i, spec in _added_tokens(cfg, cfg_path):
            if spec.get("special") and isinstance(spec.get("content"), str):
                backend.special_tokens.setdefault(spec["content"], i)

        def token_id(key: str) -> int | None:
            text = _token_text(cfg, key, cfg_path)
            text = text or _token_text(smap, key, folder / "special_tokens_map.json")
            return backend.token_to_id(text) if text else None

        text_conf = conf.get("text_config") if isinstance(conf.get("text_config"), dict) else {}
        bos_ids = [token_id("bos_token"), *_ids(gen, "bos_token_id"), *_ids(conf, "bos_token_id")]
        bos_id = next((i for i in [*bos_ids, sp_ids[0]] if i is not None), None)
        eos_ids = [token_id("eos_token"), *(i for c in (gen, conf, text_conf) for i in _ids(c))]
        eos_ids = [i for i in eos_ids if i is not None] or [i for i in sp_ids[1:] if i is not None]
        if isinstance(backend, JsonVocab):  # does the post-processor add them?
            plain, full = backend.encode("a", False), backend.encode("a", False, True)
            auto_bos = len(full) > len(plain) and bos_id is not None and full[0] == bos_id
            auto_eos = len(full) > len(plain) and full[-1] in eos_ids and plain[-1:] != full[-1:]
        else:  # a bare tokenizer.model says nothing: llama.cpp's SPM default, as from_gguf
            auto_bos, auto_eos = bos_id is not None, False
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            pad_id=token_id("pad_token"),
            add_bos=_flag(cfg, "add_bos_token", auto_bos, cfg_path),
            add_eos=_flag(cfg, "add_eos_token", auto_eos, cfg_path),
            source=str(folder),
        )

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], path: Path | str) -> Tokenizer:
        """From a GGUF's `tokenizer.ggml.*` metadata; `path` is named in messages."""
        path = Path(path)
        # a missing tokenizer.ggml.model means GPT-2 byte-level BPE, the GGUF spec's own
        # default -- the one deliberate guess (a wrong one garbles the first decode, loudly).
        kind = metadata.get("tokenizer.ggml.model", "gpt2")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
            raise TokenizerError("missing or not a string array", path=path, field=_K + "tokens")
        types = array(metadata, "token_type", len(tokens), path)
        types = [tt.NORMAL] * len(tokens) if types is None else np.asarray(types).tolist()

        def special_id(key: str, default: int | None = None) -> int | None:
            v = metadata.get(_K + key, default)
            if v is not None and (not isinstance(v, int | np.integer) or not 0 <= v < len(tokens)):
                raise TokenizerError(f"{v!r} is not a token id", path=path, field=_K + key)
            return None if v is None else int(v)

        bos_id, eos_id = special_id("bos_token_id"), special_id("eos_token_id")
        if kind == "gpt2":
            pre = metadata.get(_K + "pre")
            backend = gguf_bpe(metadata, tokens, types, pre, path)
            add_bos = pre in IGNORE_MERGES  # llama.cpp: llama-3 style vocabularies add BOS
        elif kind == "llama":  # llama.cpp's SPM defaults: <unk> 0, <s> 1, </s> 2, add BOS
            bos_id, eos_id = special_id("bos_token_id", 1), special_id("eos_token_id", 2)
            unk_id = special_id("unknown_token_id", 0)
            backend = gguf_spm(metadata, tokens, types, path, unk=unk_id, bos=bos_id, eos=eos_id)
            add_bos = True
        elif kind == "gemma4":
            backend = gguf_gemma4(metadata, tokens, types, path)
            add_bos = True
        elif kind in ENCODER_VOCABS:  # an encoder's: [CLS] / <s> and [SEP] / </s> added
            backend = JsonVocab(ENCODER_VOCABS[kind](metadata, tokens, types, path))
            if kind == "bert":  # llama.cpp's WPM: [CLS] and [SEP], whatever eos_token_id says
                bos_id = special_id("bos_token_id", 101)
                eos_id = special_id("seperator_token_id", 102)
            add_bos = True
        else:
            msg = f"unsupported tokenizer model {kind!r} (supported: gpt2, llama, gemma4, bert, t5)"
            raise TokenizerError(msg, path=path, field=_K + "model")
        add_bos = bool(metadata.get(_K + "add_bos_token", add_bos))
        add_bos |= kind == "gemma4"  # llama.cpp overrides a false add_bos_token for Gemma 4
        eot_ids = [special_id("eot_token_id"), special_id("eom_token_id")]
        eot_ids += sorted(i for t, i in backend.special_tokens.items() if t in EOG_TEXTS)
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=[] if eos_id is None else [eos_id],
            eot_ids=[i for i in eot_ids if i is not None],
            pad_id=special_id("padding_token_id"),
            add_bos=add_bos,
            add_eos=bool(metadata.get(_K + "add_eos_token", kind == "bert")),
            source=str(path),
        )


def _added_tokens(cfg: dict[str, Any], path: Path) -> list[tuple[int, dict]]:
    """tokenizer_config.json's added_tokens_decoder as (id, spec), ids checked and bounded."""
    from mlxlis.limits import CONFIG_MAX_VOCAB

    table = cfg.get("added_tokens_decoder") or {}
    if not isinstance(table, dict):
        raise TokenizerError("expected an object", path=path, field="added_tokens_decoder")
    out = []
    for key, spec in table.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < CONFIG_MAX_VOCAB):
            raise TokenizerError(f"bad token id {key!r}", path=path, field="added_tokens_decoder")
        if isinstance(spec, dict):
            out.append((int(key), spec))
    return out


def _load_json(path: Path) -> JsonVocab:
    try:
        return JsonVocab(tokenizers.Tokenizer.from_file(str(path)))
    except Exception as e:  # find out what is wrong: unreadable, not JSON, or a bad field
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e2:
            raise TokenizerError(f"cannot read: {e2}", path=path) from e2
        spec = _read_json(path, text=text)
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
            raise TokenizerError("missing or not an object", path=path, field="model") from e
        m = re.search(r"`(\w+)`", str(e))  # tokenizers names fields so: "missing field `vocab`"
        raise TokenizerError(f"cannot load: {e}", path=path, field=m[1] if m else "model") from e


def _load_spm(path: Path, cfg: dict[str, Any]) -> tuple[TableVocab, tuple[int | None, int | None]]:
    proto, sp = spm_pb2.ModelProto(), SentencePieceProcessor()
    try:
        data = path.read_bytes()
        proto.ParseFromString(data)
        sp.LoadFromSerializedProto(data)
    except Exception as e:
        raise TokenizerError(f"not a SentencePiece model: {e}", path=path, field="pieces") from e
    tokens = [p.piece for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]
    added: dict[str, int] = {}  # sentencepiece matches its own user-defined pieces, not these
    for i, spec in _added_tokens(cfg, path):  # ids past the model's
        if i >= len(tokens) and isinstance(spec.get("content"), str):
            tokens += [""] * (i + 1 - len(tokens))
            types += [tt.UNUSED] * (i + 1 - len(types))
            tokens[i] = spec["content"]
            types[i] = tt.CONTROL if spec.get("special") else tt.USER_DEFINED
            if not spec.get("special"):
                added[tokens[i]] = i
    dummy = proto.normalizer_spec.add_dummy_prefix
    pieces = PieceTable(tokens, types, byte_level=False, strip_dummy_space=dummy)
    vocab = TableVocab(tokens, types, sp.encode, pieces, added)
    return vocab, tuple(i if i >= 0 else None for i in (sp.bos_id(), sp.eos_id()))


def _read_json(path: Path, *, text: str | None = None) -> Any:
    """A JSON file's content ({} if absent); a dict unless `text` (already read) is given."""
    if text is None and not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8") if text is None else text)
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read: {e}", path=path) from e
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise TokenizerError(f"not valid JSON ({e.msg})", path=path, field=where) from e
    if text is None and not isinstance(data, dict):
        raise TokenizerError("not a JSON object", path=path)
    return data


def _token_text(cfg: dict[str, Any], key: str, path: Path) -> str | None:
    """bos_token / eos_token as HF writes them: a string, {"content": ...} or null."""
    v = cfg.get(key)
    v = v.get("content") if isinstance(v, dict) else v
    if v is not None and not isinstance(v, str):
        raise TokenizerError(
            f"expected a string or {{content: ...}}, not {v!r}", path=path, field=key
        )
    return v or None


def _ids(cfg: dict[str, Any], key: str = "eos_token_id") -> list[int]:
    v = cfg.get(key)
    vs = v if isinstance(v, list) else [v]
    return [i for i in vs if isinstance(i, int) and not isinstance(i, bool)]


def _flag(cfg: dict[str, Any], key: str, default: bool, path: Path) -> bool:
    v = cfg.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise TokenizerError(f"expected true or false, got {v!r}", path=path, field=key)
    return v
