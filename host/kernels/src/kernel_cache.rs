//! Our fused kernels compiled once per machine instead of once per process.
//!
//! Why: MLX 0.32 compiles a custom kernel with NVRTC the first time a process runs it, and
//! never writes the result to its disk cache (custom kernels opt out of writing it). Every
//! fresh process therefore compiled all of ours again before its first token: 24.5 s for the
//! 7M default model on an H200 with MLX's own kernels already cached (BENCHMARKS.md), and as
//! long again for each new verify window size. MLX does *read* its disk cache before compiling
//! any module, custom ones included: a module is found as `<cache>/<module>.ptx` (the compiled
//! image), with `<module>.txt` beside it listing each kernel's name and mangled symbol, where
//! `<module>` is the kernel's name, `_`, and the hexadecimal `std::hash` of its full source.
//!
//! So the first time this process meets a kernel (one set of template arguments and dtypes),
//! [`ensure_compiled`] builds the source MLX is about to compile, names its module as MLX will,
//! and if the cache lacks it, compiles it with the NVRTC that libmlx loaded and MLX's options,
//! and writes both files. MLX then loads the image instead of compiling, now and in every later
//! process. The compiles run on threads of their own, one a core, while the host goes on
//! building the forward's graph, and the model waits for them ([`wait_for_compiles`]) before
//! handing the graph to MLX: a first forward's kernels compile side by side, where MLX would
//! compile them one after another. What differs from MLX's own compile is only MLX's device header, which libmlx keeps
//! to itself: NVRTC gets [`STAND_IN_HEADER`] under its name, holding what our kernels use of it.
//! `bench/gpu/run.sh kernel-cache` checks on a GPU that the result matches MLX's compile logit
//! for logit.
//!
//! Nothing here can fail a run: any error (no NVRTC, a compile error, an unwritable cache) is
//! logged once and MLX compiles as it always did. `MLX_SPEC_KERNEL_CACHE=off` turns it off.

use std::collections::HashSet;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};

/// The environment variable that turns the cache off (`off`, `0` or `false`).
pub const KERNEL_CACHE_SWITCH: &str = "MLX_SPEC_KERNEL_CACHE";

/// Our stand-in for MLX's device header (see the file for why it suffices).
pub const STAND_IN_HEADER: &str = include_str!("cuda/mlx_device_stand_in.cuh");

/// The name MLX includes its device header by, first in every custom kernel's source.
const MLX_DEVICE_HEADER_NAME: &str = "mlx/backend/cuda/device/utils.cuh";

/// Longest file name MLX's cache uses; a longer module name is cut into folders of this
/// length, the last piece naming the file (`get_ptx_path` in MLX 0.32's jit_module.cpp).
const MAX_FILE_NAME: usize = 245;

// Set once anything failed: the rest of the process leaves compiling to MLX.
static GAVE_UP: AtomicBool = AtomicBool::new(false);

/// Whether the cache is on for this process (not turned off, nothing failed yet).
pub fn enabled() -> bool {
    static SWITCHED_OFF: OnceLock<bool> = OnceLock::new();
    let off = *SWITCHED_OFF.get_or_init(|| {
        std::env::var(KERNEL_CACHE_SWITCH).is_ok_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "off" | "0" | "false"
            )
        })
    });
    !off && !GAVE_UP.load(Ordering::Relaxed)
}

