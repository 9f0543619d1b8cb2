//! Fused CUDA kernels for the decode path, run through MLX's custom-kernel API: mlx-spec's
//! fast path for Gemma 4 on a CUDA GPU ([`CudaDecode`], an implementation of the model's
//! `FastPath` boundary in the `mlx-spec-model` crate).
//!
//! What it is not: the model. Gemma 4's math, over MLX operations on every device, is the
//! `mlx-spec-model` crate's, and what the kernels compute is checked against it; this crate
//! only runs parts of a forward faster where MLX's default device is a CUDA GPU. Choosing the
//! device and the kernel set is the host's (`mlx_spec::load`).
//!
//! Why they exist: on CUDA, MLX spends host time on every operation of a step (walking the
//! graph, allocating, encoding a graph node), and a Gemma 4 decode step was ~2 000 small
//! operations whose host cost, not the weights, bounded the step (BENCHMARKS.md). Each kernel
//! here replaces a chain of MLX operations with one:
//! * [`attention_heads`]: a decode token's input RMSNorm, q/k/v products, head norms and RoPE,
//!   and the write of its key and value into the cache, in one launch (with both kernel sets);
//! * [`products`]: the other matrix-vector products with the norms, gates and residual updates
//!   around them (norm + gate/up + GELU, product + post-norm + residual, the per-layer-input
//!   gate); runs with `products`;
//! * [`attention_inputs`]: q/k RMSNorm + RoPE and the v RMSNorm of one token, where the
//!   products are MLX's (`attention` alone, or quantized weights);
//! * [`decode_attention`]: one query token over a layer's whole K/V buffers and its visible
//!   slots (scores, mask, softmax, weighted sum, the merge of the blocks' shares);
//! * [`output_head`]: the final norm, the output head's product and the logit soft-cap of a
//!   decode token (`output-head`);
//! * [`window_post_attention`]: the same for a window of 2-8 tokens (a verify window, a short
//!   prompt), each weight row read once for all of them, each token's result equal to the
//!   single-token kernel's (`window`; dense or 4-bit weights, as are the window kernels of
//!   the heads and the output head);
//! * [`post_attention`]: everything of a layer after its attention heads (the output product,
//!   the feed-forward and per-layer-input blocks) as one kernel with grid-wide barriers, over
//!   dense weights (`post-attention`) or 4-bit ones (`affine4`); the default for both, as it
//!   keeps its rate on hosts too slow for the five launches of [`products`] it replaces
//!   (which remain for layers it does not serve).
//!
//! An E4B decode step is about 140 operations with the default set. Their source text reaches MLX as
//! `#include` lines of files ([`source_files`]), because MLX handles a custom kernel's whole
//! source at every call.
//!
//! They compute what the MLX operations compute, with the same roundings to the activation
//! dtype at the same places, so a CUDA step matches the CPU one (checked by `bench/gpu/run.sh`:
//! greedy tokens of every fixture against transformers, and the E4B shape against the CPU).
//! They run only where MLX's default device is a CUDA GPU; the CPU and Metal use the plain
//! operations. `--fused-kernels none` runs none of them, for comparison.

pub mod affine4;
pub mod attention_heads;
pub mod attention_inputs;
pub mod cuda;
pub mod decode_attention;
mod decode_path;
pub mod kernel_cache;
pub mod output_head;
pub mod post_attention;
pub mod products;
pub mod source_files;
pub mod window_attention_heads;
pub mod window_output_head;
pub mod window_post_attention;
pub mod window_products;

pub use decode_path::CudaDecode;

use std::cell::RefCell;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::ffi::{CStr, CString};

use anyhow::{bail, Result};
use mlx_rs::{Array, Dtype};

