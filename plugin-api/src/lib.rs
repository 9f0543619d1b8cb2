//! The mlx-spec drafter SDK. The plugin ABI lands with the plugin issue; this crate already
//! reserves the name and version that plugins will build against.

/// Major version of the plugin ABI. A host refuses plugins built for another major.
pub const PLUGIN_ABI_MAJOR: u32 = 1;
