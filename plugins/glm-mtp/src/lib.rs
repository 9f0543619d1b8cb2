//! The `glm-mtp` drafter: a GLM-4.5 / DeepSeek-V3-style multi-token-prediction row.
//!
//! One extra decoder layer, stored as "layer N" of a GLM checkpoint (`model.layers.{N}.*`),
//! that reads the target's final-norm hidden state at position i and the target's embedding
//! of the token at i + 1, and predicts the token at i + 2 through the target's own LM head.
//! It keeps its own one-layer K/V cache; chained steps feed it its own output.
//! The math follows `mtp.md` of the reference notes (§2).
//!
//! Modules, in the order of a step:
//! * [`settings`], [`config`]: the plugin's keys and the checkpoint's `config.json`;
//! * [`linear`]: float matrices with optional bias, and the loader;
//! * [`rope`]: GLM's partial rotate-half RoPE;
//! * [`cache`]: the row's own K/V;
//! * [`attention`], [`mlp`]: the decoder block's halves (dense or routed experts);
//! * [`row`]: one row end to end;
//! * [`rounds`]: which rows exist, which wait, and a round's chained steps;
//! * [`session`]: pairing with the target and the plugin's entry points.

pub mod attention;
pub mod cache;
pub mod config;
pub mod linear;
pub mod mlp;
pub mod rope;
pub mod rounds;
pub mod row;
pub mod session;
pub mod settings;

pub use rounds::{Choice, Drafts, Rounds, Step, TargetPorts};
pub use row::{MtpRow, RowOutput};
pub use session::{MtpDrafter, MtpSession};

mlx_spec_plugin_api::declare_drafter_plugin!("glm-mtp", MtpDrafter);