/// Makes sure MLX's disk cache holds the compiled module of the custom kernel `kernel_name`
/// (as MLX names it: `custom_kernel_…` with the template arguments) whose full source is
/// `source` (exactly as MLX builds it). Where it does not, the module is compiled and written
/// by a thread of its own, so that the many kernels of a first forward compile side by side:
/// [`wait_for_compiles`] waits for them before the forward is evaluated. Never fails.
pub fn ensure_compiled(kernel_name: &str, source: &str) {
    if !enabled() {
        return;
    }
    let (module, image_path) = match module_and_image_path(kernel_name, source) {
        Ok(found) => found,
        Err(err) => return give_up(&err),
    };
    if image_path.is_file() || !first_request(&image_path) {
        return;
    }
    let (name, source) = (kernel_name.to_owned(), source.to_owned());
    COMPILES.started();
    let job = move || {
        COMPILES.take_a_slot();
        if let Err(err) = compile_and_write(&name, &module, &source, &image_path) {
            give_up(&err);
        }
        COMPILES.finished();
    };
    if let Err(err) = std::thread::Builder::new()
        .name("kernel-compile".into())
        .spawn(job)
    {
        // No thread to be had: nothing compiles here, MLX compiles this kernel itself.
        COMPILES.finished_without_a_slot();
        give_up(&anyhow!("no thread for compiling: {err}"));
    }
}

/// Waits until every compile [`ensure_compiled`] started has written its module (or
/// failed). The model calls it before evaluating a forward, so MLX finds the modules instead
/// of compiling them again.
pub fn wait_for_compiles() {
    COMPILES.wait_for_none();
}

fn give_up(err: &anyhow::Error) {
    if !GAVE_UP.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "mlx-spec's kernel cache is off for this process, so MLX compiles each fused kernel in every process: {err:#}"
        );
    }
}

/// Whether `image_path` is asked for the first time in this process (two kernel objects on
/// two threads may meet the same module).
fn first_request(image_path: &Path) -> bool {
    static REQUESTED: OnceLock<Mutex<HashSet<PathBuf>>> = OnceLock::new();
    REQUESTED
        .get_or_init(Mutex::default)
        .lock()
        .map(|mut set| set.insert(image_path.to_path_buf()))
        .unwrap_or(false)
}

/// Compiles running and waiting, with at most one running per core (NVRTC is single-threaded
/// per program and compiles are independent).
struct Compiles {
    state: Mutex<CompileCounts>,
    changed: Condvar,
}

#[derive(Default)]
struct CompileCounts {
    /// Started and not yet finished, running or waiting for a slot.
    unfinished: usize,
    running: usize,
}

static COMPILES: Compiles = Compiles::new();

impl Compiles {
    const fn new() -> Compiles {
        Compiles {
            state: Mutex::new(CompileCounts {
                unfinished: 0,
                running: 0,
            }),
            changed: Condvar::new(),
        }
    }

    fn counts(&self) -> MutexGuard<'_, CompileCounts> {
        // A compile that panicked leaves the counts as they were, which stay usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn started(&self) {
        self.counts().unfinished += 1;
    }

    /// Waits for a slot among as many as the machine has cores.
    fn take_a_slot(&self) {
        self.take_one_of(std::thread::available_parallelism().map_or(4, |n| n.get()));
    }

    fn take_one_of(&self, limit: usize) {
        self.counts_once(|c| c.running < limit).running += 1;
    }

    /// The counts, once `ready` holds of them.
    fn counts_once(&self, ready: impl Fn(&CompileCounts) -> bool) -> MutexGuard<'_, CompileCounts> {
        self.changed
            .wait_while(self.counts(), |c| !ready(c))
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn finished(&self) {
        let mut counts = self.counts();
        counts.running -= 1;
        counts.unfinished -= 1;
        self.changed.notify_all();
    }

    fn finished_without_a_slot(&self) {
        self.counts().unfinished -= 1;
        self.changed.notify_all();
    }

    fn wait_for_none(&self) {
        drop(self.counts_once(|c| c.unfinished == 0));
    }
}

/// The module MLX will look for for `kernel_name` with this source, and where.
fn module_and_image_path(kernel_name: &str, source: &str) -> Result<(String, PathBuf)> {
    let dir = cache_dir().ok_or_else(|| anyhow!("no folder for MLX's kernel cache"))?;
    let module = module_name(kernel_name, source)?;
    let path = image_path(&dir, &module);
    Ok((module, path))
}

