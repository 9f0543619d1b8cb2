//! MLX arrays on the plugin boundary.
//!
//! Host and plugins share one libmlx in the process, so an array crosses as its mlx-c handle
//! (one pointer to a heap `mlx::core::array`). Two wrappers make ownership explicit:
//!
//! * [`Tensor`] is **owned**: exactly one owner, and dropping it frees the handle. Values a
//!   callee returns cross as `Tensor` (ownership moves to the caller). Either side may free it:
//!   both sides' mlx-c copies were built from the same MLX headers (checked at load).
//! * [`TensorRef`] is **borrowed** for the duration of one call; the callee never frees it. To
//!   keep the array, call [`TensorRef::to_array`], which makes a new handle sharing the data.
//!
//! Arrays may be lazy in either direction: the graph lives in the one libmlx, so whichever
//! side evaluates it gets the same result.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Deref;

use abi_stable::StableAbi;
use mlx_rs::Array;

/// An owned MLX array handle (never null).
#[repr(C)]
#[derive(StableAbi)]
pub struct Tensor {
    ctx: *mut c_void,
}

// SAFETY: same contract as mlx_rs::Array, which is Send.
unsafe impl Send for Tensor {}

impl Tensor {
    /// Takes ownership of an array (no copy, no reference-count change).
    pub fn from_array(array: Array) -> Self {
        let array = ManuallyDrop::new(array);
        Tensor {
            ctx: array.as_ptr().ctx,
        }
    }

    /// Gives the handle back to mlx-rs (no copy, no reference-count change).
    pub fn into_array(self) -> Array {
        let this = ManuallyDrop::new(self);
        // SAFETY: `ctx` came from an Array we owned; ownership moves back without a free.
        unsafe { Array::from_ptr(mlx_sys::mlx_array { ctx: this.ctx }) }
    }

    /// Borrows the tensor for one call.
    pub fn borrow(&self) -> TensorRef<'_> {
        TensorRef {
            ctx: self.ctx,
            _borrow: PhantomData,
        }
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        // SAFETY: this is the handle's only owner.
        unsafe { mlx_sys::mlx_array_free(mlx_sys::mlx_array { ctx: self.ctx }) };
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor({:p})", self.ctx)
    }
}

/// A borrowed MLX array handle, valid for `'a`.
#[repr(C)]
#[derive(StableAbi, Clone, Copy)]
pub struct TensorRef<'a> {
    ctx: *mut c_void,
    _borrow: PhantomData<&'a Tensor>,
}

impl<'a> TensorRef<'a> {
    /// Lends an array for one call.
    pub fn from_array(array: &'a Array) -> Self {
        TensorRef {
            ctx: array.as_ptr().ctx,
            _borrow: PhantomData,
        }
    }

    /// Reads the borrowed array in place (never freed through the view).
    pub fn view(self) -> ArrayView<'a> {
        // SAFETY: the lender keeps the handle alive for 'a; ManuallyDrop prevents a free.
        let array = unsafe { Array::from_ptr(mlx_sys::mlx_array { ctx: self.ctx }) };
        ArrayView {
            array: ManuallyDrop::new(array),
            _borrow: PhantomData,
        }
    }

    /// A new owned handle to the same array, to keep beyond the call.
    pub fn to_array(self) -> Array {
        self.view().clone()
    }
}

/// An `&Array` view of a borrowed handle.
pub struct ArrayView<'a> {
    array: ManuallyDrop<Array>,
    _borrow: PhantomData<&'a Array>,
}

impl Deref for ArrayView<'_> {
    type Target = Array;
    fn deref(&self) -> &Array {
        &self.array
    }
}
