"""Gemma 3n's audio tower and embedder against transformers' Gemma3nAudioEncoder and
Gemma3nMultimodalEmbedder (tiny random configs built here, every weight perturbed from its
initial value), on log-mels of audio made in the test, in float32."""

from __future__ import annotations

from mlxlis.models.gemma3n_audio import AudioConfig, Gemma3nAudio
from mlxlis.prompt.audio import Gemma3nAudioFeatures

import mlx.core as mx
import numpy as np
import pytest
import torch
from test_audio import signal

TINY = dict(
    hidden_size=32,
    input_feat_size=128,
    conf_num_attention_heads=4,
    conf_num_hidden_layers=2,
    conf_attention_chunk_size=4,
    conf_attention_context_left=6,
    conf_attention_context_right=0,
    conf_attention_logit_cap=5.0,
    conf_reduction_factor=4,
    sscp_conv_channel_size=[8, 4],
    vocab_size=8,
    vocab_offset=500,
)
SPECS = {
    "causal": TINY,
    "lookahead": {**TINY, "conf_attention_context_right": 3, "conf_attention_chunk_size": 5},
}


def reference(spec: dict, seed: int = 0):
    """transformers' encoder and embedder with every parameter moved off its init."""
    from transformers import Gemma3nAudioConfig, Gemma3nTextConfig
    from transformers.models.gemma3n.modeling_gemma3n import (
        Gemma3nAudioEncoder,
        Gemma3nMultimodalEmbedder,
    )

    torch.manual_seed(seed)
    cfg = Gemma3nAudioConfig(**spec)
    text = Gemma3nTextConfig(hidden_size=48, vocab_size=512)
    enc, emb = Gemma3nAudioEncoder(cfg).eval(), Gemma3nMultimodalEmbedder(cfg, text).eval()
    with torch.no_grad():
        for p in [*enc.parameters(), *emb.parameters()]:
            p.add_(0.3 * torch.randn_like(p))
    return cfg, enc, emb


def ours(cfg, enc, emb) -> Gemma3nAudio:
    net = Gemma3nAudio(AudioConfig.from_hf(cfg.to_dict(), "config.json"), 48, pad_id=511)
    weights = {f"audio_tower.{k}": v for k, v in enc.state_dict().items()}
    weights |= {f"embed_audio.{k}": v for k, v in emb.state_dict().items()}
    weights = {k: mx.array(v.numpy()) for k, v in weights.items() if "inv_timescales" not in k}
    net.load_weights(list(Gemma3nAudio.sanitize(weights).items()), strict=True)
    return net


@pytest.mark.parametrize("name", SPECS)
def test_tower_and_embedder_match_transformers(name):
    """Proves the subsampling convolutions, the cumulative group norm, the chunked local
    attention (its relative positions, softcap, left / right context and padding keys), the
    light convolution, the reduction and the soft-token embedder equal transformers' within
    1e-4 on a batch of a 2.3 s chirp and a 0.9 s tone (the second padded by the extractor,
    so masked frames are exercised); the validity mask is the reference's."""
    from transformers import Gemma3nAudioFeatureExtractor

    cfg, enc, emb = reference(SPECS[name])
    waves = [signal("chirp", 16000, 2.3), signal("tone", 16000, 0.9)]
    feats = Gemma3nAudioFeatureExtractor()(waves, return_tensors="np")
    mels, valid = feats["input_features"], feats["input_features_mask"]
    with torch.no_grad():
        out = enc(torch.from_numpy(mels), ~torch.from_numpy(valid))
        want = out.last_hidden_state.numpy()
        want_soft = emb(inputs_embeds=out.last_hidden_state).numpy()
    net = ours(cfg, enc, emb)
    h, keep = net.audio_tower(mx.array(mels), mx.array(valid))
    np.testing.assert_array_equal(np.array(keep), ~out.audio_mel_mask.numpy())
    assert not np.array(keep)[1].all()  # the tone's window is partly padding
    scale = np.abs(want).max()
    np.testing.assert_allclose(np.array(h), want, rtol=0, atol=1e-4 * scale)
    soft = np.array(net.embed_audio.soft(h))
    np.testing.assert_allclose(soft[np.array(keep)], want_soft[np.array(keep)], rtol=0, atol=1e-4)
    with torch.no_grad():
        hard = emb(input_ids=torch.tensor([[502, 507]])).numpy()
    np.testing.assert_allclose(
        np.array(net.embed_audio.hard(mx.array([[502, 507]]))), hard, rtol=0, atol=1e-5
    )