fn compile_and_write(
    kernel_name: &str,
    module: &str,
    source: &str,
    image_path: &Path,
) -> Result<()> {
    let started = Instant::now();
    let symbol = format!("mlx::core::cu::{kernel_name}");
    let compiled = nvrtc()?
        .compile(module, source, &symbol)
        .with_context(|| format!("compiling {kernel_name}"))?;
    write_module(image_path, &symbol, &compiled)
        .with_context(|| format!("writing {}", image_path.display()))?;
    tracing::debug!(
        "kernel cache: compiled {kernel_name} in {:.2} s ({} bytes)",
        started.elapsed().as_secs_f64(),
        compiled.image.len()
    );
    Ok(())
}

/// The folder MLX reads its cache from: `MLX_PTX_CACHE_DIR` (which `device::select` sets
/// when the user did not), else MLX's default under the temporary folder.
fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os(crate::cuda::KERNEL_CACHE_VAR) {
        Some(dir) if !dir.is_empty() => Some(PathBuf::from(dir)),
        _ => Some(
            std::env::temp_dir()
                .join("mlx")
                .join(mlx_spec_model::device::mlx_version())
                .join("ptx"),
        ),
    }
}

/// MLX's name for a custom kernel's module: the kernel's name, `_`, and the `std::hash` of
/// its source in lower-case hexadecimal.
pub fn module_name(kernel_name: &str, source: &str) -> Result<String> {
    Ok(format!(
        "{kernel_name}_{:x}",
        cxx_string_hash(source.as_bytes())?
    ))
}

/// `std::hash<std::string>` as libmlx computes it: libstdc++'s `std::_Hash_bytes` with the
/// seed its `std::hash` passes. Called, not reimplemented, so that it is the very function
/// libmlx calls (both use the process's libstdc++).
pub fn cxx_string_hash(bytes: &[u8]) -> Result<usize> {
    #[cfg(target_os = "linux")]
    {
        extern "C" {
            // std::_Hash_bytes(void const*, unsigned long, unsigned long)
            #[link_name = "_ZSt11_Hash_bytesPKvmm"]
            fn libstdcxx_hash_bytes(ptr: *const c_void, len: usize, seed: usize) -> usize;
        }
        // The seed of libstdc++'s std::hash for strings (std::_Hash_impl).
        const SEED: usize = 0xc70f_6907;
        // SAFETY: reads `len` bytes from `ptr`, which `bytes` holds.
        Ok(unsafe { libstdcxx_hash_bytes(bytes.as_ptr().cast(), bytes.len(), SEED) })
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = bytes;
        bail!("the kernel cache serves MLX's CUDA backend, on Linux only")
    }
}

/// Where MLX looks for `module`'s image in `dir` (`<module>.ptx`, or cut into folders).
pub fn image_path(dir: &Path, module: &str) -> PathBuf {
    let mut path = dir.to_path_buf();
    let mut rest = module;
    while rest.len() > MAX_FILE_NAME {
        // Module names are ASCII (identifiers, digits, hexadecimal), so any index is a
        // character boundary.
        let (piece, tail) = rest.split_at(MAX_FILE_NAME);
        path.push(piece);
        rest = tail;
    }
    path.push(format!("{rest}.ptx"));
    path
}

/// Writes the symbol list, then the image under a private name renamed into place: MLX looks
/// for the image first, so it never finds one without its list, nor half of one.
fn write_module(image_path: &Path, symbol: &str, compiled: &Compiled) -> Result<()> {
    let folder = image_path
        .parent()
        .ok_or_else(|| anyhow!("no parent folder"))?;
    std::fs::create_dir_all(folder)?;
    let list = format!("{symbol}\t{}\n", compiled.mangled);
    std::fs::write(image_path.with_extension("txt"), list)?;
    let private = image_path.with_extension(format!("ptx.{}.tmp", std::process::id()));
    std::fs::write(&private, &compiled.image)?;
    std::fs::rename(&private, image_path).inspect_err(|_| {
        std::fs::remove_file(&private).ok();
    })?;
    Ok(())
}