/// Which fused kernels a forward uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fused {
    /// [`decode_attention`] for single-token steps.
    pub attention: bool,
    /// [`products`] for single-token steps over dense weights.
    pub products: bool,
    /// [`post_attention`] for single-token steps over dense weights, in place of the
    /// products after the attention heads.
    pub post_attention: bool,
    /// [`post_attention`] for single-token steps over 4-bit affine weights, in place of
    /// MLX's quantized products after the attention heads.
    pub affine4: bool,
    /// [`attention_heads`] for single-token steps over 4-bit affine projections, in place of
    /// MLX's quantized products before the heads.
    pub affine4_heads: bool,
    /// [`products`] for single-token steps over 4-bit affine weights, in place of MLX's
    /// quantized products.
    pub affine4_products: bool,
    /// [`output_head`] for single-token steps: the final norm, the head's product (dense or
    /// 4-bit) and the soft-cap as one kernel.
    pub output_head: bool,
    /// The window kernels ([`window_attention_heads`], [`window_post_attention`],
    /// [`window_output_head`]) for windows of 2-8 tokens over dense or 4-bit weights, and
    /// [`window_products`] for dense layers too wide for the post-attention kernel, in place
    /// of MLX's operations.
    pub window: bool,
}

impl Fused {
    /// Every kernel allowed: the default set.
    pub fn every() -> Fused {
        Fused {
            attention: true,
            products: true,
            post_attention: true,
            affine4: true,
            affine4_heads: true,
            affine4_products: true,
            output_head: true,
            window: true,
        }
    }
}

/// Whether mlx-spec's kernels can run here: a Linux build (MLX's GPU backend there is CUDA)
/// whose MLX default device is the GPU.
pub fn on_cuda_gpu() -> bool {
    cfg!(target_os = "linux") && mlx_spec_model::device::default_is(mlx_rs::DeviceType::Gpu)
}

thread_local! {
    // The small integer arrays of the current step (see `step_ints`), newest last.
    // Entries: the values, the array.
    static STEP_INTS: RefCell<Vec<(Vec<i32>, Array)>> = const { RefCell::new(Vec::new()) };
}

/// How many distinct [`step_ints`] arrays are kept: a step asks for about five (its position,
/// and a cache slot and a visible range per kind of layer).
const STEP_INTS_KEPT: usize = 8;

/// An int32 array holding `values` (a step's position, a cache slot, a slot range), made once
/// and shared by every layer of the step that asks for the same values: one array per step
/// instead of one per layer. Made from host data, so MLX keeps it in host-visible memory
/// (kernels read such arrays once per block at most, and early).
pub(crate) fn step_ints(values: &[i32]) -> Result<Array> {
    STEP_INTS.with(|cell| {
        let mut memo = cell.borrow_mut();
        if let Some((_, a)) = memo.iter().find(|(k, _)| k.as_slice() == values) {
            return Ok(a.clone());
        }
        let a = Array::from_slice(values, &[values.len() as i32]);
        if memo.len() >= STEP_INTS_KEPT {
            memo.remove(0);
        }
        memo.push((values.to_vec(), a.clone()));
        Ok(a)
    })
}

/// A compile-time constant of a kernel's source.
pub enum TemplateArg {
    Dtype(Dtype),
    Int(i32),
    Bool(bool),
}

/// One CUDA kernel source, compiled by MLX (NVRTC) the first time each set of template
/// arguments is evaluated. Not `Send`: build one per thread.
pub struct CudaKernel {
    name: &'static str,
    raw: mlx_sys::mlx_fast_cuda_kernel,
    /// What MLX was given, kept for [`capture_kernels`].
    text: KernelText,
    /// Bytes of dynamic shared memory each block gets.
    shared_bytes: i32,
    /// Signatures (dtypes, template arguments) whose compiled module [`kernel_cache`] has
    /// seen to in this process.
    cached: RefCell<HashSet<u64>>,
}

/// A kernel's text and argument names: header and body as written (for
/// [`capture_kernels`]) and as MLX was given them (`#include` lines, for [`kernel_cache`]).
struct KernelText {
    header: String,
    source: String,
    mlx_header: String,
    mlx_source: String,
    inputs: Vec<String>,
    outputs: Vec<String>,
}

