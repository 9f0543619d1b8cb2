#!/usr/bin/env python3
"""A random-weight assistant drafter at the released E2B/E4B assistant's size, for measuring
what a draft round costs on the GPU (bench/gpu/run.sh `assistant-cost`): 4 layers (3 sliding,
1 full), hidden 256, MLP 2048, 4 query heads on the target's K/V, the centroid head (2048
clusters, the best 32 kept) over the target's vocabulary, float16 weights.

  python3 bench/gpu/random_assistant.py TARGET_CONFIG OUT_DIR [CENTROIDS TOP_K]

TARGET_CONFIG is a Gemma 4 config (e.g. configs/gemma-4-e4b.json); the drafter takes its
backbone width, vocabulary, KV heads, head dims, window and RoPE from it. The config.json is
the training script's (train/train_assistant.py, which imports torch); the weights need only
numpy, and the safetensors file is written by hand (the GPU machine has no registry).
"""

import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "train"))
from train_assistant import FULL, assistant_config, layer_kinds  # noqa: E402

D, FFN, HEADS, LAYERS = 256, 2048, 4, 4


def save_safetensors(path, tensors):
    """The safetensors layout: an 8-byte little-endian header length, a JSON header of
    dtype/shape/offsets, then the raw little-endian data."""
    names = {np.dtype("float16"): "F16", np.dtype("int64"): "I64"}
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {"dtype": names[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


def main():
    target = json.loads(Path(sys.argv[1]).read_text())
    t = target.get("text_config", target)
    out = Path(sys.argv[2])
    # The released head's clusters; a tiny test vocabulary needs fewer.
    centroids, top_k = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (2048, 32)
    out.mkdir(parents=True, exist_ok=True)
    kinds = layer_kinds(LAYERS)
    head_dim = {kind: t["head_dim"] for kind in kinds}
    head_dim[FULL] = t.get("global_head_dim") or t["head_dim"]
    hb, vocab = t["hidden_size"], t["vocab_size"]
    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n):
        return np.ones(n, dtype=np.float16)

    tensors = {
        "model.embed_tokens.weight": normal(vocab, D),
        "model.norm.weight": ones(D),
        "pre_projection.weight": normal(D, 2 * hb),
        "post_projection.weight": normal(hb, D),
        "masked_embedding.centroids.weight": normal(centroids, D),
        "masked_embedding.token_ordering": rng.permutation(vocab).astype(np.int64),
    }
    for i, kind in enumerate(kinds):
        p, hd = f"model.layers.{i}.", head_dim[kind]
        tensors.update({
            p + "input_layernorm.weight": ones(D),
            p + "self_attn.q_proj.weight": normal(HEADS * hd, D),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.o_proj.weight": normal(D, HEADS * hd),
            p + "post_attention_layernorm.weight": ones(D),
            p + "pre_feedforward_layernorm.weight": ones(D),
            p + "mlp.gate_proj.weight": normal(FFN, D),
            p + "mlp.up_proj.weight": normal(FFN, D),
            p + "mlp.down_proj.weight": normal(D, FFN),
            p + "post_feedforward_layernorm.weight": ones(D),
            p + "layer_scalar": ones(1),
        })
    save_safetensors(out / "model.safetensors", tensors)
    # The released centroid head and float16 weights; the rest as the trainer writes it.
    config = assistant_config(t, D, HEADS, FFN, LAYERS)
    config.update({"use_ordered_embeddings": True, "num_centroids": centroids,
                   "centroid_intermediate_top_k": top_k, "dtype": "float16"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    params = sum(a.size for n, a in tensors.items() if a.dtype == np.float16)
    print(f"random assistant: {params:,} parameters in {out}")


if __name__ == "__main__":
    main()