/// A compiled module: the image MLX loads and the kernel's mangled symbol.
struct Compiled {
    image: Vec<u8>,
    mangled: String,
}

type NvrtcProgram = *mut c_void;

/// The NVRTC functions we call, from the library libmlx loaded.
struct Nvrtc {
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int,
    create: unsafe extern "C" fn(
        *mut NvrtcProgram,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    add_name: unsafe extern "C" fn(NvrtcProgram, *const c_char) -> c_int,
    compile: unsafe extern "C" fn(NvrtcProgram, c_int, *const *const c_char) -> c_int,
    log_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    log: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    lowered_name: unsafe extern "C" fn(NvrtcProgram, *const c_char, *mut *const c_char) -> c_int,
    cubin_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    cubin: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    ptx_size: unsafe extern "C" fn(NvrtcProgram, *mut usize) -> c_int,
    ptx: unsafe extern "C" fn(NvrtcProgram, *mut c_char) -> c_int,
    destroy: unsafe extern "C" fn(*mut NvrtcProgram) -> c_int,
    /// `--gpu-architecture=…` and the include folders, as MLX passes them.
    options: Vec<CString>,
    /// Whether NVRTC makes the device's machine code (a cubin) rather than PTX.
    makes_cubin: bool,
}

fn nvrtc() -> Result<&'static Nvrtc> {
    static NVRTC: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| Nvrtc::load().map_err(|e| format!("{e:#}")))
        .as_ref()
        .map_err(|e| anyhow!("{e}"))
}

impl Nvrtc {
    /// NVRTC for CUDA device 0, with the include folders MLX would use.
    fn load() -> Result<Nvrtc> {
        let capability = crate::cuda::cuda_compute_capability()
            .ok_or_else(|| anyhow!("the CUDA runtime reports no compute capability"))?;
        Nvrtc::open(capability, include_dirs()?)
    }