impl KernelText {
    fn new(inputs: &[&str], outputs: &[&str], source: &str, header: &str) -> Self {
        let owned = |list: &[&str]| list.iter().map(|n| n.to_string()).collect();
        KernelText {
            header: header.to_owned(),
            source: source.to_owned(),
            mlx_header: header.to_owned(),
            mlx_source: source.to_owned(),
            inputs: owned(inputs),
            outputs: owned(outputs),
        }
    }

    /// The same, with what MLX gets instead of header and body differing from them.
    fn given_to_mlx(mut self, header: &str, source: &str) -> Self {
        self.mlx_header = header.to_owned();
        self.mlx_source = source.to_owned();
        self
    }
}

/// The name and full source MLX 0.32's custom_kernel.cpp builds for a call of the kernel
/// `base` with this header, body, arguments and template arguments: its default header, then
/// ours, the signature typed by the arrays' dtypes (with shape, stride or rank arguments
/// where the body names them), the template arguments as constants, the body. Also whether
/// the signature takes such shape arguments.
fn mlx_kernel_source(
    base: &str,
    header: &str,
    body: &str,
    inputs: &[(&str, Dtype, bool)],
    outputs: &[(&str, Dtype)],
    template: &[(&CStr, TemplateArg)],
) -> (String, String, bool) {
    let mut name = format!("custom_kernel_{base}");
    let mut constants = String::new();
    for (arg, value) in template {
        let arg = arg.to_string_lossy();
        match value {
            TemplateArg::Int(v) => {
                name += &format!("_{v}");
                constants += &format!("  constexpr int {arg} = {v};\n");
            }
            TemplateArg::Bool(v) => {
                name += if *v { "_t" } else { "_f" };
                constants += &format!("  constexpr bool {arg} = {v};\n");
            }
            TemplateArg::Dtype(d) => {
                name += &format!("_{}", type_name(*d));
                constants += &format!("  using {arg} = {};\n", cuda_type(*d));
            }
        }
    }
    let mut source = String::from(
        "\n#include \"mlx/backend/cuda/device/utils.cuh\"\n\n#include <cooperative_groups.h>\n\n",
    );
    source += header;
    source += "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n";
    source += &format!("__global__ void {name}(\n");
    let mut shaped = false;
    for (n, dtype, has_dims) in inputs {
        source += &format!("    const {}* {n},\n", cuda_type(*dtype));
        if *has_dims {
            for (marker, kind) in [("_shape", "Shape"), ("_strides", "Strides")] {
                if body.contains(&format!("{n}{marker}")) {
                    source += &format!("    const __grid_constant__ {kind} {n}{marker},\n");
                    shaped = true;
                }
            }
            if body.contains(&format!("{n}_ndim")) {
                source += &format!("    const __grid_constant__ int {n}_ndim,\n");
                shaped = true;
            }
        }
    }
    let last = outputs.len().saturating_sub(1);
    for (i, (n, dtype)) in outputs.iter().enumerate() {
        source += &format!(
            "    {}* {n}{}",
            cuda_type(*dtype),
            if i < last { ",\n" } else { ") {\n" }
        );
    }
    if !constants.is_empty() {
        source += &constants;
        source += "\n";
    }
    source += body;
    source += "\n}\n\n} // namespace mlx::core::cu\n";
    (name, source, shaped)
}

/// One kernel call [`capture_kernels`] recorded instead of running: its name as MLX forms it
/// (the name, then the template arguments) and the full source MLX 0.32 would compile for
/// it, laid out as MLX lays it out (its default header, ours, the signature typed by the
/// arrays' dtypes, the template arguments as constants, the body). For compiling every kernel
/// of a step without a GPU (`bench --dump-kernel-sources`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapturedKernel {
    pub name: String,
    pub source: String,
    /// Threads per block, and blocks.
    pub block: i32,
    pub blocks: i32,
    /// Bytes of dynamic shared memory a block gets.
    pub shared_bytes: i32,
}

