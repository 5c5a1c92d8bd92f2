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


def f16_exact(model) -> None:
    """Every weight rounded to a float16 value, so that a file storing it in float16 holds
    exactly the model's numbers."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())


def build_gemma3(folder: Path, seed: int = 0, exact16: bool = False, **text_kw):
    """Write the folder; returns the transformers Gemma3ForConditionalGeneration (its weights
    float16 values with `exact16`; `text_kw` over the text config)."""
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
    text.update(text_kw)
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
    if exact16:
        f16_exact(model)
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


# --- Gemma 4 ---
G4_SPECIAL = ("<|image>", "<|image|>", "<image|>", "<start_of_turn>", "<end_of_turn>")  # 3..7
G4_IMAGE = 4
# a Gemma 4 style template: each image part is one <|image|> the processor expands
G4_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|image|>{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
G4_PROCESSOR = dict(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)


def build_gemma4(
    folder: Path, bidirectional: str | None = "vision", seed: int = 0, exact16: bool = False
):
    """A tiny Gemma 4 (per-layer inputs, sliding window 8, clipped linears, standardized
    soft tokens) with its vision tower; returns the transformers model (fp32, eager)."""
    import torch
    import transformers
    from conftest import randomize
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder, extra_special=G4_SPECIAL)
    s, f = "sliding_attention", "full_attention"
    text = dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        head_dim=16,
        global_head_dim=32,
        num_key_value_heads=1,
        num_hidden_layers=4,
        layer_types=[s, f, s, f],
        sliding_window=8,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=vocab,
        vocab_size=vocab,
        max_position_embeddings=512,
        use_bidirectional_attention=bidirectional,
        pad_token_id=1,  # not the BOS (0): the placeholders are read as this id
        rope_parameters={
            s: {"rope_type": "default", "rope_theta": 10000.0},
            f: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
        },
    )
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        pooling_kernel_size=2,
        patch_size=4,
        position_embedding_size=64,
        standardize=True,
        use_clipped_linears=True,
    )
    cfg = transformers.Gemma4Config(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        boi_token_id=3,
        image_token_id=G4_IMAGE,
        eoi_token_id=5,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    with torch.no_grad():  # buffers away from their identities, so that each is read
        for name, b in model.named_buffers():
            if name.endswith("std_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
            elif name.endswith("std_scale"):
                b.copy_(1 + torch.randn_like(b) * 0.1)
            elif name.endswith(("input_min", "input_max")):
                b.fill_(-0.5 if name.endswith("min") else 0.5)
            elif name.endswith(("output_min", "output_max")):
                b.fill_(-2.0 if name.endswith("min") else 2.0)
    if exact16:
        f16_exact(model)
    model.save_pretrained(folder)
    Gemma4ImageProcessorPil(**G4_PROCESSOR).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(G4_TEMPLATE)
    return model


def gemma4_inputs(folder: Path, messages: list[dict]) -> dict:
    """transformers' inputs for `messages`: the template rendered, each <|image|> expanded by
    Gemma4Processor.replace_image_token (the processor itself needs torchvision for its
    video part), tokenized by the folder's tokenizer, pixels from Gemma4ImageProcessorPil."""
    from types import SimpleNamespace

    import jinja2
    import torch
    import transformers
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    text = jinja2.Template(G4_TEMPLATE).render(
        messages=messages, add_generation_prompt=True, bos_token="<|endoftext|>"
    )
    images = [
        p["image"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    ]
    pixels = Gemma4ImageProcessorPil(**G4_PROCESSOR)(images=images, return_tensors="pt")
    marks = SimpleNamespace(
        boi_token=G4_SPECIAL[0], image_token=G4_SPECIAL[1], eoi_token=G4_SPECIAL[2]
    )
    pieces = text.split(G4_SPECIAL[1])
    expand = transformers.Gemma4Processor.replace_image_token
    text = pieces[0] + "".join(expand(marks, pixels, k) + rest for k, rest in enumerate(pieces[1:]))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),  # else generate masks the BOS, id 0 = the pad id
        pixel_values=pixels["pixel_values"],
        image_position_ids=pixels["image_position_ids"],
        mm_token_type_ids=(ids == G4_IMAGE).long(),
    )


# --- Qwen3.5 ---
Q_SPECIAL = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")  # ids 3..5
Q_IMAGE = 5
# Qwen3.5's way of writing an image: <|vision_start|><|image_pad|><|vision_end|>
Q_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
Q_PROCESSOR = dict(
    size={"shortest_edge": 4096, "longest_edge": 65536},  # small images: 64 x 64 to 256 x 256
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)


def build_qwen3_5(folder: Path, seed: int = 0, exact16: bool = False):
    """A tiny Qwen3.5 (3 Gated DeltaNet layers, 1 gated full-attention layer with partial
    M-RoPE) with its ViT; returns the transformers model (fp32, eager)."""
    import torch
    import transformers
    from conftest import randomize
    from transformers import Qwen2VLImageProcessorPil

    folder.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(folder, extra_special=Q_SPECIAL)
    text = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=512,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=0.5,  # 16 rotary dims: 8 pairs over three streams
            mrope_section=[3, 3, 2],
            mrope_interleaved=True,
        ),
        layer_types=["linear_attention"] * 3 + ["full_attention"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=64,  # an 8 x 8 table, resampled to each grid
    )
    cfg = transformers.Qwen3_5Config(
        text_config=text,
        vision_config=vision,
        image_token_id=Q_IMAGE,
        video_token_id=Q_IMAGE + 100,
        vision_start_token_id=3,
        vision_end_token_id=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    if exact16:
        f16_exact(model)
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(**Q_PROCESSOR).save_pretrained(folder)
    (folder / "chat_template.jinja").write_text(Q_TEMPLATE)
    return model


def qwen3_5_inputs(folder: Path, messages: list[dict]) -> dict:
    """transformers' inputs for `messages`: the template rendered, each <|image_pad|> expanded
    by Qwen3VLProcessor.replace_image_token (the processor itself needs torchvision for its
    video part), tokenized by the folder's tokenizer, pixels from Qwen2VLImageProcessorPil."""
    from types import SimpleNamespace

    import jinja2
    import torch
    import transformers
    from transformers import Qwen2VLImageProcessorPil

    text = jinja2.Template(Q_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    images = [
        p["image"]
        for m in messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    ]
    pixels = Qwen2VLImageProcessorPil(**Q_PROCESSOR)(images=images, return_tensors="pt")
    me = SimpleNamespace(image_token=Q_SPECIAL[2], image_processor=SimpleNamespace(merge_size=2))
    expand = transformers.Qwen3VLProcessor.replace_image_token
    pieces = text.split(Q_SPECIAL[2])
    text = pieces[0] + "".join(expand(me, pixels, k) + rest for k, rest in enumerate(pieces[1:]))
    ids = transformers.AutoTokenizer.from_pretrained(folder)(
        text, add_special_tokens=False, return_tensors="pt"
    )["input_ids"]
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=pixels["pixel_values"],
        image_grid_thw=pixels["image_grid_thw"],
        mm_token_type_ids=(ids == Q_IMAGE).long(),
    )