    /// NVRTC compiling for a device of compute capability `(cc_major, cc_minor)`, searching
    /// `include_dirs`.
    fn open((cc_major, cc_minor): (i32, i32), include_dirs: Vec<PathBuf>) -> Result<Nvrtc> {
        use abi_stable::library::RawLibrary;
        let names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];
        let (name, library) = names
            .iter()
            .find_map(|n| RawLibrary::load_at(Path::new(n)).ok().map(|l| (*n, l)))
            .ok_or_else(|| anyhow!("no NVRTC library ({}) loads", names.join(", ")))?;
        // The library stays loaded for the process: the function pointers below point into it.
        let library: &'static RawLibrary = Box::leak(Box::new(library));
        macro_rules! function {
            ($symbol:literal) => {
                // SAFETY: the pointer type matches the NVRTC function's C signature (nvrtc.h).
                *unsafe { library.get(concat!($symbol, "\0").as_bytes()) }
                    .map_err(|e| anyhow!("{name} has no {}: {e}", $symbol))?
            };
        }
        let mut nvrtc = Nvrtc {
            version: function!("nvrtcVersion"),
            create: function!("nvrtcCreateProgram"),
            add_name: function!("nvrtcAddNameExpression"),
            compile: function!("nvrtcCompileProgram"),
            log_size: function!("nvrtcGetProgramLogSize"),
            log: function!("nvrtcGetProgramLog"),
            lowered_name: function!("nvrtcGetLoweredName"),
            cubin_size: function!("nvrtcGetCUBINSize"),
            cubin: function!("nvrtcGetCUBIN"),
            ptx_size: function!("nvrtcGetPTXSize"),
            ptx: function!("nvrtcGetPTX"),
            destroy: function!("nvrtcDestroyProgram"),
            options: Vec::new(),
            makes_cubin: false,
        };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        check(
            unsafe { (nvrtc.version)(&mut major, &mut minor) },
            "nvrtcVersion",
        )?;
        nvrtc.makes_cubin = nvrtc_makes_machine_code((major, minor), (cc_major, cc_minor));
        let architecture = format!(
            "--gpu-architecture={}_{cc_major}{cc_minor}{}",
            if nvrtc.makes_cubin { "sm" } else { "compute" },
            if cc_major >= 9 { "a" } else { "" }
        );
        nvrtc
            .options
            .push(CString::new("--device-as-default-execution-space")?);
        nvrtc.options.push(CString::new(architecture)?);
        for dir in include_dirs {
            nvrtc
                .options
                .push(CString::new(format!("--include-path={}", dir.display()))?);
        }
        tracing::debug!(
            "kernel cache: NVRTC {major}.{minor} ({name}), options {:?}",
            nvrtc.options
        );
        Ok(nvrtc)
    }

    fn compile(&self, module: &str, source: &str, symbol: &str) -> Result<Compiled> {
        let source = CString::new(source)?;
        let file = CString::new(format!("{module}.cu"))?;
        let header = CString::new(STAND_IN_HEADER)?;
        let header_name = CString::new(MLX_DEVICE_HEADER_NAME)?;
        let symbol = CString::new(symbol)?;
        let options: Vec<*const c_char> = self.options.iter().map(|o| o.as_ptr()).collect();
        let mut program: NvrtcProgram = std::ptr::null_mut();
        // SAFETY: every pointer handed to NVRTC points at a live CString or vector of them;
        // the program is destroyed below whatever happens in between.
        unsafe {
            check(
                (self.create)(
                    &mut program,
                    source.as_ptr(),
                    file.as_ptr(),
                    1,
                    &header.as_ptr(),
                    &header_name.as_ptr(),
                ),
                "nvrtcCreateProgram",
            )?;
            let result = self.compile_program(program, &symbol, &options);
            (self.destroy)(&mut program);
            result
        }
    }

    /// The part of [`Nvrtc::compile`] between creating the program and destroying it.
    ///
    /// # Safety
    /// `program` is a live NVRTC program.
    unsafe fn compile_program(
        &self,
        program: NvrtcProgram,
        symbol: &CStr,
        options: &[*const c_char],
    ) -> Result<Compiled> {
        check(
            (self.add_name)(program, symbol.as_ptr()),
            "nvrtcAddNameExpression",
        )?;
        let code = (self.compile)(program, options.len() as c_int, options.as_ptr());
        if code != 0 {
            let mut size = 0usize;
            (self.log_size)(program, &mut size);
            let mut log = vec![0u8; size.max(1)];
            (self.log)(program, log.as_mut_ptr().cast());
            let log = String::from_utf8_lossy(&log);
            bail!("NVRTC error {code}: {}", log.trim_end_matches('\0').trim());
        }
        let mut mangled: *const c_char = std::ptr::null();
        check(
            (self.lowered_name)(program, symbol.as_ptr(), &mut mangled),
            "nvrtcGetLoweredName",
        )?;
        if mangled.is_null() {
            bail!("NVRTC gave no symbol for {}", symbol.to_string_lossy());
        }
        let mangled = CStr::from_ptr(mangled).to_string_lossy().into_owned();
        let (size_of, get, what) = if self.makes_cubin {
            (self.cubin_size, self.cubin, "CUBIN")
        } else {
            (self.ptx_size, self.ptx, "PTX")
        };
        let mut size = 0usize;
        check(size_of(program, &mut size), &format!("nvrtcGet{what}Size"))?;
        let mut image = vec![0u8; size];
        check(
            get(program, image.as_mut_ptr().cast()),
            &format!("nvrtcGet{what}"),
        )?;
        if !self.makes_cubin {
            // PTX comes with its terminating NUL, which MLX's file does not hold.
            while image.last() == Some(&0) {
                image.pop();
            }
        }
        Ok(Compiled { image, mangled })
    }
}