thread_local! {
    // Some while `capture_kernels` runs: the calls recorded so far.
    static CAPTURE: RefCell<Option<Vec<CapturedKernel>>> = const { RefCell::new(None) };
}

/// Runs `f` with every fused-kernel call recorded rather than run: the calls return zeros
/// of their outputs' shapes, the kernels of the model's fast path run off a CUDA device too,
/// and a grid-wide barrier's grid is taken as that of an H200 (132
/// multiprocessors). Nothing of what `f` builds is meant to be evaluated for its values, and
/// a kernel first made while capturing (each is made once a thread) refuses to run later:
/// this is for one-shot dumps (`bench --dump-kernel-sources`), not for a serving process.
pub fn capture_kernels<T>(f: impl FnOnce() -> Result<T>) -> Result<(T, Vec<CapturedKernel>)> {
    CAPTURE.with(|c| *c.borrow_mut() = Some(Vec::new()));
    let result = f();
    let captured = CAPTURE.with(|c| c.borrow_mut().take()).unwrap_or_default();
    Ok((result?, captured))
}

/// Whether [`capture_kernels`] is running on this thread.
pub(crate) fn capturing() -> bool {
    CAPTURE.with(|c| c.borrow().is_some())
}

/// How MLX 0.32 names `dtype` in a kernel's name.
fn type_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bfloat16 => "bfloat16_t",
        Dtype::Float16 => "float16_t",
        Dtype::Float32 => "float",
        other => cuda_type(other),
    }
}

/// The C++ type MLX 0.32 writes for a kernel argument of `dtype`.
fn cuda_type(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Bool => "bool",
        Dtype::Int8 => "int8_t",
        Dtype::Int16 => "int16_t",
        Dtype::Int32 => "int32_t",
        Dtype::Int64 => "int64_t",
        Dtype::Uint8 => "uint8_t",
        Dtype::Uint16 => "uint16_t",
        Dtype::Uint32 => "uint32_t",
        Dtype::Uint64 => "uint64_t",
        Dtype::Float16 => "__half",
        Dtype::Bfloat16 => "__nv_bfloat16",
        Dtype::Float32 => "float",
        Dtype::Float64 => "double",
        _ => "unknown",
    }
}

impl CudaKernel {
    /// `source` is the kernel body; `header` holds device helpers placed before it. Inputs
    /// are `const T*` named by `inputs` (plus `<name>_shape` where the body mentions it),
    /// outputs `T*` named by `outputs`. Inputs are made row-contiguous first. Header and body
    /// reach MLX as `#include` lines of files holding them ([`source_files`]), which makes
    /// each call several microseconds cheaper on the host.
    pub fn new(
        name: &'static str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
    ) -> Result<Self> {
        Self::new_with_shared(name, inputs, outputs, source, header, 0)
    }

    /// [`CudaKernel::new`] for a body that declares `extern __shared__` memory: each block
    /// gets `shared_bytes` of it (over 48 KB, MLX raises the kernel's limit to that).
    pub fn new_with_shared(
        name: &'static str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        shared_bytes: i32,
    ) -> Result<Self> {
        let mlx_header = source_files::included(header);
        let mlx_source = source_files::included(source);
        let text =
            KernelText::new(inputs, outputs, source, header).given_to_mlx(&mlx_header, &mlx_source);
        Self::with_text(
            name,
            inputs,
            outputs,
            &mlx_source,
            &mlx_header,
            text,
            shared_bytes,
        )
    }

    /// [`CudaKernel::new`] with header and body handed to MLX as they are (for measuring
    /// what the text's length costs per call).
    pub fn new_inline(
        name: &'static str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
    ) -> Result<Self> {
        let text = KernelText::new(inputs, outputs, source, header);
        Self::with_text(name, inputs, outputs, source, header, text, 0)
    }

