"""Voxtral's prompts against VoxtralProcessor with mistral_common, the reference the test suite
cannot import (mistral-common pins numpy < 2.4 on Python ≤ 3.12, below the project's numpy).

usage: pip install --target /tmp/mc "mistral-common[audio]"   # its own folder, not the venv
       PYTHONPATH=/tmp/mc-only:. python scripts/voxtral_processor_check.py [RATE] [stereo]
       (/tmp/mc-only: links to /tmp/mc's mistral_common, pydantic_extra_types, pycountry and
       their .dist-info folders, so that the venv's numpy stays the one imported)

A tiny random Voxtral (tests/test_voxtral.py's spec: 2 s chunks, 25 soft tokens each) with a
tekken.json whose special tokens sit at Voxtral's ranks ([AUDIO] 24, [BEGIN_AUDIO] 25,
[TRANSCRIBE] 34) and whose audio section says 2 s chunks at 12.5 tokens a second. Prints
whether mlxlis's transcription request (with and without a language) and chat prompt (a clip
and a question) are the processor's ids, and how far the features and the chat logits are
from the processor's and transformers'. The processor re-encodes a file as 16-bit PCM before
it reads it: compare features on 16 kHz mono PCM_16 input (the default), where that is lossless.
"""

from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests")]
ROOT = Path("/tmp/mlxlis-voxtral-processor")
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]"
    "{% for p in m.content %}{% if p.type == 'audio' %}[AUDIO]"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}[/INST]{% endif %}"
    "{% endfor %}"
)
N_SPECIAL = 50
PROCESSOR = {"pad_to_multiple_of": 32000, "max_source_positions": 200}  # 2 s chunks


def tekken(folder: Path) -> int:
    """A tekken.json with Voxtral's special ranks; returns the vocabulary size."""
    from conftest import train_tokenizer
    from mistral_common.tokens.tokenizers.base import SpecialTokens
    from test_tekken import PATTERN, TEXTS, gpt2_bytes

    bpe = ROOT / "bpe"
    train_tokenizer(bpe, 600, corpus=tuple(TEXTS) * 3)
    merges = json.loads((bpe / "tokenizer.json").read_text())["model"]["merges"]
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(gpt2_bytes(a) + gpt2_bytes(b), len(ranks))
    enum = [t.value for t in SpecialTokens]
    names = dict(enumerate(enum[:22]))
    names.update({24: "[AUDIO]", 25: "[BEGIN_AUDIO]", 34: "[TRANSCRIBE]"})
    rest = [v for v in enum if v not in names.values()]
    names.update({35 + i: v for i, v in enumerate(rest)})
    specials = [names.get(i, f"<SPECIAL_{i}>") for i in range(N_SPECIAL)]
    vocab = sorted(ranks.items(), key=lambda kv: kv[1])
    config = {
        "pattern": PATTERN,
        "default_vocab_size": N_SPECIAL + len(vocab),
        "default_num_special_tokens": N_SPECIAL,
        "version": "v7",
    }
    audio = {
        "sampling_rate": 16000,
        "frame_rate": 12.5,
        "chunk_length_s": 2.0,
        "audio_encoding_config": {"num_mel_bins": 128, "hop_length": 160, "window_size": 400},
    }
    body = {
        "config": config,
        "vocab": [
            {"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None}
            for t, r in vocab
        ],
        "special_tokens": [
            {"rank": i, "token_str": s, "is_control": True} for i, s in enumerate(specials)
        ],
        "audio": audio,
    }
    (folder / "tekken.json").write_text(json.dumps(body))
    return N_SPECIAL + len(vocab)


def main() -> int:
    import mlxlis

    from conftest import randomize
    from test_audio import encoded, signal
    from test_voxtral import SPECS
    from transformers import (
        VoxtralConfig,
        VoxtralForConditionalGeneration,
        VoxtralProcessor,
        WhisperFeatureExtractor,
    )
    from transformers.tokenization_mistral_common import MistralCommonBackend

    rate = int(sys.argv[1]) if len(sys.argv) > 1 else 16000
    mono = "stereo" not in sys.argv[2:]
    shutil.rmtree(ROOT, ignore_errors=True)
    folder = ROOT / "model"
    folder.mkdir(parents=True)
    vocab = tekken(folder)
    spec = SPECS["voxtral"]
    text = {**spec["text_config"], "vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2}
    cfg = VoxtralConfig(audio_config=spec["audio_config"], text_config=text, audio_token_id=24)
    torch.manual_seed(0)
    ref = VoxtralForConditionalGeneration(cfg).eval()
    randomize(ref, 1)
    ref.save_pretrained(folder)
    extractor = WhisperFeatureExtractor(feature_size=128, chunk_length=2)
    extractor.save_pretrained(folder)
    (ROOT / "template.jinja").write_text(TEMPLATE)
    processor = VoxtralProcessor(
        feature_extractor=extractor,
        tokenizer=MistralCommonBackend(tokenizer_path=str(folder / "tekken.json")),
    )
    wav = ROOT / "said.wav"
    x = signal("chirp", rate, 4.7)
    if not mono:
        x = np.stack([x, signal("tone", rate, 4.7)], axis=1)
    wav.write_bytes(encoded(x, rate, "WAV", "PCM_16"))
    pad = processor.tokenizer.pad_token_id
    model = mlxlis.load(folder, "float32", chat_template=str(ROOT / "template.jinja"))
    clip = model.hearing.prepare_audio(str(wav), "file", "said.wav")
    for language in ("en", None):
        want = processor.apply_transcription_request(
            audio=str(wav), model_id="voxtral", language=language, **PROCESSOR
        )
        ids = [t for t in want["input_ids"][0].tolist() if t != pad]  # its batch padding
        same = ids == model.hearing.transcription(clip, language)
        gap = float(np.abs(want["input_features"].numpy() - clip.pixels).max())
        print(f"transcription ({language}): ids equal {same}; features max |Δ| {gap:.3g}")
    parts = [{"type": "audio", "path": str(wav)}, {"type": "text", "text": "what is said?"}]
    want = processor.apply_chat_template(
        [{"role": "user", "content": parts}],
        tokenize=True,
        return_dict=True,
        processor_kwargs=PROCESSOR,
    )
    ours = [{"type": "audio", "audio": str(wav)}, {"type": "text", "text": "what is said?"}]
    prompt = model.encode_chat([{"role": "user", "content": ours}])
    print(f"chat: ids equal {want['input_ids'][0].tolist() == prompt.ids}")
    with torch.no_grad():
        logits = ref(input_ids=want["input_ids"], input_features=want["input_features"])
    logits = logits.logits[0].numpy()
    mine = np.array(model.logits(prompt.ids, prompt.images))
    gap = np.abs(mine - logits).max() / np.abs(logits).max()
    print(f"chat logits: max |Δ| / max |logit| {gap:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