fn check(code: c_int, call: &str) -> Result<()> {
    if code != 0 {
        bail!("{call} returned NVRTC error {code}");
    }
    Ok(())
}

/// Whether NVRTC of `version` compiles to the machine code of a device of compute capability
/// `cc` (else MLX asks it for PTX): as MLX 0.32 decides.
pub fn nvrtc_makes_machine_code(version: (i32, i32), cc: (i32, i32)) -> bool {
    let at_most = |limit: (i32, i32)| cc <= limit;
    match version {
        (major, _) if major < 9 => false,
        (9, _) => at_most((7, 2)),
        (10, _) => at_most((7, 5)),
        (11, 0) => at_most((8, 0)),
        (11, minor) if minor < 8 => at_most((8, 6)),
        _ => true,
    }
}

/// The folders NVRTC searches, found as MLX 0.32 finds them: the headers shipped beside
/// libmlx (`<libmlx>/../../include` and its `cccl`), then the CUDA runtime headers of the
/// Python package beside it (`nvidia/cu13` or `nvidia/cuda_runtime`), else of `CUDA_HOME`,
/// `CUDA_PATH` or /usr/local/cuda.
fn include_dirs() -> Result<Vec<PathBuf>> {
    let mut dirs = Vec::new();
    let root =
        loaded_libmlx().and_then(|lib| lib.parent().and_then(Path::parent).map(Path::to_path_buf));
    let mut runtime_headers = None;
    if let Some(root) = &root {
        let bundled = root.join("include");
        if bundled.is_dir() {
            dirs.push(bundled.clone());
        }
        if bundled.join("cccl").is_dir() {
            dirs.push(bundled.join("cccl"));
        }
        runtime_headers = ["cu13", "cuda_runtime"].iter().find_map(|name| {
            let dir = root.parent()?.join("nvidia").join(name).join("include");
            dir.is_dir().then_some(dir)
        });
    }
    let runtime_headers = match runtime_headers {
        Some(dir) => dir,
        None => {
            let home = std::env::var_os("CUDA_HOME")
                .or_else(|| std::env::var_os("CUDA_PATH"))
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from("/usr/local/cuda"));
            let dir = home.join("include");
            if !dir.is_dir() {
                bail!(
                    "no CUDA headers at {} (set CUDA_HOME to the CUDA toolkit)",
                    dir.display()
                );
            }
            dir
        }
    };
    dirs.push(runtime_headers);
    Ok(dirs)
}

