//! What the model asks of MLX's device: which one runs the next operations, and which libmlx
//! this process loaded. Choosing the device is the host's.

use std::ffi::CStr;

use mlx_rs::{Device, DeviceType};

/// Whether MLX's default device, where the next operations will run, is of this type.
pub fn default_is(kind: DeviceType) -> bool {
    Device::default()
        .get_type()
        .is_ok_and(|t| t as u32 == kind as u32)
}

/// The version string of the libmlx this process loaded (e.g. `0.32.2`).
pub fn mlx_version() -> String {
    // SAFETY: mlx_string is created, read and freed here; mlx_version only writes into it.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let out = if mlx_sys::mlx_version(&mut s) == 0 {
            CStr::from_ptr(mlx_sys::mlx_string_data(s))
                .to_string_lossy()
                .into_owned()
        } else {
            "unknown".to_owned()
        };
        mlx_sys::mlx_string_free(s);
        out
    }
}