    /// Makes the kernel from the text MLX gets (`source`, `header`); `text` is what
    /// [`capture_kernels`] records for it.
    fn with_text(
        name: &'static str,
        inputs: &[&str],
        outputs: &[&str],
        source: &str,
        header: &str,
        text: KernelText,
        shared_bytes: i32,
    ) -> Result<Self> {
        let c_name = CString::new(name)?;
        let c_source = CString::new(source)?;
        let c_header = CString::new(header)?;
        let names = |list: &[&str]| -> Result<Vec<CString>> {
            list.iter().map(|n| Ok(CString::new(*n)?)).collect()
        };
        let (in_names, out_names) = (names(inputs)?, names(outputs)?);
        // Recording calls needs no MLX kernel (and a CPU-only libmlx makes none). Such a
        // kernel refuses to run outside capture.
        if capturing() {
            return Ok(CudaKernel {
                name,
                raw: mlx_sys::mlx_fast_cuda_kernel {
                    ctx: std::ptr::null_mut(),
                },
                text,
                shared_bytes,
                cached: RefCell::default(),
            });
        }
        // SAFETY: the string vectors are created, filled and freed here; MLX copies them.
        let raw = unsafe {
            let ins = mlx_sys::mlx_vector_string_new();
            for n in &in_names {
                mlx_sys::mlx_vector_string_append_value(ins, n.as_ptr());
            }
            let outs = mlx_sys::mlx_vector_string_new();
            for n in &out_names {
                mlx_sys::mlx_vector_string_append_value(outs, n.as_ptr());
            }
            let raw = mlx_sys::mlx_fast_cuda_kernel_new(
                c_name.as_ptr(),
                ins,
                outs,
                c_source.as_ptr(),
                c_header.as_ptr(),
                true,
                shared_bytes,
            );
            mlx_sys::mlx_vector_string_free(ins);
            mlx_sys::mlx_vector_string_free(outs);
            raw
        };
        if raw.ctx.is_null() {
            bail!("MLX could not create the CUDA kernel {name}");
        }
        Ok(CudaKernel {
            name,
            raw,
            text,
            shared_bytes,
            cached: RefCell::default(),
        })
    }

    /// Adds the kernel to the lazy graph: `grid` counts threads (not blocks) per axis,
    /// `block` threads per block; returns the outputs, one per `(shape, dtype)`.
    pub fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
        template: &[(&CStr, TemplateArg)],
    ) -> Result<Vec<Array>> {
        if capturing() {
            return self.capture(inputs, outputs, grid, block, template);
        }
        if self.raw.ctx.is_null() {
            bail!(
                "the CUDA kernel {} was made without a CUDA libmlx",
                self.name
            );
        }
        self.see_to_cached_module(inputs, outputs, template);
        // SAFETY: every handle is created and freed here; the input arrays outlive the call,
        // and the outputs are taken over as new owned arrays before the vector is freed.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            for (shape, dtype) in outputs {
                mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    shape.as_ptr(),
                    shape.len(),
                    *dtype as u32 as mlx_sys::mlx_dtype,
                );
            }
            mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, grid.0, grid.1, grid.2);
            mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(
                config, block.0, block.1, block.2,
            );
            for (name, arg) in template {
                match arg {
                    TemplateArg::Dtype(d) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                            config,
                            name.as_ptr(),
                            *d as u32 as mlx_sys::mlx_dtype,
                        )
                    }
                    TemplateArg::Int(v) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(
                            config,
                            name.as_ptr(),
                            *v,
                        )
                    }
                    TemplateArg::Bool(v) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_bool(
                            config,
                            name.as_ptr(),
                            *v,
                        )
                    }
                };
            }
            let ins = mlx_sys::mlx_vector_array_new();
            for a in inputs {
                mlx_sys::mlx_vector_array_append_value(ins, a.as_ptr());
            }
            let mut outs = mlx_sys::mlx_vector_array_new();
            let mut device = mlx_sys::mlx_device_new();
            mlx_sys::mlx_get_default_device(&mut device);
            let mut stream = mlx_sys::mlx_stream_new();
            mlx_sys::mlx_get_default_stream(&mut stream, device);
            let rc = mlx_sys::mlx_fast_cuda_kernel_apply(&mut outs, self.raw, ins, config, stream);
            mlx_sys::mlx_stream_free(stream);
            mlx_sys::mlx_device_free(device);
            mlx_sys::mlx_vector_array_free(ins);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            let result = if rc == 0 {
                let n = mlx_sys::mlx_vector_array_size(outs);
                let mut arrays = Vec::with_capacity(n);
                for i in 0..n {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, outs, i);
                    arrays.push(Array::from_ptr(a));
                }
                Ok(arrays)
            } else {
                Err(anyhow::anyhow!("MLX refused the CUDA kernel {}", self.name))
            };
            mlx_sys::mlx_vector_array_free(outs);
            result
        }
    }
}

