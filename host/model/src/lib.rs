//! The Gemma 4 text decoder on MLX, as mlx-spec runs it: the config, one module per block
//! (attention, feed-forward, mixture of experts, per-layer embeddings, norms, RoPE), the
//! per-request KV cache, and checkpoint loading ([`weights`]).
//!
//! Every block is computed with MLX operations, and that is the whole model on every device.
//! A faster way to run a forward on one device plugs in through one boundary,
//! [`gemma4::FastPath`]; mlx-spec's fused CUDA kernels (the `mlx-spec-kernels` crate) are
//! one, and this crate knows nothing else of them.
//!
//! What it is not: a generation loop, a sampler, a tokenizer or a CLI (those are the
//! `mlx-spec` host's), and not tied to the drafter plugin interface, so the host and a plugin
//! can both run the same Gemma 4.

pub mod device;
pub mod gemma4;
pub mod graph;
pub mod weights;
