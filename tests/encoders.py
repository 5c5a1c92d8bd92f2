"""Tiny random encoders saved the way their users save them: sentence-transformers folders
built with sentence-transformers' own modules, and CrossEncoder folders (tests of embeddings
and reranking compare mlxlis against sentence-transformers on these)."""

from __future__ import annotations

import shutil
from pathlib import Path

WORDS = (
    "the a of and to in is it that for on with as this was query document passage search "
    "retrieval embedding model vector sentence text short long local server apple silicon"
).split()
SPECIAL = ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "[MASK]"]  # [PAD] = 1: XLM-R's padding index too
MAX_SEQ = 40  # the folders' max_seq_length: inputs past it are cut (both sides must agree)


def word_piece_tokenizer(folder: Path):
    """A BERT WordPiece tokenizer whose vocabulary covers any lower-case ASCII text."""
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(".,!?'0123456789")
    vocab = SPECIAL + WORDS + letters + ["##" + c for c in letters]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tok = BertTokenizerFast(
        str(folder / "vocab.txt"),
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        mask_token="[MASK]",
    )
    return tok


def byte_bpe_tokenizer(folder: Path):
    """A byte-level BPE tokenizer (ModernBERT's kind: GPT-2's split, [CLS] text [SEP]) trained
    here on sentences of WORDS, the same special tokens at the same ids as word_piece_tokenizer."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([" ".join(rng.choices(WORDS, k=8)) for _ in range(400)], trainer)
    tk.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 0), ("[SEP]", 2)],
    )
    folder.mkdir(parents=True, exist_ok=True)
    names = ("cls", "pad", "sep", "unk", "mask")
    special = {f"{n}_token": t for n, t in zip(names, SPECIAL, strict=True)}
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="[CLS]", eos_token="[SEP]", **special
    )


def unigram_tokenizer(folder: Path):
    """An XLM-RoBERTa tokenizer over a SentencePiece unigram model trained here on sentences of
    WORDS (saved beside it as sentencepiece.bpe.model, the file XLM-R checkpoints ship and
    llama.cpp's converter reads): fairseq's ids, <s> 0, <pad> 1, </s> 2, <unk> 3."""
    import io
    import random

    import sentencepiece as spm
    from transformers import XLMRobertaTokenizer

    rng = random.Random(0)
    sentences = [" ".join(rng.choices(WORDS, k=8)) for _ in range(400)]
    sentences += ["x, y. z! 0123456789 ?'"] * 5
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=proto,
        vocab_size=72,
        model_type="unigram",
        character_coverage=1.0,
        minloglevel=2,
    )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sentencepiece.bpe.model").write_bytes(proto.getvalue())
    return XLMRobertaTokenizer.from_pretrained(str(folder))


def spread(model, seed: int) -> None:
    """Random weights wide enough that a wrong mask or pooling shows: matrices N(0, 0.08),
    LayerNorm weights 1 + N(0, 0.1), biases N(0, 0.1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    norms = {
        f"{m}.weight" if m else "weight"
        for m, mod in model.named_modules()
        if isinstance(mod, torch.nn.LayerNorm)
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name in norms:
                p.copy_(1 + 0.1 * noise)
            elif p.ndim == 1:
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.3 * noise if "embeddings" in name else 0.08 * noise)


def encoder_config(kind: str, vocab: int, **kw):
    """A tiny config: 3 heads of 16 (odd), 2 layers (ModernBERT: 4, global / local / local /
    global, a local window of ±4 positions, shorter than the inputs), a short position table."""
    from transformers import BertConfig, ModernBertConfig, NomicBertConfig, XLMRobertaConfig

    if kind == "modernbert":
        kw.pop("type_vocab_size", None)
        special = dict(bos_token_id=0, cls_token_id=0, eos_token_id=2, sep_token_id=2)
        return ModernBertConfig(
            vocab_size=vocab,
            hidden_size=48,
            num_attention_heads=3,
            num_hidden_layers=4,
            intermediate_size=40,
            max_position_embeddings=128,
            local_attention=8,
            pad_token_id=1,
            **{**special, **kw},
        )
    if kind == "nomic_bert":
        kw.pop("type_vocab_size", None)
        return NomicBertConfig(
            vocab_size=vocab,
            hidden_size=48,
            num_attention_heads=3,
            num_hidden_layers=2,
            intermediate_size=40,
            max_position_embeddings=128,
            pad_token_id=1,
            **kw,
        )

    common = dict(
        vocab_size=vocab,
        hidden_size=48,
        num_attention_heads=3,
        num_hidden_layers=2,
        intermediate_size=80,
        pad_token_id=1,
        **kw,
    )
    if kind == "bert":
        return BertConfig(max_position_embeddings=64, **common)
    # XLM-R: positions start at padding_idx + 1; one token type, unless the caller pairs texts
    # with this BERT tokenizer (its pairs have types 0 and 1)
    return XLMRobertaConfig(**{"max_position_embeddings": 66, "type_vocab_size": 1, **common})


def sentence_folder(
    folder: Path,
    kind: str,
    modes: str | tuple[str, ...],
    *,
    dense: int = 0,
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
    seed: int = 0,
    max_seq: int = MAX_SEQ,
    bpe: bool = False,
    **kw,
):
    """A SentenceTransformer of a random `kind` encoder, `modes` pooling, an optional Dense to
    `dense` dims and Normalize, saved to `folder` (`kw`: more config fields); returns the
    SentenceTransformer (float32). `bpe`: a byte-level BPE tokenizer, else WordPiece."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel

    raw = folder.parent / f"{folder.name}-raw"
    tok = byte_bpe_tokenizer(raw) if bpe else word_piece_tokenizer(raw)
    torch.manual_seed(seed)
    model = AutoModel.from_config(encoder_config(kind, len(tok), **kw))
    spread(model, seed)
    model.save_pretrained(raw)
    tok.save_pretrained(raw)
    modules = [Transformer(str(raw), max_seq_length=max_seq)]
    modules.append(Pooling(48, modes))
    if dense:
        width = 48 * (len(modes) if isinstance(modes, tuple) else 1)
        layer = Dense(width, dense)
        spread(layer, seed + 1)
        modules.append(layer)
    if normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, device="cpu", prompts=prompts)
    st.save(str(folder))
    return st.eval()


def cross_encoder_folder(
    folder: Path,
    kind: str,
    seed: int = 0,
    max_seq: int = MAX_SEQ,
    unigram: bool = False,
    bpe: bool = False,
    **kw,
):
    """A CrossEncoder (one label) of a random `kind` classifier (`kw`: more config fields),
    saved; returns it. `unigram`: XLM-R's own tokenizer (unigram_tokenizer; one token type,
    sentencepiece.bpe.model copied into the folder); `bpe`: byte_bpe_tokenizer; else the
    WordPiece one."""
    import torch
    from sentence_transformers import CrossEncoder
    from transformers import AutoModelForSequenceClassification

    raw = folder.parent / f"{folder.name}-raw"
    make = unigram_tokenizer if unigram else byte_bpe_tokenizer if bpe else word_piece_tokenizer
    tok = make(raw)
    torch.manual_seed(seed)
    types = 1 if unigram else 2
    cfg = encoder_config(kind, len(tok), num_labels=1, type_vocab_size=types, **kw)
    model = AutoModelForSequenceClassification.from_config(cfg)
    spread(model, seed)
    model.save_pretrained(raw)
    tok.save_pretrained(raw)
    ce = CrossEncoder(str(raw), max_length=max_seq, device="cpu")
    ce.save(str(folder))
    if unigram:
        shutil.copy(raw / "sentencepiece.bpe.model", folder)
    return ce