impl CudaKernel {
    /// [`CudaKernel::apply`] under [`capture_kernels`]: records the call, returns zeros.
    fn capture(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
        template: &[(&CStr, TemplateArg)],
    ) -> Result<Vec<Array>> {
        let t = &self.text;
        if inputs.len() != t.inputs.len() || outputs.len() != t.outputs.len() {
            bail!(
                "kernel {}: {} inputs and {} outputs given for {} and {} names",
                self.name,
                inputs.len(),
                outputs.len(),
                t.inputs.len(),
                t.outputs.len()
            );
        }
        let (name, source, _) = mlx_kernel_source(
            self.name,
            &t.header,
            &t.source,
            &self.input_signature(inputs),
            &self.output_signature(outputs),
            template,
        );
        let blocks = (grid.0 + block.0 - 1) / block.0.max(1);
        CAPTURE.with(|c| {
            if let Some(list) = c.borrow_mut().as_mut() {
                list.push(CapturedKernel {
                    name,
                    source,
                    block: block.0,
                    blocks,
                    shared_bytes: self.shared_bytes,
                });
            }
        });
        outputs
            .iter()
            .map(|(shape, dtype)| Ok(mlx_rs::ops::zeros_dtype(shape, *dtype)?))
            .collect()
    }
}

impl CudaKernel {
    /// Each input's name, dtype and whether it has dimensions (MLX adds shape arguments only
    /// for those).
    fn input_signature<'a>(&'a self, inputs: &[&Array]) -> Vec<(&'a str, Dtype, bool)> {
        self.text
            .inputs
            .iter()
            .zip(inputs)
            .map(|(n, a)| (n.as_str(), a.dtype(), a.ndim() > 0))
            .collect()
    }

    fn output_signature<'a>(&'a self, outputs: &[(&[i32], Dtype)]) -> Vec<(&'a str, Dtype)> {
        self.text
            .outputs
            .iter()
            .zip(outputs)
            .map(|(n, (_, d))| (n.as_str(), *d))
            .collect()
    }

    /// The first time this call's signature (dtypes, template arguments) comes, has
    /// [`kernel_cache`] make sure MLX finds its module compiled on disk.
    fn see_to_cached_module(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        template: &[(&CStr, TemplateArg)],
    ) {
        if !kernel_cache::enabled() {
            return;
        }
        // A cheap key of the call's signature (this runs at every call): each value mixed in
        // by a multiply and a rotation. A template argument's name is keyed by its address, as
        // each call site passes the same literal. Two signatures of one key would only leave
        // the second's compiling to MLX.
        let mut key = 0u64;
        let mut mix = |value: u64| {
            key = (key ^ value)
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(23)
        };
        for a in inputs {
            mix((u64::from(a.dtype() as u32) << 1) | u64::from(a.ndim() > 0));
        }
        for (_, d) in outputs {
            mix(u64::from(*d as u32));
        }
        for (arg, value) in template {
            mix(arg.as_ptr() as u64);
            mix(match value {
                TemplateArg::Dtype(d) => u64::from(*d as u32),
                TemplateArg::Int(v) => (1 << 32) | u64::from(*v as u32),
                TemplateArg::Bool(v) => (2 << 32) | u64::from(*v),
            });
        }
        if !self.cached.borrow_mut().insert(key) {
            return;
        }
        let t = &self.text;
        let (name, source, shaped) = mlx_kernel_source(
            self.name,
            &t.mlx_header,
            &t.mlx_source,
            &self.input_signature(inputs),
            &self.output_signature(outputs),
            template,
        );
        // MLX's Shape and Strides types are not in our stand-in for its device header.
        if !shaped {
            kernel_cache::ensure_compiled(&name, &source);
        }
    }
}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        if self.raw.ctx.is_null() {
            return;
        }
        // SAFETY: `raw` was created by `mlx_fast_cuda_kernel_new` and is freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.raw) }
    }
}