def test_features_of_our_extractor_through_the_tower():
    """Proves the tower output on mlxlis' own features (one window) equals the reference's on
    transformers' features of the same samples."""
    from transformers import Gemma3nAudioFeatureExtractor

    cfg, enc, emb = reference(TINY, seed=1)
    wave = signal("noise", 16000, 1.7)
    mels, valid = Gemma3nAudioFeatures()(wave)
    ref = Gemma3nAudioFeatureExtractor()(wave, return_tensors="pt")
    with torch.no_grad():
        want = enc(ref["input_features"], ~ref["input_features_mask"]).last_hidden_state.numpy()
    h, _ = ours(cfg, enc, emb).audio_tower(mx.array(mels)[None], mx.array(valid)[None])
    np.testing.assert_allclose(np.array(h), want, rtol=0, atol=1e-4 * np.abs(want).max())


def build_wrapped(folder, monkeypatch, seed: int = 0, vocab: int | None = None):
    """A tiny random Gemma3nForConditionalGeneration written by transformers: a gemma3n text
    model (4 AltUp streams, KV sharing, per-layer inputs), the tiny audio tower, and the text
    vocabulary's last ids the vision and audio ranges as on the hub (the vision tower, a timm
    network, left empty: nothing here reads images). Returns (model, config)."""
    import transformers.models.gemma3n.modeling_gemma3n as modeling
    from conftest import randomize, train_tokenizer
    from transformers import Gemma3nConfig, Gemma3nForConditionalGeneration

    if vocab is None:  # the ids of the three audio tokens: the last two and a text id
        vocab = train_tokenizer(folder)
    real = modeling.AutoModel.from_config

    def towers(config, **kw):
        if config.model_type == "gemma3n_vision":
            return torch.nn.Module()
        return real(config, **kw)

    monkeypatch.setattr(modeling.AutoModel, "from_config", towers)
    text = dict(
        vocab_size=vocab,
        vocab_size_per_layer_input=vocab - 3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=4,
        intermediate_size=96,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        altup_num_inputs=4,
        activation_sparsity_pattern=[0.9, 0.0, 0.0, 0.0],
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    cfg = Gemma3nConfig(
        text_config=text,
        audio_config={**TINY, "vocab_size": 2, "vocab_offset": vocab - 2},
        vision_config={"vocab_size": 1, "vocab_offset": vocab - 3},
        boa_token_id=3,
        eoa_token_id=vocab - 2,
        audio_token_id=vocab - 1,
    )
    cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Gemma3nForConditionalGeneration(cfg).eval()
    randomize(model, seed)
    model.save_pretrained(folder)
    return model, cfg


def test_logits_after_audio_match_transformers(tmp_path, monkeypatch):
    """Proves the whole path in float32: transformers' Gemma3nForConditionalGeneration on ids
    holding boa + 188 audio placeholders + eoa (the processor's expansion) and a 2.1 s chirp's
    features, against mlxlis' text model with the audio soft tokens (padded to 188 with the
    audio vocabulary's last embedding) and the eoa token's audio-vocabulary embedding put in
    place: every position's logits within 1e-4 (relative to their scale)."""
    import mlxlis
    from mlxlis.models.gemma3n_audio import load_gemma3n_audio
    from mlxlis.models.multimodal import Inserts

    from transformers import Gemma3nAudioFeatureExtractor

    ref, cfg = build_wrapped(tmp_path, monkeypatch)
    wave = signal("chirp", 16000, 2.1)
    feats = Gemma3nAudioFeatureExtractor()(wave, return_tensors="pt")
    run = [cfg.boa_token_id] + [cfg.audio_token_id] * 188 + [cfg.eoa_token_id]
    ids = [0, 17, 40, 9, 33] + run + [60, 12, 77, 3]
    with torch.no_grad():
        want = (
            ref(
                input_ids=torch.tensor([ids]),
                input_features=feats["input_features"],
                input_features_mask=feats["input_features_mask"],
            )
            .logits[0]
            .numpy()
        )
    model = mlxlis.load(tmp_path, "float32")
    audio = load_gemma3n_audio(tmp_path, mx.float32)
    mels, valid = Gemma3nAudioFeatures()(wave)
    soft = audio(mx.array(mels)[None], mx.array(valid)[None])[0]  # (188, hidden)
    eoa = audio.embed_audio.hard(mx.array([cfg.eoa_token_id]))
    start = ids.index(cfg.audio_token_id)
    inserts = Inserts([(start, mx.concatenate([soft, eoa]))], fill=0, bidirectional=False)
    got = np.array(model.net(mx.array([ids]), inserts=inserts)[0])
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
