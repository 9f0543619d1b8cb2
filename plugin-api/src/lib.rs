//! # mlx-spec plugin SDK
//!
//! Everything a drafter plugin needs: implement [`Drafter`] and [`DrafterSession`], export
//! them with [`declare_drafter_plugin!`], build the crate as a `cdylib`, and ship the library
//! next to a `plugin.toml` manifest. See this crate's README for a walk-through.
//!
//! Layers:
//! * [`tensor`]: MLX arrays on the boundary and their ownership rules.
//! * [`abi`]: the stable-ABI types and the root module (what the host loads and checks).
//! * [`sdk`]: plain-Rust traits and the panic-catching adapters.
//! * [`manifest`]: the `plugin.toml` schema, shared with the host.
//! * [`target_spec`]: the target's description a drafter checks its pairing against.
//! * [`checkpoint`]: a checked safetensors reader for drafters that load their own weights.
//! * [`quant`]: affine-quantized matrices in MLX's layout (`mlx-spec quantize-drafter`'s output).

pub mod abi;
pub mod checkpoint;
pub mod manifest;
pub mod quant;
pub mod sdk;
pub mod settings;
pub mod target_spec;
pub mod tensor;

pub use abi::{PrefillMode, SamplingInfo, TargetInfo, INTERFACE_REVISION, INTERFACE_VERSION};
pub use abi_stable;
pub use mlx_rs;
pub use sdk::{draft_key, DonorKv, Drafter, DrafterSession, Proposal, Taps, Target};
pub use serde_json;
pub use settings::parse_settings;
pub use target_spec::{LayerKind, TargetSpec};

/// Major version of the plugin ABI: changes of meaning that layout checks cannot see (the
/// ownership rules, what an argument means) bump it. Host and plugin must agree exactly.
pub const ABI_MAJOR: u32 = 1;

/// MLX version of the headers this build's mlx-c was compiled against.
pub const MLX_HEADERS: &str = env!("MLX_SPEC_MLX_HEADERS");

/// Exports a [`Drafter`] type as this library's plugin.
///
/// ```ignore
/// mlx_spec_plugin_api::declare_drafter_plugin!("ngram", NgramDrafter);
/// ```
///
/// The crate must be a `cdylib` and depend on `abi_stable` (the root-module attribute refers
/// to it by name). The macro also defines `mach_approximate_time`, which mlx-rs references on
/// every platform and which a plugin cannot borrow from the host executable.
#[macro_export]
macro_rules! declare_drafter_plugin {
    ($name:literal, $drafter:ty) => {
        #[cfg(not(target_vendor = "apple"))]
        #[no_mangle]
        pub extern "C" fn mach_approximate_time() -> u64 {
            $crate::sdk::now_nanos()
        }

        #[::abi_stable::export_root_module]
        fn __mlx_spec_plugin_root() -> $crate::abi::PluginModuleRef {
            use ::abi_stable::prefix_type::PrefixTypeTrait;
            $crate::abi::PluginModule {
                abi_major: $crate::ABI_MAJOR,
                mlx_headers: ::abi_stable::std_types::RStr::from_str($crate::MLX_HEADERS),
                name: ::abi_stable::std_types::RStr::from_str($name),
                version: ::abi_stable::std_types::RStr::from_str(env!("CARGO_PKG_VERSION")),
                new_provider: __mlx_spec_new_provider,
            }
            .leak_into_prefix()
        }

        /// The interface revision whose types the root module has (`abi::REVISION_SYMBOL`).
        #[no_mangle]
        #[allow(non_upper_case_globals)]
        pub static mlx_spec_interface_revision: u32 = $crate::INTERFACE_REVISION;

        #[::abi_stable::sabi_extern_fn]
        fn __mlx_spec_new_provider(
            config: ::abi_stable::std_types::RStr<'_>,
            plugin_dir: ::abi_stable::std_types::RStr<'_>,
        ) -> ::abi_stable::std_types::RResult<
            $crate::abi::DraftProviderBox,
            ::abi_stable::std_types::RString,
        > {
            let dir = plugin_dir.as_str();
            $crate::sdk::new_provider::<$drafter>(
                config.as_str(),
                (!dir.is_empty()).then(|| ::std::path::Path::new(dir)),
            )
        }
    };
}