/// A kernel whose source bakes in an RMSNorm epsilon (after [`REDUCE_HEADER`], as `EPS`):
/// one compiled object per epsilon, made at first use. Keep one per thread, like
/// [`CudaKernel`].
pub(crate) struct PerEpsilon {
    name: &'static str,
    inputs: &'static [&'static str],
    outputs: &'static [&'static str],
    source: &'static str,
    /// Device helpers placed after the reductions and `EPS`.
    header: &'static str,
    /// Dynamic shared memory a block gets ([`CudaKernel::new_with_shared`]).
    shared_bytes: i32,
    kernels: HashMap<u32, CudaKernel>,
}

impl PerEpsilon {
    pub(crate) fn new(
        name: &'static str,
        inputs: &'static [&'static str],
        outputs: &'static [&'static str],
        source: &'static str,
    ) -> Self {
        PerEpsilon {
            name,
            inputs,
            outputs,
            source,
            header: "",
            shared_bytes: 0,
            kernels: HashMap::new(),
        }
    }

    /// Adds device helpers after the reductions and `EPS`.
    pub(crate) fn with_header(mut self, header: &'static str) -> Self {
        self.header = header;
        self
    }

    /// Gives each block `bytes` of dynamic shared memory.
    pub(crate) fn with_shared_memory(mut self, bytes: i32) -> Self {
        self.shared_bytes = bytes;
        self
    }

    /// The kernel for `eps`.
    pub(crate) fn get(&mut self, eps: f32) -> Result<&CudaKernel> {
        Ok(match self.kernels.entry(eps.to_bits()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(CudaKernel::new_with_shared(
                self.name,
                self.inputs,
                self.outputs,
                self.source,
                &format!(
                    "{REDUCE_HEADER}\nconstexpr float EPS = {eps:e}f;\n{}",
                    self.header
                ),
                self.shared_bytes,
            )?),
        })
    }
}

/// A [`PerEpsilon`] kernel whose blocks get dynamic shared memory (the window kernels: so many
/// bytes a token), one compiled kernel per amount. MLX sets a kernel's shared memory limit
/// once, when it first loads the compiled function, so each amount gets its own name (and so
/// its own compiled function). Keep one per thread, like [`CudaKernel`].
pub(crate) struct PerSharedMemory {
    name: &'static str,
    inputs: &'static [&'static str],
    outputs: &'static [&'static str],
    source: &'static str,
    header: &'static str,
    kernels: HashMap<usize, PerEpsilon>,
}

impl PerSharedMemory {
    pub(crate) fn new(
        name: &'static str,
        inputs: &'static [&'static str],
        outputs: &'static [&'static str],
        source: &'static str,
        header: &'static str,
    ) -> Self {
        PerSharedMemory {
            name,
            inputs,
            outputs,
            source,
            header,
            kernels: HashMap::new(),
        }
    }

    /// The kernel for `eps` whose blocks get `shared` bytes.
    pub(crate) fn get(&mut self, shared: usize, eps: f32) -> Result<&CudaKernel> {
        let (name, inputs, outputs, source, header) = (
            self.name,
            self.inputs,
            self.outputs,
            self.source,
            self.header,
        );
        self.kernels
            .entry(shared)
            .or_insert_with(|| {
                let name: &'static str = Box::leak(format!("{name}_{shared}").into_boxed_str());
                PerEpsilon::new(name, inputs, outputs, source)
                    .with_header(header)
                    .with_shared_memory(shared as i32)
            })
            .get(eps)
    }
}

