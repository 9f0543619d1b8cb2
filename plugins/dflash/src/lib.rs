//! The `dflash` drafter: z-lab's DFlash block drafter (`DFlashDraftModel`) as published.
//!
//! One forward over `[anchor, mask, ..., mask]` drafts B-1 tokens: each mask row predicts the
//! token at its own position, from the context (hidden states tapped inside the target at
//! every verified position, projected once into each draft layer's keys and values) and the
//! block itself. The drafter owns no embedding and no LM head: it reads the target's through
//! the host's ports. The math follows `block-drafters.md` §3 of the reference notes.
//!
//! Modules, in the order of a round:
//! * [`settings`], [`config`]: the plugin's keys and the checkpoint's `config.json`;
//! * [`linear`], [`rope`], [`layer`]: the draft layers;
//! * [`model`]: the context, the block forward, the choice of the tokens;
//! * [`session`]: pairing with the target and the plugin's entry points.

pub mod config;
pub mod layer;
pub mod linear;
pub mod model;
pub mod rope;
pub mod session;
pub mod settings;

pub use config::{default_target_layer_ids, Activation, DFlashConfig};
pub use model::{Block, BlockOutput, Choice, Context, DFlashModel, TargetPorts};
pub use session::{DFlashDrafter, DFlashSession};

mlx_spec_plugin_api::declare_drafter_plugin!("dflash", DFlashDrafter);
