"""A tiny random multimodal Gemma 3 folder that mlxlis and transformers both load: the
transformers model (fp32, eager), a byte-level BPE tokenizer with Gemma's image and turn
markers as special tokens, Gemma 3's chat template and a 32 px image processor."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlxlis

from conftest import train_tokenizer

MARKERS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")
SPECIAL = (*MARKERS, "<start_of_turn>", "<end_of_turn>")  # ids 3..7
BOI, IMAGE, EOI = 3, 4, 5
SIDE, TOKENS = 32, 4  # image size, tokens per image (a 4 x 4 patch grid pooled by 2)
TEMPLATE = Path(mlxlis.__file__).parent / "prompt" / "templates" / "gemma.jinja"


def build_gemma3(folder: Path, seed: int = 0):
    """Write the folder; returns the transformers Gemma3ForConditionalGeneration."""
    import torch
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder, extra_special=SPECIAL)
    text = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=24,
        vocab_size=vocab,
        sliding_window=8,  # shorter than a prompt: the ring and its mask are exercised
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIDE,
        patch_size=8,
        vision_use_head=False,
    )
    cfg = transformers.Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=TOKENS,
        boi_token_index=BOI,
        image_token_index=IMAGE,
        eoi_token_index=EOI,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # the init leaves norms and projections at 0 or 1
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    Gemma3ImageProcessorPil(size={"height": SIDE, "width": SIDE}).save_pretrained(folder)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    return model


def processor(folder: Path):
    """transformers' Gemma3Processor over the folder's tokenizer and image processor."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok = transformers.AutoTokenizer.from_pretrained(
        folder,
        extra_special_tokens=dict(
            zip(("boi_token", "image_token", "eoi_token"), MARKERS, strict=True)
        ),
    )
    return transformers.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil.from_pretrained(folder),
        tokenizer=tok,
        image_seq_length=TOKENS,
        chat_template=TEMPLATE.read_text(),
    )
