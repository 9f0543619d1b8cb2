//! A plugin that claims its mlx-c was built against other MLX headers; the host must refuse it by name. Its root module is written by hand
//! (not with the SDK macro) precisely so it can lie; it has the revision-1 root module, as a
//! library that exports no revision does.

use abi_stable::prefix_type::PrefixTypeTrait;
use abi_stable::std_types::{RErr, RResult, RStr, RString};
use abi_stable::{export_root_module, sabi_extern_fn};
use mlx_spec_plugin_api::abi::r1::{DraftProviderBox, PluginModule, PluginModuleRef};
use mlx_spec_plugin_api::{ABI_MAJOR, MLX_HEADERS};

#[no_mangle]
pub extern "C" fn mach_approximate_time() -> u64 {
    mlx_spec_plugin_api::sdk::now_nanos()
}

#[export_root_module]
fn root() -> PluginModuleRef {
    let _ = MLX_HEADERS;
    PluginModule {
        abi_major: ABI_MAJOR,
        mlx_headers: RStr::from_str("0.0.1"),
        name: RStr::from_str("bad-mlx"),
        version: RStr::from_str("0.1.0"),
        new_provider,
    }
    .leak_into_prefix()
}

#[sabi_extern_fn]
fn new_provider(_config: RStr<'_>) -> RResult<DraftProviderBox, RString> {
    RErr(RString::from(
        "never reached: the host refuses this library",
    ))
}