/// Device helpers shared by the kernels: block-wide sum and max over `float`, with `red`
/// a `__shared__ float[32]` scratch.
const REDUCE_HEADER: &str = include_str!("cuda/reduce.cuh");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_captured_call_is_recorded_as_mlx_would_compile_it_and_returns_zeros() {
        let x = Array::from_slice(&[1.5f32, 2.0], &[2]);
        let scales = Array::from_slice(&[7i32], &[1]);
        let mut made = None;
        let (outputs, calls) = capture_kernels(|| {
            // Made while capturing: no CUDA libmlx is needed.
            let kernel = made.insert(CudaKernel::new(
                "probe",
                &["x", "scales"],
                &["y"],
                "  y[0] = x[0];",
                "// header of the probe\n",
            )?);
            kernel.apply(
                &[&x, &scales],
                &[(&[3, 2], Dtype::Float32)],
                (512, 1, 1),
                (256, 1, 1),
                &[
                    (c"T", TemplateArg::Dtype(Dtype::Bfloat16)),
                    (c"K", TemplateArg::Int(64)),
                    (c"WIDE", TemplateArg::Bool(true)),
                ],
            )
        })
        .unwrap();
        assert!(!capturing(), "capture mode outlived its call");
        assert_eq!(outputs.len(), 1);
        assert_eq!(outputs[0].shape(), &[3, 2]);
        assert_eq!(outputs[0].as_slice::<f32>(), &[0.0; 6]);
        assert_eq!(calls.len(), 1);
        let call = &calls[0];
        assert_eq!(call.name, "custom_kernel_probe_bfloat16_t_64_t");
        assert_eq!((call.block, call.blocks), (256, 2));
        for line in [
            "// header of the probe",
            "__global__ void custom_kernel_probe_bfloat16_t_64_t(",
            "    const float* x,",
            // Each parameter typed by its array, as MLX types it.
            "    const int32_t* scales,",
            "    float* y) {",
            "  using T = __nv_bfloat16;",
            "  constexpr int K = 64;",
            "  constexpr bool WIDE = true;",
            "  y[0] = x[0];",
        ] {
            assert!(
                call.source.contains(line),
                "no {line:?} in\n{}",
                call.source
            );
        }
        // Outside capture a kernel made while capturing refuses to run.
        assert!(made
            .unwrap()
            .apply(
                &[&x, &scales],
                &[(&[1], Dtype::Float32)],
                (1, 1, 1),
                (1, 1, 1),
                &[]
            )
            .is_err());
    }

    #[test]
    fn one_array_per_distinct_step_values() {
        let a = step_ints(&[17]).unwrap();
        let b = step_ints(&[17]).unwrap();
        assert_eq!(a.as_slice::<i32>(), &[17]);
        assert_eq!(
            a.as_slice::<i32>().as_ptr(),
            b.as_slice::<i32>().as_ptr(),
            "the second layer made a new array"
        );
        assert_eq!(step_ints(&[18]).unwrap().as_slice::<i32>(), &[18]);
        assert_eq!(step_ints(&[5, 256]).unwrap().as_slice::<i32>(), &[5, 256]);
        // Older values give way to newer ones, and come back as new arrays with the same data.
        for v in 0..2 * STEP_INTS_KEPT as i32 {
            step_ints(&[1000 + v]).unwrap();
        }
        assert_eq!(step_ints(&[17]).unwrap().as_slice::<i32>(), &[17]);
    }
}
