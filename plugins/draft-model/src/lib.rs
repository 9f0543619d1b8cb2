//! The `draft-model` drafter: a smaller Gemma 4 of the same tokenizer drafts for a larger one
//! (vLLM's `draft_model`, llama.cpp's `-md`, mlx-lm's `--draft-model`).
//!
//! The draft model runs through `mlx-spec-model`, the same Gemma 4 implementation the host
//! runs its target with: one model implementation, checked against transformers once, serves
//! both. It keeps its own KV cache and rolls it back to the accepted prefix each round.
//!
//! * [`settings`]: the plugin's keys;
//! * [`session`]: loading, the pairing check, the rounds.

pub mod session;
pub mod settings;

pub use session::{DraftModelDrafter, DraftModelSession};

mlx_spec_plugin_api::declare_drafter_plugin!("draft-model", DraftModelDrafter);
