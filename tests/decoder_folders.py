"""Tiny random decoders saved the way their users save them: Qwen3-Embedding- and
EmbeddingGemma-like sentence-transformers folders built with sentence-transformers' own modules,
and a Qwen3-Reranker-like causal LM folder (tests of decoder embedders and the yes / no reranker
compare mlxlis against sentence-transformers and transformers on these)."""

from __future__ import annotations

from pathlib import Path

CORPUS = (
    "yes no yes no the a of and to in is it that for on with as this was query document "
    "passage search retrieval embedding model vector sentence text short long local server "
    "apple silicon judge whether meets requirements based instruct provided answer can only "
    "system user assistant think title none task result given web relevant passages"
).split()
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>"]
MAX_SEQ = 48


def bpe_tokenizer(folder: Path, special: list[str], template: str, **kw):
    """A byte-level BPE trained on CORPUS (so "yes" and "no" are single tokens), its
    post-processor `template` (e.g. "$A <|endoftext|>": the EOS a Qwen3-Embedding tokenizer
    appends), saved with transformers' fast tokenizer (`kw`: pad token, padding side)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = [" ".join(CORPUS[i:] + CORPUS[:i]) for i in range(len(CORPUS))]
    tk.train_from_iterator(lines * 4, trainer)
    used = [t for t in special if t in template]
    tk.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, tk.token_to_id(t)) for t in used]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, **kw)
    tok.save_pretrained(folder)
    return tok


def spread(model, seed: int, scale: float = 0.08) -> None:
    """Random weights wide enough that a wrong mask or pooling shows: matrices N(0, scale),
    norm weights moved N(0, 0.1) off their identity (1, or 0 for Gemma's x̂·(1 + w))."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=g)
            if p.ndim == 1:
                p.add_(0.1 * noise)
            else:
                p.copy_(scale * noise)


def qwen3_config(vocab: int, **kw):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=kw.pop("tie_word_embeddings", True),
        **kw,
    )


def gemma_config(vocab: int):
    """EmbeddingGemma's shape in miniature: bidirectional, a sliding layer of window 4 (the
    tests' texts are longer) then a full one."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        use_bidirectional_attention=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )


def _save(folder: Path, raw: Path, modules: list, prompts: dict[str, str] | None):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(modules=[*modules], device="cpu", prompts=prompts)
    st.save(str(folder))
    return st.eval()


def qwen3_embedding_folder(folder: Path, seed: int = 0):
    """Qwen3-Embedding in miniature: Qwen3Model, EOS appended, left padding, last-token
    pooling, Normalize, its query instruction prompt; returns the SentenceTransformer."""
    import torch
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel

    raw = folder.parent / f"{folder.name}-raw"
    tok = bpe_tokenizer(
        raw, QWEN_SPECIAL, "$A <|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
    )
    torch.manual_seed(seed)
    model = AutoModel.from_config(qwen3_config(len(tok), tie_word_embeddings=False))
    spread(model, seed)
    model.save_pretrained(raw)
    prompt = "Instruct: Given a web search query, retrieve relevant passages\nQuery:"
    modules = [Transformer(str(raw), max_seq_length=MAX_SEQ), Pooling(32, "lasttoken")]
    return _save(folder, raw, [*modules, Normalize()], {"query": prompt, "document": ""})


def embedding_gemma_folder(folder: Path, seed: int = 0):
    """EmbeddingGemma in miniature: bidirectional Gemma 3, <bos> ... <eos>, mean pooling, two
    Dense projections without bias (32 -> 96 -> 24), Normalize, its prompts."""
    import torch
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling
    from transformers import AutoModel

    raw = folder.parent / f"{folder.name}-raw"
    tok = bpe_tokenizer(raw, GEMMA_SPECIAL, "<bos> $A <eos>", pad_token="<pad>")
    torch.manual_seed(seed)
    model = AutoModel.from_config(gemma_config(len(tok)))
    spread(model, seed)
    model.save_pretrained(raw)
    up, down = Dense(32, 96, bias=False), Dense(96, 24, bias=False)
    for k, d in enumerate((up, down)):
        d.activation_function = torch.nn.Identity()
        spread(d, seed + 1 + k, 0.3)
    modules = [Transformer(str(raw), max_seq_length=MAX_SEQ), Pooling(32, "mean"), up, down]
    prompts = {"query": "task: search result | query: ", "document": "title: none | text: "}
    return _save(folder, raw, [*modules, Normalize()], prompts)


def reranker_folder(folder: Path, seed: int = 0):
    """Qwen3-Reranker in miniature: a Qwen3ForCausalLM whose vocabulary holds "yes" and "no";
    returns (the transformers model, its tokenizer)."""
    import torch
    from transformers import Qwen3ForCausalLM

    tok = bpe_tokenizer(folder, QWEN_SPECIAL, "$A", pad_token="<|endoftext|>")
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(len(tok), tie_word_embeddings=False))
    spread(model, seed, 0.2)
    model.save_pretrained(folder)
    return model.eval(), tok