/// The file of the libmlx this process loaded, from the process's memory map.
fn loaded_libmlx() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| {
            Path::new(path)
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "libmlx.so" || n.starts_with("libmlx.so."))
        })
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn the_hash_is_that_of_std_hash_for_strings() {
        // Printed in hexadecimal by `std::hash<std::string>{}(s)`, built with g++ 12
        // (libstdc++) on x86-64: an empty string, a short one, and 1 000 bytes (the
        // eight-byte rounds and no tail).
        assert_eq!(cxx_string_hash(b"").unwrap(), 0x553e_9390_1e46_2a6e);
        assert_eq!(
            cxx_string_hash(b"custom_kernel").unwrap(),
            0x0fb1_53b5_eb72_1449
        );
        assert_eq!(
            cxx_string_hash(&[b'x'; 1000]).unwrap(),
            0x787c_8884_15fe_47ce
        );
    }

    #[test]
    fn compiles_run_at_most_a_slot_each_and_waiting_ends_when_all_are_done() {
        use std::sync::atomic::AtomicUsize;
        use std::sync::Arc;
        let compiles = Arc::new(Compiles::new());
        let (now, most, done) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
        );
        let threads: Vec<_> = (0..6)
            .map(|_| {
                compiles.started();
                let (compiles, now, most, done) =
                    (compiles.clone(), now.clone(), most.clone(), done.clone());
                std::thread::spawn(move || {
                    compiles.take_one_of(2);
                    let running = now.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(running, Ordering::SeqCst);
                    std::thread::sleep(std::time::Duration::from_millis(20));
                    now.fetch_sub(1, Ordering::SeqCst);
                    done.fetch_add(1, Ordering::SeqCst);
                    compiles.finished();
                })
            })
            .collect();
        compiles.wait_for_none();
        assert_eq!(done.load(Ordering::SeqCst), 6);
        assert!(most.load(Ordering::SeqCst) <= 2);
        assert!(most.load(Ordering::SeqCst) >= 1);
        for t in threads {
            t.join().unwrap();
        }
        // Nothing started: no wait.
        Compiles::new().wait_for_none();
    }

    #[test]
    fn a_module_is_requested_once_a_process() {
        let path = Path::new("/nowhere/custom_kernel_requested_once_1.ptx");
        assert!(first_request(path));
        assert!(!first_request(path));
        assert!(first_request(Path::new(
            "/nowhere/custom_kernel_requested_once_2.ptx"
        )));
    }

    #[test]
    fn module_images_go_where_mlx_looks_for_them() {
        let dir = Path::new("/cache");
        assert_eq!(
            image_path(dir, "custom_kernel_heads_2_t_ab12"),
            PathBuf::from("/cache/custom_kernel_heads_2_t_ab12.ptx")
        );
        // Over 245 characters: folders of 245, the rest names the file.
        let long = "k".repeat(245 * 2 + 10);
        let path = image_path(dir, &long);
        let parts: Vec<_> = path
            .strip_prefix(dir)
            .unwrap()
            .iter()
            .map(|p| p.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            parts,
            vec![
                "k".repeat(245),
                "k".repeat(245),
                format!("{}.ptx", "k".repeat(10))
            ]
        );
        // Exactly 245 stays one file.
        let edge = "e".repeat(245);
        assert_eq!(image_path(dir, &edge), dir.join(format!("{edge}.ptx")));
    }

    #[test]
    fn nvrtc_makes_machine_code_as_mlx_decides() {
        // An H200 (9.0) with CUDA 12 and 13's NVRTC: a cubin.
        assert!(nvrtc_makes_machine_code((12, 9), (9, 0)));
        assert!(nvrtc_makes_machine_code((13, 0), (9, 0)));
        // NVRTC 11.0 knew devices up to 8.0, 11.1-11.7 up to 8.6: PTX beyond.
        assert!(nvrtc_makes_machine_code((11, 0), (8, 0)));
        assert!(!nvrtc_makes_machine_code((11, 0), (8, 6)));
        assert!(nvrtc_makes_machine_code((11, 7), (8, 6)));
        assert!(!nvrtc_makes_machine_code((11, 7), (8, 9)));
        assert!(nvrtc_makes_machine_code((11, 8), (9, 0)));
        assert!(!nvrtc_makes_machine_code((10, 2), (8, 0)));
        assert!(!nvrtc_makes_machine_code((8, 0), (5, 0)));
    }

    #[test]
    fn a_written_module_is_found_with_its_symbol_list() {
        let dir = tempfile::tempdir().unwrap();
        let path = image_path(dir.path(), "custom_kernel_x_1f");
        let compiled = Compiled {
            image: b"\x7fELF image".to_vec(),
            mangled: "_ZN3mlx4core2cu18custom_kernel_x_1fEPKfPf".into(),
        };
        write_module(&path, "mlx::core::cu::custom_kernel_x_1f", &compiled).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), compiled.image);
        assert_eq!(
            std::fs::read_to_string(path.with_extension("txt")).unwrap(),
            "mlx::core::cu::custom_kernel_x_1f\t_ZN3mlx4core2cu18custom_kernel_x_1fEPKfPf\n"
        );
        // Nothing private is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }
}
