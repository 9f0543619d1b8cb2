//! The `assistant` drafter: Google's Gemma 4 "-assistant" checkpoints
//! (`Gemma4AssistantForCausalLM`, and the 12B's `Gemma4UnifiedAssistantForCausalLM`).
//!
//! A 4-layer stack that runs every draft step of a round at one fixed position, attends only
//! to the target's own K/V (it has no key/value projections and no cache), and is fed the
//! target's scaled embedding of the last token next to a hidden state: the target's final-norm
//! hidden for the first step, its own projected output afterwards.
//!
//! Modules, in the order of a step:
//! * [`settings`]: the plugin's configuration keys;
//! * [`checkpoint`], [`config`], [`linear`]: reading the released format (dense, bf16,
//!   mlx-community affine 4/8-bit);
//! * [`rope`]: the query's RoPE, equal to the target's;
//! * [`attention`]: one query over the donor K/V, scale 1.0;
//! * [`layer`]: one decoder layer;
//! * [`head`]: the dense tied head and the centroid head;
//! * [`model`]: the whole step and the greedy chain of a round;
//! * [`session`]: pairing with the target, what is read from the host and when.

pub mod attention;
/// The SDK's safetensors reader, under the name this crate's modules and tests use.
pub use mlx_spec_plugin_api::checkpoint;
pub mod config;
pub mod head;
pub mod layer;
pub mod linear;
pub mod model;
pub mod rope;
pub mod session;
pub mod settings;

pub use model::{AssistantModel, Choice, Drafts, Round, StepOutput};
pub use session::{AssistantDrafter, AssistantSession};

mlx_spec_plugin_api::declare_drafter_plugin!("assistant", AssistantDrafter);
