//! The `deepspec` drafter: DeepSeek's DeepSpec block drafters (`Gemma4DSparkModel`) — DSpark
//! (Markov and confidence heads) and DeepSpec's DFlash (the same class with both heads off).
//!
//! One forward over `[anchor, mask, ..., mask]` drafts a whole block of B tokens from the
//! context: hidden states tapped inside the target at every verified position, projected once
//! into each draft layer's keys and values. The drafter carries its own frozen embedding and
//! LM head. The math follows `block-drafters.md` §1 of the reference notes.
//!
//! Modules, in the order of a round:
//! * [`settings`], [`config`]: the plugin's keys and the checkpoint's `config.json`;
//! * [`linear`], [`rope`], [`layer`]: the draft layers;
//! * [`model`]: the context, the block forward, the Markov and confidence heads;
//! * [`session`]: pairing with the target and the plugin's entry points.

pub mod config;
pub mod layer;
pub mod linear;
pub mod model;
pub mod rope;
pub mod session;
pub mod settings;

pub use model::{
    confident_prefix, Block, BlockOutput, Choice, Context, DSparkModel, NoPorts, TargetPorts,
    Vocabulary,
};
pub use session::{DeepSpecDrafter, DeepSpecSession};

mlx_spec_plugin_api::declare_drafter_plugin!("deepspec", DeepSpecDrafter);
