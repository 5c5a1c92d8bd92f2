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
